"""Compressed averages: 16-bit updates with error feedback."""

import internals
import keras
import numpy as np
import pytest
import tensorflow as tf
from conftest import components, max_replica_spread, mirrored, quadratic_problem
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from test_against_reference import (
    INNERS,
    REPLICAS,
    assert_relative,
    corrections_of,
    reference,
    train_keras,
    weights_of,
)

import keras_skip
from keras_skip import maths

PARAMETERS = 6  # the reference's linear model

finite = st.floats(-1e3, 1e3, allow_nan=False, width=32)


# The reference ------------------------------------------------------------------


@pytest.mark.parametrize("dtype", maths.COMPRESSIONS)
def test_quantize_rounds_like_a_cast_to_the_wire_type(dtype):
    x = np.random.default_rng(0).normal(size=1000).astype(np.float32) * 10
    expected = tf.cast(tf.cast(x, dtype), tf.float64).numpy()
    np.testing.assert_array_equal(maths.quantize(x, dtype), expected)


@settings(max_examples=60, deadline=None)
@given(
    hnp.arrays(np.float64, (12, 5), elements=finite),
    st.sampled_from(maths.COMPRESSIONS),
)
def test_error_feedback_sends_the_true_sum_but_for_the_last_error(updates, dtype):
    # Half a unit in the last place, relative: 8 and 11 significant bits.
    half_ulp = {"bfloat16": 2.0**-8, "float16": 2.0**-11}[dtype]
    error = np.zeros(5)
    sent_total = np.zeros(5)
    for update in updates:
        corrected = update + error
        sent, error = maths.compress_with_feedback(update, error, dtype)
        np.testing.assert_array_equal(sent, maths.quantize(sent, dtype))
        assert np.all(np.abs(error) <= np.abs(corrected) * half_ulp + 2.0**-24)
        sent_total += sent
    np.testing.assert_allclose(sent_total + error, updates.sum(axis=0), atol=1e-9)


@settings(max_examples=30, deadline=None)
@given(
    st.integers(0, 2**16),
    st.integers(2, 5),
    st.integers(1, 8),
    st.sampled_from(maths.COMPRESSIONS),
)
def test_compressed_averages_keep_replicas_identical(seed, n, interval, dtype):
    result = maths.simulate(
        np.zeros(3),
        quadratic_problem(seed, n),
        n=n,
        steps=40,
        learning_rate=0.05,
        interval=interval,
        correction=1.0,
        compression=dtype,
        boundaries=(40,),
    )
    np.testing.assert_array_equal(result.x, result.x[:1].repeat(n, axis=0))
    assert np.isfinite(result.correction).all()


@settings(max_examples=20, deadline=None)
@given(st.integers(0, 2**16), st.integers(2, 4))
def test_compressed_training_stays_close_to_exact_averages(seed, n):
    common = dict(
        n=n,
        steps=60,
        learning_rate=0.05,
        interval=4,
        correction=1.0,
        boundaries=(60,),
    )
    grad = quadratic_problem(seed, n)
    exact = maths.simulate(np.zeros(3), grad, **common)
    compressed = maths.simulate(np.zeros(3), grad, compression="bfloat16", **common)
    np.testing.assert_allclose(compressed.x, exact.x, atol=2e-2)


# TensorFlow against the reference -----------------------------------------------


@pytest.mark.parametrize("dtype", maths.COMPRESSIONS)
def test_fit_with_compression_matches_reference(dtype):
    make_keras, make_reference = INNERS["momentum"]
    model, optimizer = train_keras(
        mirrored(REPLICAS), make_keras, interval=3, correction=1.0, compression=dtype
    )
    expected = reference(
        make_reference(), interval=3, correction=1.0, compression=dtype
    )
    exact = reference(make_reference(), interval=3, correction=1.0)
    assert_relative(weights_of(model), expected.x, tolerance=1e-5)
    assert_relative(corrections_of(optimizer), expected.correction, tolerance=1e-4)
    # Compression changes the trajectory far more than that tolerance.
    assert np.linalg.norm(expected.x - exact.x) > 1e-4 * np.linalg.norm(exact.x)
    assert max_replica_spread(model.trainable_weights) == 0.0
    assert optimizer.bytes_sent == expected.averages * PARAMETERS * 2


def test_compression_with_an_outer_optimizer_and_drift_matches_reference():
    make_keras, make_reference = INNERS["sgd"]
    model, optimizer = train_keras(
        mirrored(REPLICAS),
        make_keras,
        interval=4,
        correction=1.0,
        compression="bfloat16",
        measure_drift=True,
        make_outer=lambda: keras.optimizers.SGD(0.7, momentum=0.9, nesterov=True),
    )
    expected = reference(
        make_reference(),
        interval=4,
        correction=1.0,
        compression="bfloat16",
        outer=maths.sgd(0.9, nesterov=True),
        outer_learning_rate=0.7,
    )
    assert_relative(weights_of(model), expected.x, tolerance=1e-5)
    total, _ = optimizer.drift
    assert total == pytest.approx(sum(expected.drifts), rel=1e-4)


def test_unsent_errors_are_saved_per_replica_and_restored(tmp_path):
    make_keras, _ = INNERS["momentum"]
    model, optimizer = train_keras(
        mirrored(REPLICAS), make_keras, interval=3, compression="bfloat16"
    )
    errors = [components(e) for e in internals.unsent(optimizer)]
    assert any(np.abs(c).max() > 0 for copies in errors for c in copies)
    assert any(
        not np.array_equal(copies[0], copies[1]) for copies in errors
    )  # each replica keeps its own
    path = tmp_path / "model.keras"
    model.save(path)
    with mirrored(REPLICAS).scope():
        loaded = keras.models.load_model(path)
    assert loaded.optimizer.compression == "bfloat16"
    for saved, restored in zip(errors, internals.unsent(loaded.optimizer), strict=True):
        for a, b in zip(saved, components(restored), strict=True):
            np.testing.assert_array_equal(a, b)


def test_compression_errors():
    with pytest.raises(ValueError, match=r"`compression` must be None, 'bfloat16' "):
        keras_skip.SkipCorrectionOptimizer(
            keras.optimizers.SGD(0.1), compression="int8"
        )
    config = keras_skip.SkipCorrectionOptimizer(
        keras.optimizers.SGD(0.1), compression="float16"
    ).get_config()
    assert config["compression"] == "float16"
    assert (
        keras_skip.SkipCorrectionOptimizer.from_config(config).compression == "float16"
    )


def test_one_replica_with_compression_is_the_inner_optimizer():
    make_keras, _ = INNERS["sgd"]
    plain, _ = train_keras(tf.distribute.get_strategy(), make_keras, interval=3)
    compressed, optimizer = train_keras(
        tf.distribute.get_strategy(), make_keras, interval=3, compression="bfloat16"
    )
    np.testing.assert_array_equal(weights_of(compressed), weights_of(plain))
    assert optimizer.bytes_sent == 0


def test_wire_mean_rounds_after_each_addition():
    sent = np.array([[1.0], [2.0**-8], [2.0**-8], [0.0]])
    # Exactly 1 + 2**-7 over 4, but 1 + 2**-8 rounds to 1 in bfloat16 (ties
    # to even), twice.
    assert maths.wire_mean(sent, "bfloat16")[0, 0] == 0.25
    assert maths.wire_mean(sent, "float16")[0, 0] == (1 + 2.0**-7) / 4
