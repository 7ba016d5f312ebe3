"""Interval 1, warm-up and one replica are exactly the inner optimizer."""

import keras
import numpy as np
import pytest
from conftest import mirrored

import keras_skip

N_SAMPLES, D = 128, 6


def data(seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(N_SAMPLES, D)).astype("float32")
    y = (x @ rng.normal(size=(D, 3)) > 0).astype("float32")
    return x, y


def build_model(seed=3):
    keras.utils.set_random_seed(seed)
    return keras.Sequential(
        [
            keras.Input((D,)),
            keras.layers.Dense(16, activation="relu"),
            keras.layers.Dense(3, activation="sigmoid"),
        ]
    )


INNERS = {
    "sgd": lambda: keras.optimizers.SGD(0.1),
    "momentum": lambda: keras.optimizers.SGD(0.1, momentum=0.9, nesterov=True),
    "adam": lambda: keras.optimizers.Adam(0.01),
    "adamw": lambda: keras.optimizers.AdamW(0.01, weight_decay=0.05),
    "clipped_sgd": lambda: keras.optimizers.SGD(0.1, clipnorm=0.05),
}


def train(
    strategy, optimizer_factory, epochs=2, batch_size=16, callbacks=None, shuffle=False
):
    x, y = data()
    with strategy.scope():
        model = build_model()
        model.compile(optimizer=optimizer_factory(), loss="binary_crossentropy")
    model.fit(
        x,
        y,
        batch_size=batch_size,
        epochs=epochs,
        shuffle=shuffle,
        verbose=0,
        callbacks=callbacks or [],
    )
    return model


@pytest.mark.parametrize("inner", ["sgd", "adam"])
def test_interval_1_equals_stock_synchronous_training(inner):
    stock = train(mirrored(4), INNERS[inner])
    skip = train(
        mirrored(4),
        lambda: keras_skip.SkipCorrectionOptimizer(INNERS[inner](), interval=1),
        callbacks=[keras_skip.SkipCorrectionCallback()],
    )
    for a, b in zip(stock.get_weights(), skip.get_weights(), strict=True):
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-7)
    assert skip.optimizer.averages_performed == 0


@pytest.mark.parametrize("replicas", [1, 2])
def test_shuffled_epochs_are_keras_own_in_one_process(replicas):
    """In one process the wrapper leaves Keras' data path alone: with a fixed
    seed Keras' shuffle of arrays draws the same order every epoch, and
    interval 1 still equals stock synchronous training over 3 epochs."""

    def shuffled(optimizer_factory, callbacks=None):
        keras.utils.set_random_seed(5)  # the same shuffle ops for both
        return train(
            mirrored(replicas),
            optimizer_factory,
            epochs=3,
            callbacks=callbacks,
            shuffle=True,
        )

    stock = shuffled(INNERS["sgd"])
    skip = shuffled(
        lambda: keras_skip.SkipCorrectionOptimizer(INNERS["sgd"](), interval=1),
        callbacks=[keras_skip.SkipCorrectionCallback()],
    )
    for a, b in zip(stock.get_weights(), skip.get_weights(), strict=True):
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-7)


def test_warmup_steps_equal_stock_synchronous_training():
    """All 16 steps fall inside the warm-up: identical to stock training."""
    stock = train(mirrored(4), INNERS["adam"])
    skip = train(
        mirrored(4),
        lambda: keras_skip.SkipCorrectionOptimizer(
            INNERS["adam"](), interval=4, warmup_steps=16
        ),
        callbacks=[keras_skip.SkipCorrectionCallback()],
    )
    for a, b in zip(stock.get_weights(), skip.get_weights(), strict=True):
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("inner", sorted(INNERS))
@pytest.mark.parametrize("interval", [1, 5])
def test_one_replica_is_bit_for_bit_the_inner_optimizer(inner, interval):
    import tensorflow as tf

    default = tf.distribute.get_strategy()
    plain = train(default, INNERS[inner])
    skip = train(
        default,
        lambda: keras_skip.SkipCorrectionOptimizer(INNERS[inner](), interval=interval),
    )
    for a, b in zip(plain.get_weights(), skip.get_weights(), strict=True):
        np.testing.assert_array_equal(b, a)
    for a, b in zip(
        plain.optimizer.variables, skip.optimizer.inner_optimizer.variables, strict=True
    ):
        np.testing.assert_array_equal(b.numpy(), a.numpy())


def test_one_replica_mirrored_strategy_is_the_inner_optimizer():
    plain = train(mirrored(1), INNERS["momentum"])
    skip = train(
        mirrored(1),
        lambda: keras_skip.SkipCorrectionOptimizer(INNERS["momentum"](), interval=3),
    )
    for a, b in zip(plain.get_weights(), skip.get_weights(), strict=True):
        np.testing.assert_array_equal(b, a)
