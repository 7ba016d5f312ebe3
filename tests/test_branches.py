"""`model.fit` traces only the step branch an execution takes, with the same
result as the function that chooses with a condition at every step."""

import keras
import numpy as np
import pytest
from conftest import mirrored
from hypothesis import given
from hypothesis import strategies as st

import keras_skip
from keras_skip import _overlap, _step

N_SAMPLES, D, BATCH = 96, 6, 16


@given(
    interval=st.integers(1, 64),
    iterations=st.integers(0, 200),
    warmup_steps=st.integers(0, 64),
    steps=st.integers(1, 32),
)
def test_a_branch_is_the_one_every_step_of_the_execution_takes(
    interval, iterations, warmup_steps, steps
):
    branch = _step.branch_of_execution(interval, iterations, warmup_steps)
    # The condition each step evaluates in the graph (`Step.__call__`).
    taken = {
        _step.SYNCHRONOUS if interval <= 1 or t < warmup_steps else _step.LOCAL
        for t in range(iterations, iterations + steps)
    }
    if branch is not None:
        assert taken == {branch}
    else:
        assert interval > 1 and iterations < warmup_steps


def test_taking_rejects_an_unknown_branch():
    step = _step.Step.__new__(_step.Step)
    step._only = None
    step._schedule = _overlap.Sequential.__new__(_overlap.Sequential)
    with (
        pytest.raises(ValueError, match="branch 'local, held' needs fragments"),
        step.taking(_step.LOCAL_HELD),
    ):
        pass
    expected = (
        "branch must be None, 'synchronous', 'local', 'local, held', "
        "'local, not held'; got 'both'"
    )
    with pytest.raises(ValueError, match=expected), step.taking("both"):
        pass


def data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(N_SAMPLES, D)).astype("float32")
    y = (x @ rng.normal(size=(D, 3)) > 0).astype("float32")
    return x, y


class IntervalPerEpoch(keras.callbacks.Callback):
    """Sets the optimizer's interval at each epoch's start."""

    def __init__(self, intervals):
        super().__init__()
        self.intervals = intervals

    def on_epoch_begin(self, epoch, logs=None):
        self.model.optimizer.interval = self.intervals[epoch]


def fit(intervals, warmup_steps=0, callbacks=(), **optimizer_options):
    """Trains 4 replicas for one epoch per entry of `intervals`, two steps
    per execution, with the `callbacks` first; returns the model."""
    x, y = data()
    with mirrored(4).scope():
        keras.utils.set_random_seed(3)
        model = keras.Sequential(
            [
                keras.Input((D,)),
                keras.layers.Dense(16, activation="relu"),
                keras.layers.Dense(3, activation="sigmoid"),
            ]
        )
        optimizer = keras_skip.SkipCorrectionOptimizer(
            keras.optimizers.Adam(0.01),
            interval=intervals[0],
            warmup_steps=warmup_steps,
            **optimizer_options,
        )
        model.compile(
            optimizer=optimizer, loss="binary_crossentropy", steps_per_execution=2
        )
    model.fit(
        x,
        y,
        batch_size=BATCH,
        epochs=len(intervals),
        shuffle=False,
        verbose=0,
        callbacks=[
            *callbacks,
            IntervalPerEpoch(intervals),
            keras_skip.SkipCorrectionCallback(),
        ],
    )
    return model


def conditions_named(graphs, name: str) -> list[str]:
    """The ops of the traced graphs (and the graphs inside them) whose last
    name component starts with `name`."""
    found = []

    def visit(graph):
        for op in graph.get_operations():
            if op.name.rsplit("/", 1)[-1].startswith(name):
                found.append(op.name)
            for inner in ("_true_graph", "_false_graph", "_body_graph", "_cond_graph"):
                if hasattr(op, inner):
                    visit(getattr(op, inner))

    for graph in graphs:
        visit(graph)
    return found


def synchronizing_conditions(graphs) -> list[str]:
    """The names of the conditions that choose between a synchronous and a
    local step, in the traced graphs and the loops in them."""
    return conditions_named(graphs, "synchronous_step")


def counters(model):
    optimizer = model.optimizer
    return optimizer.synchronous_steps, optimizer.averages_performed


def test_fit_traces_one_branch_and_equals_the_condition(monkeypatch):
    # Averaged slots: the synchronous branch also averages them when needed.
    intervals = [4, 1, 3]
    model = fit(intervals, optimizer_state="average")
    graphs = model.train_function.traced_graphs
    # Two functions (local, then synchronous), a step and an execution each,
    # and no condition between the branches in any of them.
    assert len(graphs) == 4
    assert synchronizing_conditions(graphs) == []

    monkeypatch.setattr(_step, "branch_of_execution", lambda *counters: None)
    reference = fit(intervals, optimizer_state="average")
    assert synchronizing_conditions(reference.train_function.traced_graphs)
    assert counters(model) == counters(reference)
    assert counters(model)[0] == N_SAMPLES // BATCH  # the epoch at interval 1
    for got, want in zip(model.get_weights(), reference.get_weights(), strict=True):
        np.testing.assert_array_equal(got, want)


def test_a_warmup_keeps_the_condition_for_the_whole_fit():
    # A warm-up of 5 steps ends inside the third execution of two steps: one
    # function, with the condition, serves the warm-up and every later step.
    model = fit([4, 4], warmup_steps=5)
    graphs = model.train_function.traced_graphs
    assert len(graphs) == 2
    assert synchronizing_conditions(graphs)
    assert counters(model)[0] == 5


class HoldFirstExecution(keras.callbacks.Callback):
    """Holds the interval for the first execution of the fit, as the adaptive
    probe holds its rounds: it ends with a full average."""

    def on_train_batch_begin(self, batch, logs=None):
        if self.model.optimizer.iterations.numpy() == 0:
            steering = self.model.optimizer.steering
            steering.hold(steering.local_steps() + self.model.steps_per_execution)

    def on_train_batch_end(self, batch, logs=None):
        steering = self.model.optimizer.steering
        if steering.held:
            steering.release()


@pytest.mark.parametrize("overlap", [False, 2], ids=["sequential", "delayed"])
def test_fragments_trace_held_and_free_executions_apart(monkeypatch, overlap):
    # 2 fragments at interval 7, epochs of 6 steps run 2 per execution: the
    # first execution is held and ends with a full average; then fragment 0
    # falls due after 3 more steps, and each epoch ends with the boundary
    # average, after its last execution (not held: with fragments that
    # would trace a third function).
    taken = []
    taking = _step.Step.taking

    def spy(step, branch):
        taken.append(branch)
        return taking(step, branch)

    monkeypatch.setattr(_step.Step, "taking", spy)
    hold = [HoldFirstExecution()]
    model = fit([7, 7], fragments=2, overlap=overlap, callbacks=hold)
    assert taken == [_step.LOCAL_HELD] + [_step.LOCAL_FREE] * 5
    graphs = model.train_function.traced_graphs
    assert len(graphs) == 4  # two functions, a step and an execution each
    assert conditions_named(graphs, "average_held") == []

    # The function that chooses at every step: one, with the condition.
    monkeypatch.setattr(
        _step.Step,
        "branch_of_next_execution",
        lambda step: _step.branch_of_execution(
            int(step._interval.numpy()), int(step._iterations.numpy()), 0
        ),
    )
    reference = fit([7, 7], fragments=2, overlap=overlap, callbacks=hold)
    assert conditions_named(reference.train_function.traced_graphs, "average_held")
    assert counters(model) == counters(reference)
    assert model.optimizer.averages_performed == 5
    for got, want in zip(model.get_weights(), reference.get_weights(), strict=True):
        np.testing.assert_array_equal(got, want)
