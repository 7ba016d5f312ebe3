"""Streaming averages (`fragments=F`) in the TensorFlow implementation.

The trainable variables are split into ``F`` fragments of whole variables
(`keras_skip._fragments.partition`), each averaged on its own schedule. A
model of two Dense layers on separate slices of the input, summed, has four
trainable variables of different sizes, so the fragments differ. It trains
with `model.fit` on 4 MirroredStrategy replicas on the data of
test_against_reference (each replica's rows from its own linear target), and
its weights, corrections and counters are compared with the NumPy reference
(`keras_skip.maths.simulate` with the optimizer's fragments as index arrays).
Also checked: the partition itself, the arguments refused with fragments,
the bytes each fragment's average sends, and saving and loading.
"""

import internals
import keras
import numpy as np
import pytest
import tensorflow as tf
from conftest import components, mirrored
from hypothesis import given, settings
from hypothesis import strategies as st
from test_against_reference import (
    EPOCHS,
    GLOBAL_BATCH,
    INNERS,
    LR,
    REPLICAS,
    STEPS_PER_EPOCH,
    B,
    D,
    assert_relative,
    make_data,
)
from test_saving import assert_same_state, per_replica_state

import keras_skip
from keras_skip import _fragments, maths

#: The first Dense layer sees features [0, SPLIT), the second the rest.
SPLIT = 2
STEPS = STEPS_PER_EPOCH * EPOCHS
BOUNDARIES = tuple(range(STEPS_PER_EPOCH, STEPS + 1, STEPS_PER_EPOCH))
#: Coordinates in the optimizer's order: kernel 1 (2), bias 1, kernel 2 (3),
#: bias 2, that is variables of 8, 4, 12 and 4 bytes.
VARIABLE_BYTES = [4 * SPLIT, 4, 4 * (D - SPLIT), 4]
#: `partition(VARIABLE_BYTES, F)` as coordinates.
EXPECTED_FRAGMENTS = {
    2: [[0, 1, 2], [3, 4, 5, 6]],
    3: [[0, 1], [2, 6], [3, 4, 5]],
    4: [[0, 1], [2], [3, 4, 5], [6]],
}


def start_weights(seed=1):
    """Kernel 1, bias 1, kernel 2, bias 2."""
    rng = np.random.default_rng(seed)
    return [
        rng.normal(size=(SPLIT, 1)) * 0.1,
        rng.normal(size=(1,)) * 0.1,
        rng.normal(size=(D - SPLIT, 1)) * 0.1,
        rng.normal(size=(1,)) * 0.1,
    ]


def split_linear_model():
    """``Dense(1)(x[:, :SPLIT]) + Dense(1)(x[:, SPLIT:])`` from `start_weights`."""
    kernel1, bias1, kernel2, bias2 = start_weights()

    def dense(kernel, bias):
        return keras.layers.Dense(
            1,
            kernel_initializer=keras.initializers.Constant(kernel),
            bias_initializer=keras.initializers.Constant(bias),
        )

    inputs = keras.Input((D,))
    left = dense(kernel1, bias1)(inputs[:, :SPLIT])
    right = dense(kernel2, bias2)(inputs[:, SPLIT:])
    return keras.Model(inputs, keras.layers.Add()([left, right]))


def grad_fn(x, y):
    """Each replica's gradient of its mean squared error, in the coordinate
    order of `EXPECTED_FRAGMENTS`."""

    def fn(t, params):
        xb, yb = x[t % STEPS_PER_EPOCH], y[t % STEPS_PER_EPOCH]
        k1, b1, k2, b2 = np.split(params, [SPLIT, SPLIT + 1, D + 1], axis=1)
        x1, x2 = xb[..., :SPLIT], xb[..., SPLIT:]
        residual = (
            np.einsum("rbd,rd->rb", x1, k1)
            + b1
            + np.einsum("rbd,rd->rb", x2, k2)
            + b2
            - yb
        )
        g_k1 = 2 / B * np.einsum("rb,rbd->rd", residual, x1)
        g_k2 = 2 / B * np.einsum("rb,rbd->rd", residual, x2)
        g_bias = 2 / B * residual.sum(axis=1, keepdims=True)
        return np.concatenate([g_k1, g_bias, g_k2, g_bias], axis=1)

    return fn


class Trace(keras.callbacks.Callback):
    """After each execution that does not end an epoch (whose end takes the
    boundary average): the fragments' local steps, ``gamma`` and the
    averages performed, by the number of steps taken."""

    def __init__(self):
        super().__init__()
        self.rows = {}

    def on_train_batch_end(self, batch, logs=None):
        optimizer = self.model.optimizer
        steps = int(optimizer.iterations.numpy())
        if steps % STEPS_PER_EPOCH:
            self.rows[steps] = (
                internals.fragment_local_steps(optimizer),
                internals.gamma(optimizer),
                optimizer.averages_performed,
            )


def compile_model(strategy, make_inner, steps_per_execution=1, make_outer=None, **skip):
    with strategy.scope():
        model = split_linear_model()
        if make_outer is not None:
            skip["outer_optimizer"] = make_outer()
        optimizer = keras_skip.SkipCorrectionOptimizer(make_inner(), **skip)
        model.compile(
            optimizer=optimizer, loss="mse", steps_per_execution=steps_per_execution
        )
    return model, optimizer


def fit(model, epochs=EPOCHS, initial_epoch=0, callbacks=()):
    x, y = make_data()
    model.fit(
        x.reshape(-1, D).astype("float32"),
        y.reshape(-1, 1).astype("float32"),
        batch_size=GLOBAL_BATCH,
        epochs=epochs,
        initial_epoch=initial_epoch,
        shuffle=False,
        verbose=0,
        callbacks=[keras_skip.SkipCorrectionCallback(), *callbacks],
    )


def train_keras(
    make_inner, *, steps_per_execution=1, callbacks=(), make_outer=None, **skip
):
    """Trains `EPOCHS` epochs on 4 replicas; returns the model, its
    optimizer and a `Trace` of the run."""
    model, optimizer = compile_model(
        mirrored(REPLICAS), make_inner, steps_per_execution, make_outer, **skip
    )
    trace = Trace()
    fit(model, callbacks=[*callbacks, trace])
    return model, optimizer, trace


def reference(inner, *, steps=STEPS, learning_rate=LR, boundaries=BOUNDARIES, **skip):
    """`maths.simulate` on the data `train_keras` trains on, by default with
    an epoch boundary after every `STEPS_PER_EPOCH` steps."""
    x, y = make_data()
    return maths.simulate(
        np.concatenate([w.ravel() for w in start_weights()]),
        grad_fn(x, y),
        n=REPLICAS,
        steps=steps,
        learning_rate=learning_rate,
        inner=inner,
        boundaries=boundaries,
        **skip,
    )


def per_replica(variables):
    """Replica r's copies of `variables`, flattened and concatenated: one
    row per replica."""
    copies = [components(v) for v in variables]
    return np.stack(
        [np.concatenate([c.ravel() for c in row]) for row in zip(*copies, strict=True)]
    )


def weights_of(model):
    return per_replica(model.trainable_variables)


def assert_matches_reference(model, optimizer, trace, run, correction_tolerance=1e-5):
    """The final weights (every replica), corrections and averages of the
    TF run equal the reference's `run(steps)`; so do the fragments' local
    steps, ``gamma`` and the averages after every traced execution."""
    expected = run(STEPS)
    assert_relative(weights_of(model), expected.x)
    if optimizer.correction:
        corrections = per_replica(internals.corrections(optimizer))
        assert_relative(corrections, expected.correction, correction_tolerance)
    assert optimizer.averages_performed == expected.averages
    assert internals.fragment_local_steps(optimizer) == expected.fragment_local_steps
    assert internals.gamma(optimizer) == pytest.approx(expected.gamma, abs=1e-9)
    assert trace.rows, "no execution was traced"
    for steps, (local, gamma, averages) in trace.rows.items():
        partial = run(steps)
        assert local == partial.fragment_local_steps, f"after {steps} steps"
        assert gamma == pytest.approx(partial.gamma, rel=1e-6, abs=1e-9), steps
        assert averages == partial.averages, f"after {steps} steps"
    return expected


@settings(deadline=None, max_examples=200)
@given(
    st.lists(st.integers(1, 1000), min_size=1, max_size=12).flatmap(
        lambda sizes: st.tuples(st.just(sizes), st.integers(1, len(sizes)))
    )
)
def test_partition_is_whole_variables_near_equal_and_deterministic(problem):
    """Every variable in exactly one fragment, none empty, each fragment's
    indices ascending and the fragments ordered by their first index; the
    loads differ by at most the largest variable (largest first into the
    lightest); the same sizes give the same partition."""
    sizes, count = problem
    parts = _fragments.partition(sizes, count)
    assert len(parts) == count
    assert all(parts)
    assert sorted(i for part in parts for i in part) == list(range(len(sizes)))
    assert all(part == sorted(part) for part in parts)
    firsts = [part[0] for part in parts]
    assert firsts == sorted(firsts)
    loads = [sum(sizes[i] for i in part) for part in parts]
    assert max(loads) - min(loads) <= max(sizes)
    assert _fragments.partition(list(sizes), count) == parts
    assert _fragments.partition(sizes, 1) == [list(range(len(sizes)))]
    assert _fragments.partition(sizes, len(sizes)) == [[i] for i in range(len(sizes))]


@pytest.mark.parametrize("count", [0, -1, True, 5])
def test_partition_refuses_a_fragment_count_it_cannot_make(count):
    """Fewer than one fragment, a bool, or more fragments than variables."""
    with pytest.raises(ValueError, match="fragments"):
        _fragments.partition([8, 4, 12, 4], count)


@pytest.mark.parametrize("count", sorted(EXPECTED_FRAGMENTS))
def test_fragments_are_whole_variables_in_the_optimizers_order(count):
    """The optimizer's fragments, as coordinates of its trainable variables
    concatenated in order, are the partition of their bytes: the order the
    reference's gradients use."""
    model, optimizer = compile_model(
        mirrored(REPLICAS), INNERS["sgd"][0], interval=8, fragments=count
    )
    with model.distribute_strategy.scope():
        optimizer.build(model.trainable_variables)
    assert [tuple(v.shape) for v in model.trainable_variables] == [
        (SPLIT, 1),
        (1,),
        (D - SPLIT, 1),
        (1,),
    ]
    assert [
        [int(i) for i in part] for part in internals.fragments(optimizer)
    ] == EXPECTED_FRAGMENTS[count]
    by_variable = _fragments.partition(VARIABLE_BYTES, count)
    starts = np.cumsum([0, *(b // 4 for b in VARIABLE_BYTES)])
    assert [
        [c for i in part for c in range(starts[i], starts[i + 1])]
        for part in by_variable
    ] == EXPECTED_FRAGMENTS[count]
    assert optimizer.fragments == count


@pytest.mark.parametrize(
    ("count", "interval", "inner", "correction"),
    [
        (2, 4, "sgd", 1.0),
        (2, 8, "momentum", 1.0),
        (3, 6, "momentum", 0.0),
        (4, 6, "sgd", 1.0),
    ],
)
def test_fit_with_fragments_matches_reference(count, interval, inner, correction):
    """Weights, corrections, averages performed, the fragments' local steps
    and ``gamma`` follow the reference with the optimizer's fragments, whose
    interval averages outnumber those of the same run unfragmented."""
    make_keras, make_reference = INNERS[inner]
    model, optimizer, trace = train_keras(
        make_keras, interval=interval, correction=correction, fragments=count
    )
    parts = internals.fragments(optimizer)
    assert len(parts) == count

    def run(steps):
        return reference(
            make_reference(),
            steps=steps,
            interval=interval,
            correction=correction,
            fragments=parts,
        )

    expected = assert_matches_reference(model, optimizer, trace, run)
    whole = reference(make_reference(), interval=interval, correction=correction)
    assert expected.interval_averages > whole.interval_averages


@pytest.mark.parametrize(
    ("policy", "inner"),
    [
        ("average", "momentum"),
        ("reset", "momentum"),
        ("average_second_moments", "adam"),
    ],
)
def test_fragment_slot_policies_match_reference(policy, inner):
    """Each slot policy applies to the averaged fragment's slots only
    ("local", the default, is in `test_fit_with_fragments_matches_reference`)."""
    if inner == "adam":
        make_keras, make_reference, lr = (
            lambda: keras.optimizers.Adam(0.01),
            maths.adam,
            0.01,
        )
    else:
        (make_keras, make_reference), lr = INNERS[inner], LR
    model, optimizer, trace = train_keras(
        make_keras, interval=4, correction=1.0, optimizer_state=policy, fragments=2
    )
    parts = internals.fragments(optimizer)

    def run(steps):
        return reference(
            make_reference(),
            steps=steps,
            learning_rate=lr,
            interval=4,
            correction=1.0,
            optimizer_state=policy,
            fragments=parts,
        )

    tolerance = 1e-4 if inner == "adam" else 1e-5
    assert_matches_reference(model, optimizer, trace, run, tolerance)


#: Outer optimizers: the Keras one and the reference's with its learning rate.
OUTERS = {
    "nesterov": (
        lambda: keras.optimizers.SGD(0.7, momentum=0.9, nesterov=True),
        lambda: maths.sgd(0.9, nesterov=True),
        0.7,
    ),
    "adam": (lambda: keras.optimizers.Adam(0.1), maths.adam, 0.1),
}


def outer_options(outer):
    """``(make_outer, reference keyword arguments)`` of `OUTERS[outer]`, or
    of no outer optimizer for None."""
    if outer is None:
        return None, {}
    make_outer, make_reference_outer, outer_rate = OUTERS[outer]
    return make_outer, dict(
        outer=make_reference_outer(), outer_learning_rate=outer_rate
    )


@pytest.mark.parametrize(
    ("count", "interval", "compression", "outer", "policy"),
    [
        (2, 4, "bfloat16", "nesterov", "local"),
        (3, 6, "float16", None, "average"),
        (2, 6, None, "adam", "local"),
        (3, 4, "bfloat16", "adam", "reset"),
    ],
)
def test_fragments_with_compression_outer_and_drift_match_reference(
    count, interval, compression, outer, policy
):
    """Each fragment's average sends its own update since its period began
    with its own error feedback, and takes its own outer step (outer Adam
    counts each fragment's steps for its bias correction); a full average
    sends nothing of a fragment that did not move, whose weights and
    error it leaves as they are. The drift is recorded per fragment, as
    the reference records it."""
    make_keras, make_reference = INNERS["momentum"]
    skip = dict(
        interval=interval,
        correction=1.0,
        compression=compression,
        optimizer_state=policy,
        fragments=count,
    )
    make_outer, reference_outer = outer_options(outer)
    model, optimizer, trace = train_keras(
        make_keras, make_outer=make_outer, measure_drift=True, **skip
    )
    parts = internals.fragments(optimizer)
    skip["fragments"] = parts

    def run(steps):
        return reference(make_reference(), steps=steps, **skip, **reference_outer)

    expected = assert_matches_reference(model, optimizer, trace, run, 1e-4)
    # Every replica holds the same weights after the last boundary.
    weights = weights_of(model)
    assert np.abs(weights - weights[0]).max() == 0.0
    total, last = optimizer.drift
    assert total == pytest.approx(sum(expected.drifts), rel=1e-4)
    assert last == pytest.approx(expected.drifts[-1], rel=1e-4)
    # The option changes the run: the comparison above sees it.
    plain = reference(
        make_reference(),
        interval=interval,
        correction=1.0,
        optimizer_state=policy,
        fragments=parts,
    )
    assert np.abs(plain.x - expected.x).max() > 1e-4


class InFlight(keras.callbacks.Callback):
    """Counts the executions after which a fragment's average was on its
    way, and the fragments that flew."""

    def __init__(self):
        super().__init__()
        self.executions, self.fragments = 0, set()

    def on_train_batch_end(self, batch, logs=None):
        flight = internals.flight(self.model.optimizer)
        if flight is not None and flight.in_flight:
            self.executions += 1
            self.fragments.add(internals.fragment_in_flight(self.model.optimizer))


@pytest.mark.parametrize(
    ("count", "interval", "delay", "steps_per_execution", "compression"),
    [
        (2, 6, 2, 1, None),
        (2, 6, 2, 2, None),
        (3, 6, 2, 1, "bfloat16"),
        (4, 12, 2, 1, None),
    ],
)
def test_fit_with_delayed_fragments_matches_reference(
    count, interval, delay, steps_per_execution, compression
):
    """``overlap=k``: a due fragment's average is copied, sent while the
    next steps compute and landed later, one fragment at a time, by the
    reference's rule; every replica ends identical (the boundary lands any
    fragment on its way before its full average)."""
    make_keras, make_reference = INNERS["momentum"]
    flights = InFlight()
    skip = dict(
        interval=interval,
        correction=1.0,
        fragments=count,
        overlap=delay,
        compression=compression,
    )
    model, optimizer = compile_model(
        mirrored(REPLICAS), make_keras, steps_per_execution, **skip
    )
    fit(model, callbacks=[flights])
    skip["fragments"] = internals.fragments(optimizer)
    expected = reference(
        make_reference(), steps_per_execution=steps_per_execution, **skip
    )
    weights = weights_of(model)
    assert_relative(weights, expected.x)
    corrections = per_replica(internals.corrections(optimizer))
    assert_relative(corrections, expected.correction, 1e-4)
    assert optimizer.averages_performed == expected.averages
    assert np.abs(weights - weights[0]).max() == 0.0
    assert flights.executions > 0 and flights.fragments
    # The delay changes the run: the comparison above sees it.
    del skip["overlap"]
    undelayed = reference(
        make_reference(), steps_per_execution=steps_per_execution, **skip
    )
    assert np.abs(undelayed.x - expected.x).max() > 1e-4


class _SaveInFlight(keras.callbacks.Callback):
    """Saves the model after `batch` if a fragment's average is on its way;
    records whether one was, before and after the save."""

    def __init__(self, path, batch):
        super().__init__()
        self.path, self.batch, self.seen = path, batch, None

    def on_train_batch_end(self, batch, logs=None):
        if batch == self.batch and self.seen is None:
            flight = internals.flight(self.model.optimizer)
            before = flight.in_flight
            self.model.save(self.path)
            self.seen = (before, flight.in_flight)


def test_a_save_while_a_fragment_is_on_its_way_lands_it_first(tmp_path):
    """Interval 6, two fragments, delay 2: fragment 0's average, due after
    step 3, is on its way after step 5, where the run would land it before
    the next. A save there lands it first, so the file holds no
    half-finished average; the run goes on as the reference's."""
    path = tmp_path / "mid.keras"
    save = _SaveInFlight(path, batch=4)
    skip = dict(interval=6, correction=1.0, fragments=2, overlap=2)
    make_keras, make_reference = INNERS["sgd"]
    model, optimizer = compile_model(mirrored(REPLICAS), make_keras, **skip)
    fit(model, callbacks=[save])
    assert save.seen == (True, False)
    with mirrored(REPLICAS).scope():
        restored = keras.saving.load_model(path)
    assert restored.optimizer.averages_performed == 1
    assert internals.fragment_local_steps(restored.optimizer) == (2, 5)
    skip["fragments"] = internals.fragments(optimizer)
    expected = reference(make_reference(), **skip)
    assert_relative(weights_of(model), expected.x)
    assert optimizer.averages_performed == expected.averages


@pytest.mark.parametrize("steps_per_execution", [1, 2, 3])
def test_fragments_with_warmup_and_steps_per_execution_match_reference(
    steps_per_execution,
):
    """Three synchronous steps, then the fragments' offsets counted from the
    first local step, whatever the steps per execution."""
    make_keras, make_reference = INNERS["momentum"]
    model, optimizer, trace = train_keras(
        make_keras,
        steps_per_execution=steps_per_execution,
        interval=4,
        correction=1.0,
        warmup_steps=3,
        fragments=2,
    )
    parts = internals.fragments(optimizer)

    def run(steps):
        return reference(
            make_reference(),
            steps=steps,
            interval=4,
            correction=1.0,
            warmup_steps=3,
            steps_per_execution=steps_per_execution,
            fragments=parts,
        )

    assert_matches_reference(model, optimizer, trace, run)
    assert optimizer.synchronous_steps == 3


@pytest.mark.parametrize(
    ("before", "after", "step"),
    [
        (4, 6, 3),  # longer: the unaveraged fragment's offset moves
        (6, 2, 4),  # shorter: both fragments are overdue at once
        (8, 1, 3),  # synchronous: a full average first
    ],
)
def test_an_interval_changed_mid_training_matches_reference(before, after, step):
    """`optimizer.interval` set before the 0-based step `step` (in the first
    epoch) holds from that step on, in the fragments' schedule as in the
    reference's."""
    make_keras, make_reference = INNERS["momentum"]
    model, optimizer = compile_model(
        mirrored(REPLICAS), make_keras, interval=before, correction=1.0, fragments=2
    )

    def change(batch, logs=None):
        if int(optimizer.iterations.numpy()) == step:
            optimizer.interval = after

    changer = keras.callbacks.LambdaCallback(on_train_batch_begin=change)
    trace = Trace()
    fit(model, callbacks=[changer, trace])
    assert optimizer.interval == after
    parts = internals.fragments(optimizer)

    def run(steps):
        return reference(
            make_reference(),
            steps=steps,
            interval=lambda t: before if t < step else after,
            correction=1.0,
            fragments=parts,
        )

    assert_matches_reference(model, optimizer, trace, run)


#: A message naming both arguments, in either order.
BOTH = r"(?s)interval.*fragments|fragments.*interval"


def test_an_interval_below_fragments_is_refused():
    """Every fragment is averaged once per interval: an interval between 1
    and the fragment count is refused when given and when set; 1
    (synchronous) and the fragment count itself are allowed."""
    sgd = INNERS["sgd"][0]
    for interval in (2, 3):
        with pytest.raises(ValueError, match=BOTH):
            keras_skip.SkipCorrectionOptimizer(sgd(), interval=interval, fragments=4)
    for interval in (1, 4):
        keras_skip.SkipCorrectionOptimizer(sgd(), interval=interval, fragments=4)

    unbuilt = keras_skip.SkipCorrectionOptimizer(sgd(), interval=8, fragments=4)
    model, built = compile_model(mirrored(REPLICAS), sgd, interval=8, fragments=4)
    with model.distribute_strategy.scope():
        built.build(model.trainable_variables)
    for optimizer in (unbuilt, built):
        with pytest.raises(ValueError, match="interval"):
            optimizer.interval = 3
        assert optimizer.interval == 8
        optimizer.interval = 1
        assert optimizer.interval == 1
        optimizer.interval = 4
        assert optimizer.interval == 4


@pytest.mark.parametrize(
    ("count", "interval", "steps_per_execution", "policy", "compression", "outer"),
    [
        (2, 4, 1, "local", None, None),
        (3, 6, 2, "local", None, None),
        (2, 4, 1, "average", "bfloat16", "nesterov"),
        (4, 4, 1, "reset", None, None),
    ],
)
def test_fit_with_overlapped_fragments_matches_reference(
    count, interval, steps_per_execution, policy, compression, outer
):
    """``overlap=True``: a due fragment's all-reduce starts before the step
    it is due after, on the values the step starts from, and lands after
    it, each replica keeping its step on top; the fragment's weights carry
    that step until its next average (the reference's overlapped average,
    per fragment)."""
    make_keras, make_reference = INNERS["momentum"]
    skip = dict(
        interval=interval,
        correction=1.0,
        fragments=count,
        overlap=True,
        optimizer_state=policy,
        compression=compression,
    )
    make_outer, reference_outer = outer_options(outer)
    model, optimizer = compile_model(
        mirrored(REPLICAS), make_keras, steps_per_execution, make_outer, **skip
    )
    fit(model)
    skip["fragments"] = internals.fragments(optimizer)
    run = dict(steps_per_execution=steps_per_execution, **skip, **reference_outer)
    expected = reference(make_reference(), **run)
    weights = weights_of(model)
    assert_relative(weights, expected.x)
    corrections = per_replica(internals.corrections(optimizer))
    assert_relative(corrections, expected.correction, 1e-4)
    assert optimizer.averages_performed == expected.averages
    assert optimizer.local_steps_since_average == 0
    assert np.abs(weights - weights[0]).max() == 0.0
    # Overlapping changes the run: the comparison above sees it.
    del run["overlap"]
    assert np.abs(reference(make_reference(), **run).x - expected.x).max() > 1e-4


def test_a_fragment_count_that_is_not_a_positive_integer_is_refused():
    """0 and negative counts, a bool and a float, by name."""
    for count in (0, -2):
        with pytest.raises(ValueError, match="fragments"):
            keras_skip.SkipCorrectionOptimizer(
                keras.optimizers.SGD(LR), interval=8, fragments=count
            )
    for count in (True, 2.0):
        with pytest.raises((TypeError, ValueError), match="fragments"):
            keras_skip.SkipCorrectionOptimizer(
                keras.optimizers.SGD(LR), interval=8, fragments=count
            )


def test_more_fragments_than_variables_are_refused_when_built():
    """A fragment holds whole variables: 5 fragments of 4 variables."""
    model, optimizer = compile_model(
        mirrored(REPLICAS), INNERS["sgd"][0], interval=8, fragments=5
    )
    with (
        pytest.raises(ValueError, match="fragments"),
        model.distribute_strategy.scope(),
    ):
        optimizer.build(model.trainable_variables)


@pytest.mark.parametrize(
    ("interval", "expected_bytes"),
    [
        # Per epoch: fragment 0 after step 2, fragment 1 after step 5, then
        # the boundary average.
        (5, 2 * (12 + 16 + 28)),
        # Per epoch: fragment 0 after step 4, then the boundary average.
        (8, 2 * (12 + 28)),
    ],
)
def test_fragment_averages_send_a_fraction_of_the_bytes(interval, expected_bytes):
    """Two fragments of 12 and 16 bytes (SGD, no slots or model state sent):
    each interval average sends its fragment's weights, each epoch-boundary
    average all 28 bytes. The averages and the fragment each covers come
    from the reference, in which no interval average falls on a boundary
    here."""
    make_keras, make_reference = INNERS["sgd"]
    _, optimizer, _ = train_keras(
        make_keras, interval=interval, correction=1.0, fragments=2
    )
    parts = internals.fragments(optimizer)
    fragment_bytes = [4 * len(part) for part in parts]
    assert fragment_bytes == [12, 16]

    def run(steps, boundaries):
        return reference(
            make_reference(),
            steps=steps,
            boundaries=boundaries,
            interval=interval,
            correction=1.0,
            fragments=parts,
        )

    sent, averages = 0, 0
    for t in range(STEPS):
        # After step t, before the boundary average it may end with.
        local = run(t + 1, [b for b in BOUNDARIES if b <= t]).fragment_local_steps
        for j, steps in enumerate(local):
            if steps == 0:  # fragment j was averaged after step t
                assert t + 1 not in BOUNDARIES
                sent += fragment_bytes[j]
                averages += 1
        if t + 1 in BOUNDARIES:
            assert all(local)  # the boundary average covers both fragments
            sent += sum(fragment_bytes)
            averages += 1
    assert sent == expected_bytes
    assert averages == run(STEPS, BOUNDARIES).averages == optimizer.averages_performed
    assert optimizer.bytes_sent == expected_bytes


def test_fragments_save_load_continue_equals_uninterrupted(tmp_path):
    """4 replicas, 2 fragments, momentum slots and corrections that differ
    per replica: saving after epoch 1 to a `.keras` file and continuing from
    it reproduces the uninterrupted run, fragment schedule included."""
    make_keras = INNERS["momentum"][0]
    skip = dict(interval=4, correction=1.0, fragments=2)
    uninterrupted, _ = compile_model(mirrored(REPLICAS), make_keras, **skip)
    fit(uninterrupted)

    first, _ = compile_model(mirrored(REPLICAS), make_keras, **skip)
    fit(first, epochs=1)
    assert first.optimizer.averages_performed > 0
    path = tmp_path / "m.keras"
    first.save(path)
    with mirrored(REPLICAS).scope():
        resumed = keras.saving.load_model(path)
    assert isinstance(resumed.optimizer, keras_skip.SkipCorrectionOptimizer)
    assert resumed.optimizer.fragments == 2
    assert_same_state(per_replica_state(first), per_replica_state(resumed))
    fit(resumed, epochs=EPOCHS, initial_epoch=1)
    assert_same_state(per_replica_state(uninterrupted), per_replica_state(resumed))
    assert (
        resumed.optimizer.averages_performed
        == uninterrupted.optimizer.averages_performed
    )


def test_fragment_schedule_survives_a_save_mid_interval(tmp_path):
    """One replica, interval 8, two fragments: after 5 steps fragment 0 was
    averaged once (after its offset of 4 steps) and fragment 1 not yet; a
    `.keras` file keeps that, and 3 more steps after loading average
    fragment 1 (after its offset of 8) and not fragment 0, as the reference
    does."""
    x, y = make_data()
    xs = x[:, 0].astype("float32")  # replica 0's rows of each step
    ys = y[:, 0, :, None].astype("float32")
    model, optimizer = compile_model(
        tf.distribute.get_strategy(), INNERS["sgd"][0], interval=8, fragments=2
    )
    for t in range(5):
        model.train_on_batch(xs[t], ys[t])
    parts = internals.fragments(optimizer)

    def run(steps):
        return maths.simulate(
            np.concatenate([w.ravel() for w in start_weights()]),
            grad_fn(x[:, :1], y[:, :1]),
            n=1,
            steps=steps,
            learning_rate=LR,
            interval=8,
            correction=1.0,
            fragments=parts,
        )

    assert internals.fragment_local_steps(optimizer) == run(5).fragment_local_steps
    assert run(5).fragment_local_steps == (1, 5)
    path = tmp_path / "mid.keras"
    model.save(path)
    loaded = keras.saving.load_model(path)
    assert loaded.optimizer.fragments == 2
    assert internals.fragment_local_steps(loaded.optimizer) == (1, 5)
    assert loaded.optimizer.averages_performed == optimizer.averages_performed == 1
    for t in range(5, 8):
        loaded.train_on_batch(xs[t % STEPS_PER_EPOCH], ys[t % STEPS_PER_EPOCH])
    expected = run(8)
    assert expected.fragment_local_steps == (4, 0)
    assert internals.fragment_local_steps(loaded.optimizer) == (4, 0)
    assert loaded.optimizer.averages_performed == expected.averages == 2


@pytest.mark.parametrize(("saved", "loading"), [(2, 3), (1, 2), (3, 1)])
def test_loading_another_fragment_count_is_a_clear_error(tmp_path, saved, loading):
    """A `.keras` file's weights loaded into an optimizer with another
    fragment count: a ValueError that names fragments."""
    strategy = tf.distribute.get_strategy()
    make_keras = INNERS["momentum"][0]
    model, optimizer = compile_model(strategy, make_keras, interval=8, fragments=saved)
    optimizer.build(model.trainable_variables)
    path = tmp_path / "saved.keras"
    model.save(path)
    other, other_optimizer = compile_model(
        strategy, make_keras, interval=8, fragments=loading
    )
    other_optimizer.build(other.trainable_variables)
    with pytest.raises(ValueError, match="fragment"):
        other.load_weights(path)


def test_fragments_one_is_todays_optimizer():
    """``fragments=1`` is the default: no variable added, the same
    configuration; the entry round-trips for any count."""
    strategy = tf.distribute.get_strategy()
    make_keras = INNERS["momentum"][0]
    built = []
    for skip in ({}, {"fragments": 1}):
        model, optimizer = compile_model(strategy, make_keras, interval=4, **skip)
        optimizer.build(model.trainable_variables)
        assert optimizer.fragments == 1
        assert optimizer.get_config()["fragments"] == 1
        built.append(optimizer)
    today, one = built
    named = ("name", "inner_optimizer")  # their names differ
    assert {k: v for k, v in one.get_config().items() if k not in named} == {
        k: v for k, v in today.get_config().items() if k not in named
    }
    assert len(one.variables) == len(today.variables)
    assert [tuple(v.shape) for v in one.variables] == [
        tuple(v.shape) for v in today.variables
    ]
    for count in (1, 3):
        optimizer = keras_skip.SkipCorrectionOptimizer(
            make_keras(), interval=6, fragments=count
        )
        config = optimizer.get_config()
        assert config["fragments"] == count
        clone = keras_skip.SkipCorrectionOptimizer.from_config(config)
        assert clone.fragments == count
        assert clone.get_config() == config
