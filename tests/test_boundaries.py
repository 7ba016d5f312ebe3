"""Validation, checkpoints and the model after fit see the averaged model."""

import internals
import keras
import numpy as np
import pytest
import tensorflow as tf
from conftest import components, max_replica_spread, mirrored

import keras_skip

D = 6


def data(n=256, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, D)).astype("float32")
    y = (x @ rng.normal(size=(D, 1))).astype("float32")
    return x, y


def new_model(strategy, steps_per_execution=1, model_class=keras.Sequential, **skip):
    keras.utils.set_random_seed(0)
    with strategy.scope():
        model = model_class(
            [
                keras.Input((D,)),
                keras.layers.Dense(8, activation="tanh"),
                keras.layers.Dense(1),
            ]
        )
        model.compile(
            optimizer=keras_skip.SkipCorrectionOptimizer(
                keras.optimizers.SGD(0.05), **({"interval": 100} | skip)
            ),
            loss="mse",
            steps_per_execution=steps_per_execution,
        )
    return model


class LastStep(keras.callbacks.Callback):
    """Before SkipCorrectionCallback, keeps every replica's weights after each step."""

    def __init__(self):
        super().__init__()
        self.copies = []

    def on_train_batch_end(self, batch, logs=None):
        self.copies.append([components(v) for v in self.model.trainable_variables])


def test_validation_and_epoch_checkpoints_see_the_average(tmp_path):
    x, y = data()
    xv, yv = data(64, seed=1)
    model = new_model(mirrored(4))
    last = LastStep()
    checkpoint = keras.callbacks.ModelCheckpoint(
        str(tmp_path / "e{epoch}.weights.h5"), save_weights_only=True
    )
    history = model.fit(
        x,
        y,
        batch_size=32,
        epochs=2,
        shuffle=False,
        verbose=0,
        validation_data=(xv, yv),
        callbacks=[last, checkpoint, keras_skip.SkipCorrectionCallback()],
    )

    # Interval 100: only boundary averages. The replicas were apart one step
    # before the end; the last step took the boundary average itself.
    def spread(step):
        return max(
            float(np.abs(c - copies[0]).max()) for copies in step for c in copies
        )

    assert spread(last.copies[-2]) > 1e-4
    assert spread(last.copies[-1]) == 0
    average = [np.mean(copies, axis=0) for copies in last.copies[-1]]
    for got, expected in zip(model.get_weights(), average, strict=True):
        np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-7)
    assert max_replica_spread(model.trainable_variables) == 0
    val_loss = model.evaluate(xv, yv, verbose=0)
    assert history.history["val_loss"][-1] == pytest.approx(val_loss, rel=1e-6)
    prediction = model.predict(xv, verbose=0)
    assert float(np.mean((prediction - yv) ** 2)) == pytest.approx(val_loss, rel=1e-5)

    saved = new_model(tf.distribute.get_strategy())
    saved.load_weights(tmp_path / "e2.weights.h5")
    for got, expected in zip(saved.get_weights(), average, strict=True):
        np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-7)
    assert model.optimizer.averages_performed == 2


def test_stopping_in_the_middle_of_an_epoch_leaves_an_averaged_model():
    x, y = data()

    class StopEarly(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if batch == 2:
                self.model.stop_training = True

    model = new_model(mirrored(4))
    model.fit(
        x,
        y,
        batch_size=32,
        epochs=3,
        verbose=0,
        callbacks=[StopEarly(), keras_skip.SkipCorrectionCallback()],
    )
    assert model.optimizer.iterations.numpy() == 3
    assert model.optimizer.averages_performed == 1
    assert max_replica_spread(model.trainable_variables) == 0


def test_dataset_of_unknown_length_still_averages_at_each_epoch():
    x, y = data()
    dataset = (
        tf.data.Dataset.from_tensor_slices((x, y)).filter(lambda a, b: True).batch(32)
    )
    assert dataset.cardinality() == tf.data.UNKNOWN_CARDINALITY

    class AfterEpoch(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.spreads = []

        def on_epoch_end(self, epoch, logs=None):
            self.spreads.append(max_replica_spread(self.model.trainable_variables))

    after_epoch = AfterEpoch()
    model = new_model(mirrored(4))
    model.fit(
        dataset,
        epochs=2,
        verbose=0,
        callbacks=[keras_skip.SkipCorrectionCallback(), after_epoch],
    )
    assert after_epoch.spreads == [0.0, 0.0]
    assert model.optimizer.averages_performed == 2


def flat(variables) -> np.ndarray:
    """Every replica's copy of every variable, in one vector."""
    return np.concatenate([c.ravel() for v in variables for c in components(v)])


@pytest.mark.parametrize("fragments", [1, 2])
def test_data_of_unknown_length_trains_as_data_of_known_length(fragments):
    """The call of the train function that finds the input exhausted (the
    end of an epoch of unknown length) takes no step: before, it counted
    one (its local step and learning rate) without moving the weights, so
    the boundary average scaled the corrections by a learning rates' sum one
    step too long. Interval 3 on epochs of 8 steps leaves 2 steps of each
    epoch to the boundary average."""
    x, y = data()
    known = tf.data.Dataset.from_tensor_slices((x, y)).batch(32)
    unknown = known.filter(lambda a, b: True)
    assert unknown.cardinality() == tf.data.UNKNOWN_CARDINALITY
    states = []
    for dataset in (known, unknown):
        model = new_model(mirrored(4), interval=3, fragments=fragments)
        model.fit(
            dataset,
            epochs=2,
            verbose=0,
            callbacks=[keras_skip.SkipCorrectionCallback()],
        )
        optimizer = model.optimizer
        states.append(
            (
                flat(model.trainable_variables),
                flat(internals.corrections(optimizer)),
                optimizer.averages_performed,
                internals.gamma(optimizer),
            )
        )
    (weights, corrections, averages, gamma), other = states
    np.testing.assert_allclose(other[0], weights, rtol=1e-6, atol=1e-7)
    assert np.abs(corrections).max() > 1e-3
    np.testing.assert_allclose(other[1], corrections, rtol=1e-6, atol=1e-7)
    assert (other[2], other[3]) == (averages, gamma)


def test_steps_per_execution_with_validation():
    x, y = data()
    model = new_model(mirrored(4), steps_per_execution=3, interval=2)
    history = model.fit(
        x,
        y,
        batch_size=32,
        epochs=2,
        verbose=0,
        validation_data=data(64, 1),
        callbacks=[keras_skip.SkipCorrectionCallback()],
    )
    assert model.optimizer.iterations.numpy() == 16
    assert np.isfinite(history.history["val_loss"]).all()
    assert max_replica_spread(model.trainable_variables) == 0


def test_interval_changes_between_steps_without_retracing():
    class CountingModel(keras.Sequential):
        traces = 0

        def train_step(self, data):
            CountingModel.traces += 1
            return super().train_step(data)

    class ChangeInterval(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if batch == 1:
                self.model.optimizer.interval = 3

    x, y = data()
    model = new_model(mirrored(4), model_class=CountingModel, interval=1)
    model.fit(
        x,
        y,
        batch_size=32,
        epochs=1,
        verbose=0,
        callbacks=[ChangeInterval(), keras_skip.SkipCorrectionCallback()],
    )
    traces = CountingModel.traces
    assert traces > 0
    # Steps 0-1 synchronous; then local steps 2-4 (average), 5-7 (average).
    assert model.optimizer.averages_performed == 2
    model.optimizer.interval = 5
    model.fit(
        x,
        y,
        batch_size=32,
        epochs=1,
        verbose=0,
        callbacks=[keras_skip.SkipCorrectionCallback()],
    )
    assert CountingModel.traces == traces
    assert model.optimizer.averages_performed == 4  # step 12, boundary at 15


@pytest.mark.parametrize(
    "interval, in_step, averages",
    [
        # 8 steps per epoch. Interval 3: averages after steps 3 and 6, and the
        # epoch's last step (2 steps into an interval) takes the boundary
        # average inside the train function.
        (3, True, 3),
        # Interval 7: the epoch's last step is the first of an interval (at
        # 1 it would be synchronous), so the average after it is taken by a
        # separate function, as before.
        (7, False, 2),
    ],
)
def test_the_boundary_average_is_taken_by_the_last_step_where_it_can(
    interval, in_step, averages
):
    x, y = data()
    model = new_model(mirrored(2), interval=interval)
    last = LastStep()
    model.fit(
        x,
        y,
        batch_size=32,
        epochs=2,
        verbose=0,
        shuffle=False,
        callbacks=[last, keras_skip.SkipCorrectionCallback()],
    )
    optimizer = model.optimizer
    assert (not internals.separate_average_functions(optimizer)) == in_step
    assert optimizer.averages_performed == 2 * averages
    for epoch in range(2):
        # The last step's weights: identical on both replicas only when the
        # step itself averaged.
        spread = max(np.ptp(c, axis=0).max() for c in last.copies[8 * epoch + 7])
        assert (spread == 0) == in_step
    assert max_replica_spread(model.trainable_variables) == 0.0
    assert optimizer.interval == interval
    assert [int(c) for c in components(internals.interval_variable(optimizer))] == [
        interval
    ] * 2


def test_average_is_callable_eagerly_and_is_a_no_op_when_nothing_is_pending():
    x, y = data()
    model = new_model(mirrored(2), interval=100)
    model.fit(
        x,
        y,
        batch_size=32,
        epochs=1,
        verbose=0,
        callbacks=[keras_skip.SkipCorrectionCallback()],
    )
    optimizer = model.optimizer
    assert optimizer.local_steps_since_average == 0
    assert optimizer.average() is False
    assert optimizer.averages_performed == 1


def test_callback_needs_a_skip_correction_optimizer():
    x, y = data()
    model = keras.Sequential([keras.Input((D,)), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
    with pytest.raises(ValueError, match="SkipCorrectionOptimizer"):
        model.fit(
            x, y, epochs=1, verbose=0, callbacks=[keras_skip.SkipCorrectionCallback()]
        )
