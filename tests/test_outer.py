"""The outer optimizer (SlowMo / DiLoCo) on the averaged update."""

import keras
import numpy as np
import pytest
import tensorflow as tf
from conftest import components, mirrored, quadratic_problem
from hypothesis import given, settings
from hypothesis import strategies as st
from test_against_reference import (
    INNERS,
    REPLICAS,
    assert_relative,
    corrections_of,
    reference,
    train_keras,
    weights_of,
)
from test_saving import BATCH, data, new_model

import keras_skip
from keras_skip import maths


def nesterov():
    return keras.optimizers.SGD(0.7, momentum=0.9, nesterov=True)


# The reference ------------------------------------------------------------------


@settings(max_examples=40, deadline=None)
@given(
    st.integers(0, 2**16),
    st.integers(1, 5),
    st.integers(1, 9),
    st.sampled_from([0.0, 0.5, 1.0]),
    st.sampled_from(["local", "average", "reset"]),
)
def test_outer_sgd_with_learning_rate_1_is_the_plain_average(
    seed, n, interval, beta, policy
):
    grad = quadratic_problem(seed, n)
    common = dict(
        n=n,
        steps=40,
        learning_rate=0.05,
        interval=interval,
        correction=beta,
        inner=maths.sgd(0.5),
        optimizer_state=policy,
        warmup_steps=3,
        boundaries=(17, 40),
    )
    plain = maths.simulate(np.zeros(3), grad, **common)
    outer = maths.simulate(
        np.zeros(3), grad, outer=maths.sgd(), outer_learning_rate=1.0, **common
    )
    np.testing.assert_allclose(outer.x, plain.x, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(outer.correction, plain.correction, atol=1e-12)
    assert outer.averages == plain.averages


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 2**16), st.integers(2, 5), st.integers(1, 9))
def test_outer_step_keeps_replicas_identical_and_corrections_summing_to_zero(
    seed, n, interval
):
    result = maths.simulate(
        np.zeros(3),
        quadratic_problem(seed, n),
        n=n,
        steps=30,
        learning_rate=0.05,
        interval=interval,
        correction=1.0,
        outer=maths.sgd(0.9, nesterov=True),
        outer_learning_rate=0.7,
        boundaries=(30,),
    )
    np.testing.assert_allclose(result.x, result.x[:1].repeat(n, axis=0), atol=0)
    np.testing.assert_allclose(result.correction.sum(axis=0), 0.0, atol=1e-9)


def test_outer_momentum_carries_the_previous_periods():
    x_start, x_bar = np.array([1.0]), np.array([0.5])
    outer = maths.sgd(0.9)
    first, slots = maths.outer_step(x_start, x_bar, outer, outer.init(x_start), 1.0, 0)
    assert first == pytest.approx(0.5)
    # The next period moved as far again: momentum adds 0.9 of the last step.
    second, _ = maths.outer_step(first, first - 0.5, outer, slots, 1.0, 1)
    assert second == pytest.approx(0.5 - 0.5 - 0.9 * 0.5)


# TensorFlow against the reference -----------------------------------------------


@pytest.mark.parametrize("interval", [1, 3, 8])
def test_fit_with_a_nesterov_outer_optimizer_matches_reference(interval):
    make_keras, make_reference = INNERS["momentum"]
    model, optimizer = train_keras(
        mirrored(REPLICAS),
        make_keras,
        interval=interval,
        correction=1.0,
        make_outer=nesterov,
    )
    expected = reference(
        make_reference(),
        interval=interval,
        correction=1.0,
        outer=maths.sgd(0.9, nesterov=True),
        outer_learning_rate=0.7,
    )
    assert_relative(weights_of(model), expected.x, tolerance=1e-5)
    assert_relative(corrections_of(optimizer), expected.correction, tolerance=1e-4)
    outer_steps = 0 if interval == 1 else expected.averages
    assert int(optimizer.outer_optimizer.iterations.numpy()) == outer_steps


def test_fit_with_an_adam_outer_optimizer_and_slot_averaging_matches_reference():
    make_keras, make_reference = INNERS["momentum"]
    model, _ = train_keras(
        mirrored(REPLICAS),
        make_keras,
        interval=4,
        correction=0.5,
        optimizer_state="average",
        make_outer=lambda: keras.optimizers.Adam(0.1),
    )
    expected = reference(
        make_reference(),
        interval=4,
        correction=0.5,
        optimizer_state="average",
        outer=maths.adam(),
        outer_learning_rate=0.1,
    )
    assert_relative(weights_of(model), expected.x, tolerance=1e-4)


def test_outer_sgd_with_learning_rate_1_trains_like_no_outer_optimizer():
    make_keras, _ = INNERS["momentum"]
    runs = [
        train_keras(mirrored(REPLICAS), make_keras, interval=3, **option)
        for option in ({}, {"make_outer": lambda: keras.optimizers.SGD(1.0)})
    ]
    (plain, _), (outer, _) = runs
    np.testing.assert_allclose(weights_of(outer), weights_of(plain), atol=1e-6)


def test_outer_optimizer_on_one_replica():
    # With one replica the average is the replica itself; the outer step
    # still applies to the period's update.
    make_keras, _ = INNERS["sgd"]
    plain, _ = train_keras(tf.distribute.get_strategy(), make_keras, interval=3)
    doubled, optimizer = train_keras(
        tf.distribute.get_strategy(),
        make_keras,
        interval=3,
        make_outer=lambda: keras.optimizers.SGD(2.0),
    )
    assert int(optimizer.outer_optimizer.iterations.numpy()) == 4
    assert np.abs(weights_of(doubled) - weights_of(plain)).max() > 1e-3


# Saving -----------------------------------------------------------------------


def test_saved_mid_period_the_outer_state_and_period_start_come_back(tmp_path):
    model = new_model(tf.distribute.get_strategy(), interval=4, make_outer=nesterov)
    x, y = data()

    def batch(i):
        return x[BATCH * i : BATCH * (i + 1)], y[BATCH * i : BATCH * (i + 1)]

    for i in range(6):  # one average after step 4, then 2 local steps
        model.train_on_batch(*batch(i))
    optimizer = model.optimizer
    assert int(optimizer.outer_optimizer.iterations.numpy()) == 1
    assert optimizer.local_steps_since_average == 2
    path = tmp_path / "mid.keras"
    model.save(path)
    loaded = keras.models.load_model(path)
    outer = loaded.optimizer.outer_optimizer
    assert isinstance(outer, keras.optimizers.SGD) and outer.nesterov
    for a, b in zip(optimizer.variables, loaded.optimizer.variables, strict=True):
        np.testing.assert_array_equal(a.numpy(), b.numpy())
    for i in range(6, 8):  # the period ends: an average and an outer step
        model.train_on_batch(*batch(i))
        loaded.train_on_batch(*batch(i))
    assert int(outer.iterations.numpy()) == 2
    for a, b in zip(model.get_weights(), loaded.get_weights(), strict=True):
        np.testing.assert_array_equal(a, b)


def test_save_load_continue_with_an_outer_optimizer_on_4_replicas(tmp_path):
    def fit(model, epochs, initial_epoch=0):
        x, y = data()
        model.fit(
            x,
            y,
            batch_size=BATCH,
            epochs=epochs,
            initial_epoch=initial_epoch,
            shuffle=False,
            verbose=0,
            callbacks=[keras_skip.SkipCorrectionCallback()],
        )

    uninterrupted = new_model(mirrored(4), interval=3, make_outer=nesterov)
    fit(uninterrupted, 2)
    first = new_model(mirrored(4), interval=3, make_outer=nesterov)
    fit(first, 1)
    first.save(tmp_path / "model.keras")
    with mirrored(4).scope():
        resumed = keras.models.load_model(tmp_path / "model.keras")
    fit(resumed, 2, initial_epoch=1)
    for a, b in zip(
        uninterrupted.optimizer.variables, resumed.optimizer.variables, strict=True
    ):
        for ca, cb in zip(components(a), components(b), strict=True):
            np.testing.assert_allclose(cb, ca, rtol=1e-6, atol=1e-7)


def test_get_config_round_trip_keeps_the_outer_optimizer():
    optimizer = keras_skip.SkipCorrectionOptimizer(
        keras.optimizers.Adam(0.001), interval=5, outer_optimizer=nesterov()
    )
    config = optimizer.get_config()
    clone = keras_skip.SkipCorrectionOptimizer.from_config(config)
    assert clone.get_config() == config
    assert clone.outer_optimizer.momentum == 0.9 and clone.outer_optimizer.nesterov
    plain = keras_skip.SkipCorrectionOptimizer(keras.optimizers.SGD(0.1))
    assert plain.get_config()["outer_optimizer"] is None
    assert (
        keras_skip.SkipCorrectionOptimizer.from_config(
            plain.get_config()
        ).outer_optimizer
        is None
    )


# Errors -----------------------------------------------------------------------


def test_outer_optimizer_errors():
    with pytest.raises(
        TypeError,
        match=r"`outer_optimizer` must be a keras\.opt.*"
        r"Received: outer_optimizer='sgd'",
    ):
        keras_skip.SkipCorrectionOptimizer(
            keras.optimizers.SGD(0.1), outer_optimizer="sgd"
        )
    inner = keras.optimizers.SGD(0.1)
    with pytest.raises(ValueError, match="another optimizer instance"):
        keras_skip.SkipCorrectionOptimizer(inner, outer_optimizer=inner)
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    used = keras.optimizers.SGD(0.5)
    used.build(model.trainable_variables)
    optimizer = keras_skip.SkipCorrectionOptimizer(
        keras.optimizers.SGD(0.1), outer_optimizer=used
    )
    with pytest.raises(ValueError, match="outer optimizer has already been built"):
        optimizer.build(model.trainable_variables)
