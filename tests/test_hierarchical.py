"""Hierarchical averaging: groups of replicas synchronous every step, groups
skipping and averaging every `interval` steps (`group_size`)."""

import keras
import numpy as np
import pytest
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
from test_multi_worker import mirrored_reference, outputs, run_workers

import keras_skip
from keras_skip import maths

# The reference ------------------------------------------------------------------


@settings(max_examples=40, deadline=None)
@given(
    st.integers(0, 2**16),
    st.integers(2, 3),
    st.integers(1, 3),
    st.integers(1, 9),
    st.sampled_from([0.0, 0.5, 1.0]),
    st.sampled_from(["local", "average", "reset"]),
)
def test_a_group_moves_as_one_replica_with_its_members_batches(
    seed, groups, group_size, interval, beta, policy
):
    n = groups * group_size
    grad = quadratic_problem(seed, n)

    def group_grad(t, x):
        # The n-replica problem seen by `groups` replicas: each computes its
        # members' gradients at its own weights and takes their mean.
        members = np.repeat(x, group_size, axis=0)
        return maths.group_mean(grad(t, members), group_size)[::group_size]

    common = dict(
        steps=40,
        learning_rate=0.05,
        interval=interval,
        correction=beta,
        inner=maths.sgd(0.5),
        optimizer_state=policy,
        warmup_steps=3,
        boundaries=(17, 40),
    )
    grouped = maths.simulate(np.zeros(3), grad, n=n, group_size=group_size, **common)
    plain = maths.simulate(np.zeros(3), group_grad, n=groups, **common)

    for step in grouped.history:
        members = step.reshape(groups, group_size, -1)
        np.testing.assert_array_equal(members, members[:, :1].repeat(group_size, 1))
    np.testing.assert_allclose(grouped.x[::group_size], plain.x, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(
        grouped.correction[::group_size], plain.correction, atol=1e-12
    )
    np.testing.assert_allclose(grouped.correction.sum(0), 0.0, atol=1e-9)
    assert grouped.averages == plain.averages


def test_group_size_must_divide_the_replicas():
    with pytest.raises(ValueError, match="group_size 3 does not divide n=4"):
        maths.simulate(
            np.zeros(3),
            quadratic_problem(0, 4),
            n=4,
            steps=1,
            learning_rate=0.1,
            interval=2,
            correction=1.0,
            group_size=3,
        )


# Keras on 4 MirroredStrategy replicas --------------------------------------------


@pytest.mark.parametrize("interval", [3, 8])
def test_groups_of_two_match_the_reference(interval):
    make_keras, make_reference = INNERS["momentum"]
    model, optimizer = train_keras(
        mirrored(REPLICAS), make_keras, interval=interval, group_size=2
    )
    expected = reference(
        make_reference(), interval=interval, correction=1.0, group_size=2
    )
    plain = reference(make_reference(), interval=interval, correction=1.0)
    assert np.abs(expected.x - plain.x).max() > 1e-3  # the groups matter
    assert_relative(weights_of(model), expected.x)
    corrections = corrections_of(optimizer)
    assert_relative(corrections, expected.correction)
    # The members of a group keep one correction, bit for bit.
    np.testing.assert_array_equal(corrections[0], corrections[1])
    np.testing.assert_array_equal(corrections[2], corrections[3])
    assert np.abs(corrections[0] - corrections[2]).max() > 1e-4
    assert optimizer.averages_performed == expected.averages


def test_group_members_stay_identical_between_averages():
    make_keras, _ = INNERS["momentum"]
    # 6 steps per epoch, interval 4: after the epoch the groups are 2 local
    # steps apart, with no boundary average before `on_train_batch_end`.
    seen = []

    class Spread(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            kernel = components(self.model.layers[0].kernel)
            seen.append(
                (
                    np.abs(kernel[0] - kernel[1]).max(),
                    np.abs(kernel[2] - kernel[3]).max(),
                    np.abs(kernel[0] - kernel[2]).max(),
                )
            )

    train_keras(
        mirrored(REPLICAS),
        make_keras,
        interval=4,
        group_size=2,
        callbacks=[Spread()],
    )
    assert all(within0 == within1 == 0.0 for within0, within1, _ in seen)
    assert max(between for _, _, between in seen) > 1e-4


def test_one_group_per_worker_on_one_worker_is_synchronous_sgd():
    make_keras, _ = INNERS["sgd"]
    model, optimizer = train_keras(
        mirrored(REPLICAS), make_keras, interval=3, group_size="worker"
    )
    synchronous, _ = train_keras(mirrored(REPLICAS), make_keras, interval=1)
    assert optimizer.group_size == "worker"
    assert_relative(weights_of(model), weights_of(synchronous))


def test_sparse_gradients_are_grouped():
    strategy = mirrored(REPLICAS)
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 20, size=(64, 3))
    labels = rng.normal(size=(64, 1)).astype("float32")
    with strategy.scope():
        embedding = keras.layers.Embedding(20, 4)
        model = keras.Sequential(
            [
                keras.Input((3,), dtype="int32"),
                embedding,
                keras.layers.Flatten(),
                keras.layers.Dense(1),
            ]
        )
        optimizer = keras_skip.SkipCorrectionOptimizer(
            keras.optimizers.SGD(0.1), interval=5, group_size=2
        )
        model.compile(optimizer=optimizer, loss="mse")
    spreads = []

    class Spread(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            table = components(embedding.embeddings)
            spreads.append(
                (np.abs(table[0] - table[1]).max(), np.abs(table[0] - table[2]).max())
            )

    model.fit(
        tokens,
        labels,
        batch_size=16,
        epochs=1,
        shuffle=False,
        verbose=0,
        callbacks=[keras_skip.SkipCorrectionCallback(), Spread()],
    )
    assert all(within == 0.0 for within, _ in spreads[:-1])
    assert max(between for _, between in spreads[:-1]) > 1e-5


def test_group_size_off_is_bit_for_bit_the_plain_algorithm():
    make_keras, _ = INNERS["momentum"]
    ones, _ = train_keras(mirrored(REPLICAS), make_keras, interval=3, group_size=1)
    plain, _ = train_keras(mirrored(REPLICAS), make_keras, interval=3)
    np.testing.assert_array_equal(weights_of(ones), weights_of(plain))


# Configuration and errors ---------------------------------------------------------


@pytest.mark.parametrize(
    "value, error, message",
    [
        (0, ValueError, "`group_size` must be an integer >= 1. Received: group_size=0"),
        (1.5, TypeError, "Received: group_size=1.5 of type float"),
        (True, TypeError, "Received: group_size=True of type bool"),
        ("workers", ValueError, "or 'worker'. Received: group_size='workers'"),
    ],
)
def test_bad_group_size_is_refused(value, error, message):
    with pytest.raises(error, match=message):
        keras_skip.SkipCorrectionOptimizer(keras.optimizers.SGD(0.1), group_size=value)


def test_group_spanning_two_workers_is_refused_when_built():
    make_keras, _ = INNERS["sgd"]
    with pytest.raises(ValueError, match=r"divide the number of replicas on each "):
        train_keras(mirrored(REPLICAS), make_keras, interval=3, group_size=3)


@pytest.mark.parametrize("group_size", [None, 2, "worker"])
def test_group_size_survives_get_config(group_size):
    optimizer = keras_skip.SkipCorrectionOptimizer(
        keras.optimizers.SGD(0.1), group_size=group_size
    )
    config = optimizer.get_config()
    assert config["group_size"] == group_size
    restored = keras_skip.SkipCorrectionOptimizer.from_config(config)
    assert restored.group_size == group_size


# Two workers with two devices each --------------------------------------------------


@pytest.mark.slow
def test_two_workers_of_two_devices_equal_four_replicas_in_groups_of_two(tmp_path):
    config = dict(interval=3, momentum=0.5, epochs=2, group_size="worker")
    result = run_workers(tmp_path, 2, local_devices=2, **config)
    assert result.ok, result.failure_report()
    results = outputs(tmp_path, 2)
    np.testing.assert_array_equal(results[0]["weights"], results[1]["weights"])
    # 256 samples / (2 workers x 2 devices x 8) = 8 steps per epoch.
    assert results[0]["after_averages"].tolist() == [3, 6, 8, 11, 14, 16]
    # MultiWorkerMirroredStrategy gives worker w's device d the rows of
    # slot 2d + w of each global batch of 4 x 8 rows (it splits the batch
    # into per-replica slots, then shards the slots between workers).
    weights, corrections = mirrored_reference(
        4, slots=[0, 2, 1, 3], **{**config, "group_size": 2}
    )

    np.testing.assert_allclose(results[0]["weights"], weights, rtol=1e-5, atol=1e-6)
    for worker, r in enumerate(results):
        local = r["local_corrections"]
        assert local.shape[0] == 2
        np.testing.assert_array_equal(local[0], local[1])  # one per worker
        np.testing.assert_allclose(
            local[0], corrections[2 * worker], rtol=1e-4, atol=1e-6
        )
    assert np.abs(results[0]["local_corrections"][0]).max() > 1e-4
