"""Every callback sees the averaged model at an epoch's end, in any order.

The epoch-boundary average must happen before any callback's `on_epoch_end`,
whatever the position of `SkipCorrectionCallback` in the callbacks list and
whatever ended the epoch: its last step with a known number of steps, the
input running out (a dataset of unknown length), `steps_per_epoch` on a
repeated dataset, or `stop_training` set in the middle of the epoch.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf
from conftest import components, max_replica_spread, mirrored

import keras_skip

D = 5
SAMPLES = 96
BATCH = 16  # 6 steps per epoch, 4 replicas of 4 examples


def data(seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(SAMPLES, D)).astype("float32")
    y = (x @ rng.normal(size=(D, 1)) + rng.normal(size=(SAMPLES, 1))).astype("float32")
    return x, y


def new_model(strategy, interval=4):
    keras.utils.set_random_seed(0)
    with strategy.scope():
        model = keras.Sequential(
            [keras.Input((D,)), keras.layers.Dense(4), keras.layers.Dense(1)]
        )
        model.compile(
            optimizer=keras_skip.SkipCorrectionOptimizer(
                keras.optimizers.SGD(0.05), interval=interval
            ),
            loss="mse",
        )
    return model


class SpreadAtEpochEnd(keras.callbacks.Callback):
    """Records the largest difference between replicas when its
    `on_epoch_end` runs, and the local steps not yet averaged."""

    def __init__(self):
        super().__init__()
        self.spreads = []
        self.pending = []

    def on_epoch_end(self, epoch, logs=None):
        self.spreads.append(max_replica_spread(self.model.trainable_variables))
        self.pending.append(self.model.optimizer.local_steps_since_average)


class StopAfter(keras.callbacks.Callback):
    def __init__(self, batch):
        super().__init__()
        self.batch = batch

    def on_train_batch_end(self, batch, logs=None):
        if batch == self.batch:
            self.model.stop_training = True


def unknown_length():
    x, y = data()
    # `filter` hides the length from Keras: the epoch ends when the data do.
    return tf.data.Dataset.from_tensor_slices((x, y)).filter(lambda *_: True)


INPUTS = {
    "known-length": lambda: (data(), {"batch_size": BATCH}),
    "unknown-length": lambda: ((unknown_length().batch(BATCH),), {}),
    "repeated-steps-per-epoch": lambda: (
        (tf.data.Dataset.from_tensor_slices(data()).repeat().batch(BATCH),),
        {"steps_per_epoch": 5},
    ),
}


@pytest.mark.parametrize("inputs", list(INPUTS), ids=list(INPUTS))
def test_a_callback_listed_first_sees_the_average(inputs):
    arguments, keywords = INPUTS[inputs]()
    model = new_model(mirrored(4))
    first = SpreadAtEpochEnd()
    model.fit(
        *arguments,
        epochs=2,
        shuffle=False,
        verbose=0,
        callbacks=[first, keras_skip.SkipCorrectionCallback()],
        **keywords,
    )
    assert first.pending == [0, 0]
    assert first.spreads == [0.0, 0.0]
    # The replicas had drifted apart: averaging is what made them equal.
    assert model.optimizer.averages_performed >= 2


def test_an_epoch_stopped_early_is_averaged_before_any_callback():
    model = new_model(mirrored(4), interval=100)
    first = SpreadAtEpochEnd()
    model.fit(
        *data(),
        batch_size=BATCH,
        epochs=3,
        shuffle=False,
        verbose=0,
        callbacks=[first, StopAfter(2), keras_skip.SkipCorrectionCallback()],
    )
    assert int(model.optimizer.iterations.numpy()) == 3
    assert first.pending == [0]
    assert first.spreads == [0.0]


def test_checkpoint_and_early_stopping_listed_first_keep_the_averaged_model(
    tmp_path,
):
    dataset = unknown_length().batch(BATCH)
    model = new_model(mirrored(4), interval=100)
    checkpoint = keras.callbacks.ModelCheckpoint(
        str(tmp_path / "e{epoch}.weights.h5"), save_weights_only=True
    )
    stopping = keras.callbacks.EarlyStopping(
        monitor="loss", patience=5, restore_best_weights=True
    )
    record = SpreadAtEpochEnd()
    model.fit(
        dataset,
        epochs=2,
        shuffle=False,
        verbose=0,
        callbacks=[checkpoint, stopping, record, keras_skip.SkipCorrectionCallback()],
    )
    assert record.spreads == [0.0, 0.0]
    saved = new_model(mirrored(4), interval=100)
    saved.load_weights(tmp_path / "e2.weights.h5")
    for a, b in zip(saved.get_weights(), model.get_weights(), strict=True):
        np.testing.assert_array_equal(a, b)
    # EarlyStopping kept the best epoch's weights: averaged ones, equal on
    # every replica.
    assert stopping.best_weights is not None
    assert max_replica_spread(model.trainable_variables) == 0.0
    assert all(
        np.array_equal(copy, components(v)[0])
        for v in model.trainable_variables
        for copy in components(v)
    )
