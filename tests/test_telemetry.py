"""Telemetry: interval, averages, bytes sent and drift in the logs and TensorBoard."""

import glob

import keras
import numpy as np
import pytest
import tensorflow as tf
from conftest import mirrored
from test_against_reference import (
    INNERS,
    REPLICAS,
    STEPS_PER_EPOCH,
    reference,
    train_keras,
    weights_of,
)

import keras_skip
from keras_skip import maths

PARAMETERS = 6  # the reference's linear model: 5 kernel weights and a bias


@pytest.mark.parametrize("interval", [2, 4])
def test_drift_matches_the_reference(interval):
    make_keras, make_reference = INNERS["momentum"]
    model, optimizer = train_keras(
        mirrored(REPLICAS),
        make_keras,
        interval=interval,
        correction=1.0,
        measure_drift=True,
    )
    expected = reference(make_reference(), interval=interval, correction=1.0)
    # Epochs of 6 steps: interval 2 averages 3 times per epoch, interval 4
    # twice (after step 4 and at the epoch's end).
    per_epoch = {2: 3, 4: 2}[interval]
    drifts = np.reshape(expected.drifts, (-1, per_epoch))
    assert drifts.min() > 0
    history = model.history.history
    assert history["averages"] == [per_epoch] * len(drifts)
    np.testing.assert_allclose(history["drift"], drifts.mean(axis=1), rtol=1e-4)
    total, last = optimizer.drift
    assert total == pytest.approx(drifts.sum(), rel=1e-4)
    assert last == pytest.approx(drifts[-1, -1], rel=1e-4)


def test_measuring_drift_changes_no_number():
    make_keras, _ = INNERS["momentum"]
    runs = [
        train_keras(
            mirrored(REPLICAS), make_keras, interval=4, correction=1.0, **option
        )
        for option in ({}, {"measure_drift": True})
    ]
    (off, off_optimizer), (on, _) = runs
    np.testing.assert_array_equal(weights_of(off), weights_of(on))
    assert "drift" not in off.history.history
    assert off_optimizer.drift == (0.0, 0.0)
    assert not any("drift" in v.path for v in off_optimizer.variables)


def test_bytes_sent_counts_every_payload():
    make_keras, _ = INNERS["momentum"]
    weights = PARAMETERS * 4
    # Interval 4: two averages per epoch of the weights alone (slots stay local).
    model, optimizer = train_keras(mirrored(REPLICAS), make_keras, interval=4)
    assert model.history.history["bytes_sent"] == [2 * weights] * 2
    assert optimizer.bytes_sent == 4 * weights
    # "average": the momentum slots travel with the weights.
    model, optimizer = train_keras(
        mirrored(REPLICAS), make_keras, interval=4, optimizer_state="average"
    )
    assert optimizer.bytes_sent == 4 * 2 * weights
    # Interval 1: one gradient all-reduce per step, no average.
    model, optimizer = train_keras(mirrored(REPLICAS), make_keras, interval=1)
    assert model.history.history["bytes_sent"] == [STEPS_PER_EPOCH * weights] * 2
    assert model.history.history["averages"] == [0, 0]
    assert model.history.history["interval"] == [1, 1]


def test_one_replica_sends_nothing():
    make_keras, _ = INNERS["sgd"]
    model, optimizer = train_keras(
        tf.distribute.get_strategy(), make_keras, interval=2, measure_drift=True
    )
    assert optimizer.bytes_sent == 0
    assert model.history.history["bytes_sent"] == [0, 0]
    assert model.history.history["drift"] == [0.0, 0.0]


def test_tensorboard_writes_the_telemetry_as_scalars(tmp_path):
    make_keras, _ = INNERS["sgd"]
    board = keras.callbacks.TensorBoard(str(tmp_path))
    model, _ = train_keras(
        mirrored(REPLICAS),
        make_keras,
        interval=4,
        measure_drift=True,
        callbacks=[board],
    )
    scalars = {}
    for path in glob.glob(str(tmp_path / "train" / "events.out.tfevents.*")):
        for record in tf.data.TFRecordDataset(path):
            event = tf.compat.v1.Event.FromString(record.numpy())
            for value in event.summary.value:
                if value.tag.startswith("epoch_"):
                    scalars.setdefault(value.tag, []).append(
                        float(tf.make_ndarray(value.tensor))
                    )

    history = model.history.history
    for key in ("interval", "averages", "bytes_sent", "drift"):
        assert scalars[f"epoch_{key}"] == pytest.approx(history[key]), key


def test_reference_drift_is_the_mean_distance_to_the_average():
    x = np.array([[0.0, 0.0], [3.0, 4.0], [0.0, 0.0], [3.0, 4.0]])
    assert maths.drift(x) == pytest.approx(2.5)
    assert maths.drift(np.ones((3, 2, 2))) == 0.0


@pytest.mark.parametrize("value", ["yes", 1, None])
def test_measure_drift_must_be_a_bool(value):
    with pytest.raises(TypeError, match=rf"measure_drift={value!r}"):
        keras_skip.SkipCorrectionOptimizer(
            keras.optimizers.SGD(0.1), measure_drift=value
        )
