"""Delayed averages (`overlap=k`, k >= 2): the reference maths' invariants,
`model.fit` on several replicas against the reference, and what happens
around a flight (saves, custom loops, settings that cannot delay)."""

import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf
from conftest import mirrored
from hypothesis import example, given, settings
from hypothesis import strategies as st
from test_against_reference import (
    INNERS,
    LR,
    REPLICAS,
    assert_relative,
    corrections_of,
    linear_model,
    make_data,
    reference,
    train_keras,
    weights_of,
)
from test_maths import betas, fixed_grads, problems, rates

import keras_skip
from keras_skip import maths


def simulate(problem, **kwargs):
    n, _dim, steps, grads, x0 = problem
    kwargs = {"n": n, "steps": steps, **kwargs}
    return maths.simulate(x0, fixed_grads(grads), **kwargs)


# The reference maths ----------------------------------------------------------


@settings(deadline=None)
@given(problems(min_n=2, min_steps=2), st.integers(2, 8), st.integers(2, 6), betas)
def test_a_delay_over_steps_that_move_nothing_is_the_plain_algorithm(
    problem, interval, delay, beta
):
    """The steps an all-reduce runs beside take learning rate 0: the weights
    at landing are the snapshot, so the delayed average is the plain one."""
    carried = min(delay, interval - 1)

    def rate(t):
        return 0.0 if t % interval < carried and t >= interval else 0.05

    # A boundary at the end lands the last mean on its way.
    kwargs = dict(
        learning_rate=rate,
        interval=interval,
        correction=beta,
        boundaries=[problem[2]],
    )
    plain = simulate(problem, **kwargs)
    delayed = simulate(problem, overlap=delay, **kwargs)
    np.testing.assert_allclose(delayed.x, plain.x, rtol=1e-9, atol=1e-9)
    np.testing.assert_allclose(delayed.correction, plain.correction, atol=1e-9)
    assert delayed.interval_averages == plain.interval_averages


@settings(deadline=None)
@given(
    problems(min_n=2, min_steps=2),
    st.integers(2, 8),
    st.integers(2, 6),
    st.integers(1, 3),
    rates,
)
def test_delayed_corrections_sum_to_zero_and_the_mean_moves_as_without_averages(
    problem, interval, delay, steps_per_execution, lr
):
    """Plain SGD: an average leaves the replicas' mean where it was, delayed
    or not, so the mean follows the mean gradient; the corrections, updated
    on the snapshot, still sum to zero over the replicas."""
    _n, _dim, steps, grads, x0 = problem
    result = simulate(
        problem,
        learning_rate=lr,
        interval=interval,
        correction=1.0,
        overlap=delay,
        steps_per_execution=steps_per_execution,
    )
    np.testing.assert_allclose(result.correction.sum(0), 0.0, atol=1e-8)
    # With corrections summing to zero, each step moves the mean by -lr
    # times the mean gradient, whatever the averages did.
    expected = np.asarray(x0, np.float64) - lr * np.asarray(grads)[:steps].mean(
        axis=1
    ).sum(0)
    np.testing.assert_allclose(result.x.mean(0), expected, rtol=1e-7, atol=1e-7)


@settings(deadline=None)
@given(
    st.integers(1, 30),
    st.integers(2, 9),
    st.integers(2, 5),
    st.sets(st.integers(1, 30), max_size=5),
    problems(min_n=2, min_steps=30),
    st.sampled_from(["local", "average", "reset"]),
)
def test_delayed_averages_as_often_and_boundaries_leave_replicas_identical(
    steps, interval, delay, boundaries, problem, policy
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
    delayed = simulate(problem, overlap=delay, **kwargs)
    assert delayed.interval_averages == plain.interval_averages
    assert delayed.boundary_averages == plain.boundary_averages
    for t in boundaries:
        if t <= steps:
            x = delayed.history[t - 1]
            np.testing.assert_allclose(x, np.broadcast_to(x[:1], x.shape), atol=1e-9)


@settings(deadline=None)
@given(problems(min_steps=2), st.integers(2, 8), st.integers(2, 5), betas, rates)
# The weights end at 1 - 20 * 0.05 = 0: the mean of identical copies rounds
# differently from one copy by 3e-17, 9% of the result itself, so the
# comparison needs an absolute tolerance.
@example(
    problem=(1, 1, 20, np.ones((20, 1, 1)), np.ones(1)),
    interval=2,
    delay=2,
    beta=0.0,
    lr=0.05,
)
def test_delayed_with_identical_replicas_is_one_replica(
    problem, interval, delay, beta, lr
):
    _n, _dim, steps, grads, x0 = problem
    same = [grads[t][:1].repeat(3, axis=0) for t in range(steps)]
    kwargs = dict(n=3, steps=steps, learning_rate=lr, interval=interval)
    delayed = maths.simulate(
        x0, fixed_grads(same), correction=beta, overlap=delay, **kwargs
    )
    one = maths.simulate(
        x0, fixed_grads([g[:1] for g in same]), correction=beta, **{**kwargs, "n": 1}
    )
    np.testing.assert_allclose(
        delayed.x, np.broadcast_to(one.x, delayed.x.shape), atol=1e-9
    )
    np.testing.assert_allclose(delayed.correction, 0.0, atol=1e-9)  # mean's rounding


def test_a_delay_changes_the_path_and_lands_after_its_steps():
    """Interval 4, delay 2, 12 steps without boundaries: averages are due
    after steps 4 and 8 (1-based) and land before steps 7 and 11; until
    then replicas stay apart, and the path differs from the plain run."""
    rng = np.random.default_rng(0)
    grads = rng.normal(size=(12, 3, 2))
    x0 = np.zeros(2)
    kwargs = dict(n=3, steps=12, learning_rate=0.1, interval=4, correction=1.0)
    plain = maths.simulate(x0, fixed_grads(grads), **kwargs)
    delayed = maths.simulate(x0, fixed_grads(grads), overlap=2, **kwargs)
    assert delayed.interval_averages == plain.interval_averages == 3
    assert np.abs(delayed.x - plain.x).max() > 1e-3
    # Plain: identical right after each average (steps 4, 8 and 12).
    for t in (3, 7, 11):
        np.testing.assert_allclose(plain.history[t] - plain.history[t].mean(0), 0)
    # Delayed: still apart after step 4 and after step 6, the mean on its way.
    assert np.ptp(delayed.history[3], axis=0).max() > 1e-3
    assert np.ptp(delayed.history[5], axis=0).max() > 1e-3


# TensorFlow against the reference ---------------------------------------------


@pytest.mark.parametrize(
    ("inner", "interval", "delay", "correction"),
    [
        ("sgd", 3, 2, 1.0),
        ("momentum", 2, 2, 1.0),
        ("momentum", 4, 2, 0.5),
        ("sgd", 5, 3, 0.0),
    ],
)
def test_fit_with_delayed_averages_matches_reference(
    inner, interval, delay, correction
):
    make_keras, make_reference = INNERS[inner]
    skip = dict(interval=interval, correction=correction, overlap=delay)
    model, optimizer = train_keras(mirrored(REPLICAS), make_keras, **skip)
    expected = reference(make_reference(), **skip)
    plain = reference(make_reference(), interval=interval, correction=correction)
    assert np.abs(expected.x - plain.x).max() > 1e-3  # the delay changes the path
    assert_relative(weights_of(model), expected.x)
    if correction:
        assert_relative(corrections_of(optimizer), expected.correction)
    assert optimizer.averages_performed == expected.averages
    assert not optimizer._flight.in_flight
    # Replicas of one process: the all-reduce ran in a thread, through one
    # device.
    assert optimizer._flight.threaded


@pytest.mark.parametrize(
    "options",
    [
        dict(optimizer_state="average"),
        dict(optimizer_state="reset"),
        dict(steps_per_execution=2, interval=3),
        dict(outer=True, compression="bfloat16", measure_drift=True),
        dict(group_size=2),
    ],
    ids=["average", "reset", "steps_per_execution", "outer+bfloat16+drift", "groups"],
)
def test_delayed_averages_with_options_match_reference(options):
    options = dict(options)
    make_keras, make_reference = INNERS["momentum"]
    skip = dict(interval=options.pop("interval", 3), correction=1.0, overlap=2)
    keras_only, reference_only = {}, {}
    if options.pop("outer", False):
        keras_only["make_outer"] = lambda: keras.optimizers.SGD(
            0.7, momentum=0.9, nesterov=True
        )
        reference_only = dict(outer=maths.sgd(0.9, True), outer_learning_rate=0.7)
    if "steps_per_execution" in options:
        steps = options.pop("steps_per_execution")
        keras_only["steps_per_execution"] = steps
        reference_only["steps_per_execution"] = steps
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
    assert optimizer._flight.threaded  # also with compression, on one worker
    if measure_drift:
        np.testing.assert_allclose(
            optimizer.drift, [sum(expected.drifts), expected.drifts[-1]], rtol=1e-5
        )


@pytest.mark.parametrize(
    ("interval", "delay", "steps_per_execution"),
    [(2, 3, 1), (4, 3, 1), (3, 5, 2)],
    ids=["before-the-next-due", "before-the-boundary", "two-steps-per-execution"],
)
def test_measured_drift_of_early_landings_is_the_references(
    interval, delay, steps_per_execution
):
    """A mean that lands before its `delay` steps (the next average is due,
    or the epoch's last execution takes the boundary average) reports the
    drift of the snapshot it sent, as the reference measures it."""
    make_keras, make_reference = INNERS["momentum"]
    skip = dict(interval=interval, correction=1.0, overlap=delay)
    model, optimizer = train_keras(
        mirrored(REPLICAS),
        make_keras,
        measure_drift=True,
        steps_per_execution=steps_per_execution,
        **skip,
    )
    expected = reference(
        make_reference(), steps_per_execution=steps_per_execution, **skip
    )
    # Every delayed mean here lands early: none is in flight for `delay`
    # steps, so the run takes as many averages as the plain algorithm.
    plain = reference(make_reference(), interval=interval, correction=1.0)
    assert expected.averages == plain.averages
    assert np.abs(expected.x - plain.x).max() > 1e-4  # yet a delay happened
    assert_relative(weights_of(model), expected.x)
    assert optimizer.averages_performed == expected.averages
    assert min(expected.drifts) > 0
    np.testing.assert_allclose(
        optimizer.drift, [sum(expected.drifts), expected.drifts[-1]], rtol=1e-5
    )


def test_an_interval_no_longer_than_an_execution_warns_and_averages_after_the_step():
    skip = dict(interval=2, correction=1.0)
    make_keras, make_reference = INNERS["sgd"]
    with pytest.warns(UserWarning, match=r"overlap=3: the interval \(2\) is not"):
        model, _ = train_keras(
            mirrored(REPLICAS), make_keras, steps_per_execution=2, overlap=3, **skip
        )
    assert_relative(weights_of(model), reference(make_reference(), **skip).x)


def test_an_epochs_last_execution_held_short_does_not_warn():
    """At interval 4 with 6-step epochs and 2 steps per execution, the
    callback holds the interval at 2 for each epoch's last execution (whose
    last step takes the boundary average); the interval itself is longer
    than an execution, so nothing warns that averages cannot be delayed."""
    skip = dict(interval=4, correction=1.0, overlap=5, steps_per_execution=2)
    make_keras, make_reference = INNERS["momentum"]
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="overlap=", category=UserWarning)
        model, optimizer = train_keras(mirrored(REPLICAS), make_keras, **skip)
    assert_relative(weights_of(model), reference(make_reference(), **skip).x)
    assert optimizer._flight.threaded


def test_a_custom_training_loop_averages_after_the_step():
    """No `fit`, no host between executions: the averages run in the step,
    exactly as without overlap."""

    def train(overlap):
        strategy = mirrored(REPLICAS)
        x, y = make_data()
        with strategy.scope():
            model = keras.Sequential(
                [
                    keras.Input((x.shape[-1],)),
                    keras.layers.Dense(1, kernel_initializer="zeros"),
                ]
            )
            optimizer = keras_skip.SkipCorrectionOptimizer(
                keras.optimizers.SGD(LR), interval=3, overlap=overlap
            )
            optimizer.build(model.trainable_variables)
            optimizer.attach(model)

        @tf.function
        def step(xb, yb):
            def replica(xb, yb):
                with tf.GradientTape() as tape:
                    loss = tf.reduce_mean(tf.square(model(xb)[:, 0] - yb))
                grads = tape.gradient(loss, model.trainable_variables)
                optimizer.apply(grads, model.trainable_variables)

            strategy.run(replica, args=(xb, yb))

        for t in range(x.shape[0]):
            data = strategy.experimental_distribute_values_from_function(
                lambda ctx, t=t: (
                    tf.constant(x[t, ctx.replica_id_in_sync_group], tf.float32),
                    tf.constant(y[t, ctx.replica_id_in_sync_group], tf.float32),
                )
            )
            step(*data)
        return [np.stack(w) for w in _copies(model)], optimizer.averages_performed

    delayed, averages = train(3)
    plain, plain_averages = train(False)
    assert averages == plain_averages == 2
    for a, b in zip(delayed, plain, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6)


def _copies(model):
    return [
        [c.numpy() for c in getattr(v.value, "values", (v.value,))]
        for v in model.trainable_variables
    ]


class _SaveMidFlight(keras.callbacks.Callback):
    """Saves the model after `batch` and records whether a mean was on its
    way before and after the save."""

    def __init__(self, path, batch):
        super().__init__()
        self.path, self.batch, self.seen = path, batch, None

    def on_train_batch_end(self, batch, logs=None):
        if batch == self.batch and self.seen is None:
            flight = self.model.optimizer._flight
            before = flight.in_flight
            self.model.save(self.path)
            self.seen = (before, flight.in_flight)


def test_a_save_while_a_mean_is_on_its_way_lands_it_first(tmp_path):
    """Interval 4, delay 3: the average due after step 4 is on its way after
    step 5. A save there lands it first, so the file holds no half-finished
    average; training goes on and ends as the reference that landed there."""
    path = tmp_path / "mid.keras"
    save = _SaveMidFlight(path, batch=4)
    skip = dict(interval=4, correction=1.0, overlap=3)
    model, optimizer = train_keras(
        mirrored(REPLICAS), INNERS["sgd"][0], callbacks=[save], **skip
    )
    assert save.seen == (True, False)
    assert np.isfinite(weights_of(model)).all()
    with mirrored(REPLICAS).scope():
        restored = keras.saving.load_model(path)
    assert restored.optimizer.averages_performed == 1
    # The save landed the mean where the run would have: before the epoch's
    # last step, whose execution takes the boundary average.
    expected = reference(INNERS["sgd"][1](), **skip)
    assert_relative(weights_of(model), expected.x)
    assert optimizer.averages_performed == expected.averages


class _CheckpointMidFlight(keras.callbacks.Callback):
    """Writes a raw `tf.train.Checkpoint` after `batch`; records whether a
    mean was on its way before and after, and every replica's weights and
    corrections right after the write."""

    def __init__(self, path, batch):
        super().__init__()
        self.path, self.batch, self.seen, self.state = path, batch, None, None

    def on_train_batch_end(self, batch, logs=None):
        if batch == self.batch and self.seen is None:
            optimizer = self.model.optimizer
            before = optimizer._flight.in_flight
            checkpoint = tf.train.Checkpoint(model=self.model, optimizer=optimizer)
            checkpoint.write(str(self.path))
            self.seen = (before, optimizer._flight.in_flight)
            self.state = (weights_of(self.model), corrections_of(optimizer))


def test_a_raw_checkpoint_while_a_mean_is_on_its_way_lands_it_first(tmp_path):
    """As a `.keras` save: a `tf.train.Checkpoint` written mid-flight lands
    the mean first, and restores into a new model and optimizer every
    replica's corrections as they were right after it, and the model's
    weights as TensorFlow saves a mirrored variable: replica 0's copy."""
    path = tmp_path / "mid"
    write = _CheckpointMidFlight(path, batch=4)
    skip = dict(interval=4, correction=1.0, overlap=3)
    model, _ = train_keras(
        mirrored(REPLICAS), INNERS["sgd"][0], callbacks=[write], **skip
    )
    assert write.seen == (True, False)
    expected = reference(INNERS["sgd"][1](), **skip)
    assert_relative(weights_of(model), expected.x)
    with mirrored(REPLICAS).scope():
        restored = linear_model()
        again = keras_skip.SkipCorrectionOptimizer(INNERS["sgd"][0](), **skip)
        restored.compile(optimizer=again, loss="mse")
        again.build(restored.trainable_variables)
    tf.train.Checkpoint(model=restored, optimizer=again).read(str(path))
    assert again.averages_performed == 1
    weights, corrections = write.state
    np.testing.assert_array_equal(
        weights_of(restored), np.broadcast_to(weights[:1], weights.shape)
    )
    np.testing.assert_array_equal(corrections_of(again), corrections)
    assert np.abs(corrections - corrections[:1]).max() > 0  # each replica's own


def test_an_all_reduce_that_fails_is_raised_in_fit(monkeypatch):
    """The all-reduce fails when it runs (not when it is traced); `fit`
    raises at the landing, with the cause's message (a TensorFlow error's
    repr has none). A peer lost in flight: `test_multi_worker.py`, with real
    processes."""
    from keras_skip import _flight

    def boom():
        raise ValueError("injected")

    def failing(self, fragment):
        tf.py_function(boom, [], [])

    monkeypatch.setattr(_flight.Flight, "_reduce_body", failing)
    message = r"(?s)failed in its all-reduce.*The cause: \w+Error: .*injected"
    with pytest.raises(RuntimeError, match=message) as raised:
        train_keras(mirrored(REPLICAS), INNERS["sgd"][0], interval=3, overlap=2)
    assert "ValueError: injected" in str(raised.value)


def test_overlap_steps_are_saved_in_the_config_and_checked():
    strategy = mirrored(2)
    with strategy.scope():
        optimizer = keras_skip.SkipCorrectionOptimizer(
            keras.optimizers.SGD(LR), interval=8, overlap=4
        )
        assert optimizer.get_config()["overlap"] == 4
        copy = keras_skip.SkipCorrectionOptimizer.from_config(optimizer.get_config())
        assert copy.overlap == 4
    with pytest.raises(ValueError, match=r"`overlap` must be .*overlap=-1"):
        keras_skip.SkipCorrectionOptimizer(keras.optimizers.SGD(LR), overlap=-1)
    with pytest.raises(TypeError, match=r"`overlap` must be .*overlap=2.5"):
        keras_skip.SkipCorrectionOptimizer(keras.optimizers.SGD(LR), overlap=2.5)
