"""Overlapped averages (`overlap=True`): the reference maths' invariants, the
TensorFlow implementation against the reference, and the train function's
structure that lets the all-reduce run while the step computes."""

import internals
import keras
import numpy as np
import pytest
import tensorflow as tf
from conftest import max_replica_spread, mirrored
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from test_against_reference import (
    INNERS,
    LR,
    REPLICAS,
    STEPS_PER_EPOCH,
    assert_relative,
    corrections_of,
    reference,
    train_keras,
    weights_of,
)
from test_maths import betas, fixed_grads, problems, rates

import keras_skip
from keras_skip import _compat, maths

# The reference maths ----------------------------------------------------------


def simulate(problem, **kwargs):
    """`maths.simulate` on a drawn problem (its replicas, steps and gradients)."""
    n, _dim, steps, grads, x0 = problem
    kwargs = {"n": n, "steps": steps, **kwargs}
    return maths.simulate(x0, fixed_grads(grads), **kwargs)


@given(
    hnp.arrays(np.float64, (3, 4), elements=st.floats(-10, 10)),
    hnp.arrays(np.float64, (3, 4), elements=st.floats(-10, 10)),
)
def test_overlapped_average_keeps_the_mean_and_each_replicas_own_step(snapshot, step):
    now = snapshot + step
    averaged = np.broadcast_to(snapshot.mean(0, keepdims=True), snapshot.shape)
    x = maths.overlapped_average(averaged, now, snapshot)
    np.testing.assert_allclose(x.mean(0), now.mean(0), atol=1e-9)
    np.testing.assert_allclose(x - x.mean(0), step - step.mean(0), atol=1e-9)
    # No step between the snapshot and the arrival: the plain average.
    np.testing.assert_array_equal(
        maths.overlapped_average(averaged, snapshot, snapshot), averaged
    )


@settings(deadline=None)
@given(problems(min_n=2, min_steps=2), st.integers(2, 8), betas, rates)
def test_overlap_with_no_step_in_between_is_the_plain_algorithm(
    problem, interval, beta, lr
):
    """A due step with learning rate 0 moves nothing (plain SGD): the
    snapshot is the weights after the step, so overlap changes nothing."""

    def rate(t):
        return 0.0 if (t + 1) % interval == 0 else lr

    kwargs = dict(learning_rate=rate, interval=interval, correction=beta)
    plain = simulate(problem, **kwargs)
    overlapped = simulate(problem, overlap=True, **kwargs)
    np.testing.assert_allclose(overlapped.x, plain.x, rtol=1e-9, atol=1e-9)
    np.testing.assert_allclose(
        overlapped.correction, plain.correction, rtol=1e-9, atol=1e-9
    )
    assert overlapped.interval_averages == plain.interval_averages


@settings(deadline=None)
@given(problems(min_n=2, min_steps=2), st.integers(2, 8), rates)
def test_after_an_overlapped_average_replicas_differ_by_their_last_step_only(
    problem, interval, lr
):
    """Plain local SGD (beta 0): right after an overlapped average, replica
    i's deviation from the replicas' mean is its own last step's deviation."""
    _n, _dim, steps, grads, _x0 = problem
    result = simulate(
        problem, learning_rate=lr, interval=interval, correction=0.0, overlap=True
    )
    for t in range(interval - 1, steps, interval):
        x = result.history[t]
        step = -lr * grads[t]
        np.testing.assert_allclose(
            x - x.mean(0), step - step.mean(0), rtol=1e-7, atol=1e-7
        )


@settings(deadline=None)
@given(
    st.integers(1, 30),
    st.integers(2, 9),
    st.sets(st.integers(1, 30), max_size=5),
    problems(min_n=2, min_steps=30),
    st.sampled_from(["local", "average", "reset"]),
)
def test_overlap_averages_as_often_and_boundaries_leave_replicas_identical(
    steps, interval, boundaries, problem, policy
):
    kwargs = dict(
        steps=steps,
        learning_rate=0.05,
        interval=interval,
        correction=1.0,
        inner=maths.sgd(0.9),
        optimizer_state=policy,
        boundaries=boundaries,
    )
    plain = simulate(problem, **kwargs)
    overlapped = simulate(problem, overlap=True, **kwargs)
    assert overlapped.interval_averages == plain.interval_averages
    assert overlapped.boundary_averages == plain.boundary_averages
    for t in boundaries:
        if t <= steps:
            x = overlapped.history[t - 1]
            np.testing.assert_allclose(x, np.broadcast_to(x[:1], x.shape), atol=1e-9)


@settings(deadline=None)
@given(problems(min_steps=2), st.integers(2, 8), betas, rates)
def test_overlap_with_identical_replicas_is_one_replica(problem, interval, beta, lr):
    _n, _dim, steps, grads, x0 = problem
    n = 3
    same = np.repeat(grads[:, :1], n, axis=1)
    result = maths.simulate(
        x0,
        fixed_grads(same),
        n=n,
        steps=steps,
        learning_rate=lr,
        interval=interval,
        correction=beta,
        inner=maths.sgd(0.9),
        overlap=True,
    )
    single = maths.simulate(
        x0,
        fixed_grads(grads[:, :1]),
        n=1,
        steps=steps,
        learning_rate=lr,
        interval=interval,
        correction=beta,
        inner=maths.sgd(0.9),
    )
    np.testing.assert_allclose(result.x, np.repeat(single.x, n, 0), atol=1e-9)
    np.testing.assert_allclose(result.correction, 0, atol=1e-9)  # mean's rounding


def test_overlap_with_correction_reaches_the_optimum_of_heterogeneous_quadratics():
    n, interval, lr = 4, 6, 0.05
    rng = np.random.default_rng(0)
    a, A = rng.normal(size=(n, 2)) * 3, rng.uniform(0.5, 2.0, size=(n, 2))
    x_star = (A * a).sum(0) / A.sum(0)

    def run(beta):
        return maths.simulate(
            np.zeros(2),
            lambda t, x: A * (x - a),
            n=n,
            steps=interval * 400,
            learning_rate=lr,
            interval=interval,
            correction=beta,
            overlap=True,
            boundaries=[interval * 400],
        ).x[0]

    assert np.abs(run(1.0) - x_star).max() < 1e-6
    assert np.abs(run(0.0) - x_star).max() > 1e-2  # plain local SGD stays biased


# TensorFlow against the reference ---------------------------------------------


@pytest.mark.parametrize(
    ("inner", "interval", "correction"),
    [("sgd", 2, 1.0), ("momentum", 3, 1.0), ("momentum", 4, 0.5), ("sgd", 4, 0.0)],
)
def test_fit_with_overlap_matches_reference(inner, interval, correction):
    make_keras, make_reference = INNERS[inner]
    model, optimizer = train_keras(
        mirrored(REPLICAS),
        make_keras,
        interval=interval,
        correction=correction,
        overlap=True,
    )
    expected = reference(
        make_reference(), interval=interval, correction=correction, overlap=True
    )
    plain = reference(make_reference(), interval=interval, correction=correction)
    assert np.abs(expected.x - plain.x).max() > 1e-3  # overlap changes the path
    assert_relative(weights_of(model), expected.x)
    if correction:
        assert_relative(corrections_of(optimizer), expected.correction)
    assert optimizer.averages_performed == expected.averages


@pytest.mark.parametrize(
    "options",
    [
        dict(optimizer_state="average"),
        dict(optimizer_state="reset"),
        dict(steps_per_execution=3, interval=2),
        dict(outer=True, compression="bfloat16", measure_drift=True),
        dict(group_size=2),
    ],
    ids=["average", "reset", "steps_per_execution", "outer+bfloat16+drift", "groups"],
)
def test_overlap_with_options_matches_reference(options):
    options = dict(options)
    make_keras, make_reference = INNERS["momentum"]
    skip = dict(interval=options.pop("interval", 3), correction=1.0, overlap=True)
    keras_only, reference_only = {}, {}
    if options.pop("outer", False):
        keras_only["make_outer"] = lambda: keras.optimizers.SGD(
            0.7, momentum=0.9, nesterov=True
        )
        reference_only = dict(outer=maths.sgd(0.9, True), outer_learning_rate=0.7)
    if "steps_per_execution" in options:
        keras_only["steps_per_execution"] = options.pop("steps_per_execution")
    measure_drift = options.pop("measure_drift", False)
    model, optimizer = train_keras(
        mirrored(REPLICAS),
        make_keras,
        measure_drift=measure_drift,
        **skip,
        **options,
        **keras_only,
    )
    expected = reference(make_reference(), **skip, **options, **reference_only)
    assert_relative(weights_of(model), expected.x)
    assert_relative(corrections_of(optimizer), expected.correction, tolerance=1e-4)
    assert optimizer.averages_performed == expected.averages
    if measure_drift:
        np.testing.assert_allclose(
            optimizer.drift, [sum(expected.drifts), expected.drifts[-1]], rtol=1e-5
        )


def test_adam_with_overlap_matches_reference():
    model, optimizer = train_keras(
        mirrored(REPLICAS),
        lambda: keras.optimizers.Adam(0.01),
        interval=3,
        correction=1.0,
        overlap=True,
    )
    expected = reference(
        maths.adam(), learning_rate=0.01, interval=3, correction=1.0, overlap=True
    )
    assert_relative(weights_of(model), expected.x)
    assert_relative(corrections_of(optimizer), expected.correction, tolerance=1e-4)


@pytest.mark.parametrize(
    "make_inner",
    [
        lambda: keras.optimizers.RMSprop(0.01, centered=True),
        lambda: keras.optimizers.Adam(0.01),
    ],
    ids=["rmsprop-centered", "adam"],
)
def test_reset_slots_start_again_after_an_overlapped_average(make_inner):
    """Reset slots take no share of the overlapped step: adding its change to
    a reset second moment would make it negative, and the weights NaN."""
    model, optimizer = train_keras(
        mirrored(REPLICAS),
        make_inner,
        interval=5,
        correction=1.0,
        overlap=True,
        optimizer_state="reset",
    )
    assert np.isfinite(weights_of(model)).all()
    if isinstance(optimizer.inner_optimizer, keras.optimizers.Adam):
        expected = reference(
            maths.adam(),
            learning_rate=0.01,
            interval=5,
            correction=1.0,
            overlap=True,
            optimizer_state="reset",
        )
        assert_relative(weights_of(model), expected.x, tolerance=1e-4)


def test_replicas_keep_their_last_step_until_the_next_average():
    """Interval 4, 6 steps per epoch: after step 4 the replicas are apart by
    that step, which counts as not yet averaged; at the epoch's end they are
    identical. The average due at the epoch's last step (interval 3) is the
    boundary average, taken once."""
    seen = []

    class Spy(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            optimizer = self.model.optimizer
            seen.append(
                (
                    batch,
                    optimizer.local_steps_since_average,
                    optimizer.averages_performed,
                    max_replica_spread(self.model.trainable_variables),
                )
            )

    model, optimizer = train_keras(
        mirrored(REPLICAS),
        INNERS["sgd"][0],
        interval=4,
        correction=1.0,
        overlap=True,
        callbacks=[Spy()],
    )
    after_average = seen[3]  # the first epoch's 4th step
    assert after_average[1:3] == (1, 1)  # its own step is pending
    assert after_average[3] > 1e-4
    assert seen[STEPS_PER_EPOCH - 1][1] == 0  # the epoch's boundary average
    assert seen[STEPS_PER_EPOCH - 1][3] == 0.0
    assert max_replica_spread(model.trainable_variables) == 0.0

    model, optimizer = train_keras(
        mirrored(REPLICAS), INNERS["sgd"][0], interval=3, correction=1.0, overlap=True
    )
    assert optimizer.averages_performed == 2 * 2  # not 3 per epoch
    assert not internals.separate_average_functions(optimizer)  # in the last step, full
    expected = reference(maths.sgd(), interval=3, correction=1.0, overlap=True)
    assert expected.averages == optimizer.averages_performed
    assert_relative(weights_of(model), expected.x)


def test_custom_loop_average_takes_the_pending_step():
    from test_custom_loop import dataset, linear_model, make_step

    strategy = mirrored(2)
    model, optimizer = linear_model(
        strategy, lambda: keras.optimizers.SGD(LR), interval=2, overlap=True
    )
    step = make_step(strategy, model, optimizer, "compute_average_loss")
    batches = iter(dataset(strategy))
    for _ in range(2):
        step(next(batches))
    assert optimizer.averages_performed == 1
    assert optimizer.local_steps_since_average == 1  # the overlapped step
    # The counters the adaptive probe reads count the same steps.
    assert optimizer.steering.counters()[:2] == (1, 1)
    assert max_replica_spread(model.trainable_variables) > 0
    assert optimizer.average() is True
    assert optimizer.local_steps_since_average == 0
    assert max_replica_spread(model.trainable_variables) == 0.0
    assert optimizer.average() is False


@pytest.mark.parametrize("overlap", [True, 3], ids=["one-step", "delayed"])
def test_adaptive_interval_with_overlap_probes_full_averages(overlap):
    model, optimizer = train_keras(
        mirrored(REPLICAS),
        INNERS["sgd"][0],
        interval=1,
        correction=1.0,
        overlap=overlap,
        callbacks=[keras_skip.AdaptiveIntervalCallback(verbose=0, max_interval=2)],
    )
    decision = optimizer.interval_decision
    assert decision is not None and decision.interval == optimizer.interval
    # t_comm is a full average's wire time; the rule counts what the steps
    # beside an overlapped one would hide (the default share, 0.5).
    assert decision.interval == maths.adaptive_interval(
        decision.t_comm,
        decision.t_comp,
        max_interval=2,
        overlap=int(overlap),
        overlap_share=maths.OVERLAP_SHARE,
    )
    assert internals.full_average_step(optimizer) == -1  # nothing left overridden
    assert max_replica_spread(model.trainable_variables) == 0.0


def test_an_interval_as_long_as_the_epoch_warns_that_nothing_overlaps():
    with pytest.warns(
        UserWarning, match=r"overlap=True\) has no effect at interval=6"
    ) as caught:
        train_keras(mirrored(REPLICAS), INNERS["sgd"][0], interval=6, overlap=True)
    # The warning points at the code that called fit, not into keras-skip.
    [warning] = [w for w in caught if "has no effect" in str(w.message)]
    assert warning.filename == train_keras.__code__.co_filename


def test_overlap_is_saved_in_the_config_and_checked(tmp_path):
    strategy = mirrored(2)
    with strategy.scope():
        optimizer = keras_skip.SkipCorrectionOptimizer(
            keras.optimizers.SGD(LR), interval=3, overlap=True
        )
    config = optimizer.get_config()
    assert config["overlap"] is True
    with strategy.scope():
        assert keras_skip.SkipCorrectionOptimizer.from_config(config).overlap is True
    with pytest.raises(
        TypeError, match=r"`overlap` must be True, False or an integer.*'yes'"
    ):
        keras_skip.SkipCorrectionOptimizer(keras.optimizers.SGD(LR), overlap="yes")


def test_a_save_during_an_override_keeps_overlap_for_the_restored_run(tmp_path):
    model, optimizer = train_keras(
        mirrored(2 if REPLICAS < 2 else REPLICAS),
        INNERS["sgd"][0],
        interval=3,
        correction=1.0,
        overlap=True,
    )
    optimizer.steering.hold(5)
    assert internals.full_average_step(optimizer) >= 0
    path = tmp_path / "model.keras"
    model.save(path)
    optimizer.steering.release()
    with mirrored(REPLICAS).scope():
        restored = keras.saving.load_model(path)
    assert restored.optimizer.interval == 3
    assert internals.full_average_step(restored.optimizer) == -1


# The train function lets the all-reduce run while the step computes -----------


def _independent_all_reduces(overlap: bool) -> int:
    """Traces one train step under MultiWorkerMirroredStrategy over two local
    devices (real collective all-reduce ops) and counts the conditional all-reduces
    of the local step that wait for nothing computed from the batch, through
    data or control edges: those the runtime can run during the forward and
    backward pass."""
    strategy = tf.distribute.MultiWorkerMirroredStrategy._from_local_devices(
        ["/cpu:0", "/cpu:1"]
    )
    _compat.isolate_collective_keys(strategy)
    with strategy.scope():
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
        optimizer = keras_skip.SkipCorrectionOptimizer(
            keras.optimizers.SGD(LR), interval=2, overlap=overlap
        )
        model.compile(optimizer=optimizer, loss="mse")
        optimizer.build(model.trainable_variables)
    optimizer.attach(model)

    @tf.function
    def train_step(x, y):
        return strategy.run(model.train_step, args=((x, y),))

    graph = train_step.get_concrete_function(
        tf.TensorSpec((4, 3), tf.float32), tf.TensorSpec((4, 2), tf.float32)
    ).graph
    from_batch = _descendants(graph, graph.inputs[:2])
    steps = [op for op in graph.get_operations() if hasattr(op, "_false_graph")]
    (choice,) = [op for op in steps if _holds_all_reduce(op._false_graph)]
    assert not any(c in from_batch for c in choice.control_inputs)
    local_step = choice._false_graph  # tf.cond(is_synchronous, ..., local_step)
    seeds = [
        inner
        for inner, outer in zip(local_step.inputs, choice.inputs[1:], strict=True)
        if outer.op in from_batch
    ]
    assert seeds  # the gradients enter the local step
    waits = _descendants(local_step, seeds)
    return sum(
        1
        for op in local_step.get_operations()
        if hasattr(op, "_true_graph")
        and _holds_all_reduce(op._true_graph)
        and op not in waits
    )


def _descendants(graph, tensors) -> set:
    """The operations of `graph` that depend on any of `tensors`."""
    found = {t.op for t in tensors}
    for op in graph.get_operations():  # in creation order: inputs come first
        if any(t.op in found for t in op.inputs) or any(
            c in found for c in op.control_inputs
        ):
            found.add(op)
    return found


def _holds_all_reduce(graph) -> bool:
    for op in graph.get_operations():
        if op.type.startswith("Collective"):
            return True
        for branch in ("_true_graph", "_false_graph"):
            if hasattr(op, branch) and _holds_all_reduce(getattr(op, branch)):
                return True
    return False


def test_the_overlapped_all_reduce_waits_for_nothing_the_step_computes():
    """Without overlap, the interval average's all-reduce follows the local
    update, which needs the gradients; with it, the all-reduce depends only
    on the weights read before the step."""
    assert _independent_all_reduces(overlap=False) == 0
    assert _independent_all_reduces(overlap=True) == 1
