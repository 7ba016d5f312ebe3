"""Mixed precision: mixed_float16 with loss scaling, and mixed_bfloat16."""

from typing import ClassVar

import internals
import keras
import numpy as np
import pytest
import tensorflow as tf
from conftest import components, max_replica_spread, mirrored

import keras_skip
from keras_skip import _compat

D, SAMPLES, BATCH = 8, 256, 32  # 8 steps per epoch


class Overflow(keras.layers.Layer):
    """Multiplies replica `replica`'s activations by inf while `armed[0]`."""

    armed: ClassVar[list[bool]] = [False]

    def __init__(self, replica=1, **kwargs):
        super().__init__(**kwargs)
        self.replica = replica

    def compute_output_shape(self, input_shape):
        return input_shape

    def call(self, x):
        context = tf.distribute.get_replica_context()
        if context is None:
            return x
        replica = context.replica_id_in_sync_group

        def factor(rid):
            poisoned = Overflow.armed[0] and int(rid) == self.replica
            return np.float32(np.inf if poisoned else 1.0)

        scale = tf.numpy_function(factor, [replica], tf.float32)
        scale.set_shape(())
        return x * tf.cast(scale, x.dtype)


class ArmAt(keras.callbacks.Callback):
    """Arms the overflow for one step (a 0-based step of the first epoch)."""

    def __init__(self, step):
        super().__init__()
        self.step = step

    def on_train_batch_begin(self, batch, logs=None):
        Overflow.armed[0] = batch == self.step

    def on_train_end(self, logs=None):
        Overflow.armed[0] = False


@pytest.fixture
def policy(request):
    keras.mixed_precision.set_global_policy(request.param)
    yield request.param
    keras.mixed_precision.set_global_policy("float32")


def data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(SAMPLES, D)).astype("float32")
    return x, (x[:, :2] @ np.array([[2.0], [-1.0]])).astype("float32")


def new_model(strategy, interval=3, loss_scale_inside=False):
    keras.utils.set_random_seed(0)
    with strategy.scope():
        model = keras.Sequential(
            [
                keras.Input((D,)),
                keras.layers.Dense(16, activation="tanh"),
                Overflow(),
                keras.layers.Dense(1, dtype="float32"),
            ]
        )
        inner = keras.optimizers.SGD(0.05, momentum=0.5)
        if loss_scale_inside:
            inner = keras.optimizers.LossScaleOptimizer(inner)
        model.compile(
            optimizer=keras_skip.SkipCorrectionOptimizer(inner, interval=interval),
            loss="mse",
        )
    return model


def fit(model, epochs=2, callbacks=()):
    x, y = data()
    return model.fit(
        x,
        y,
        batch_size=BATCH,
        epochs=epochs,
        shuffle=False,
        verbose=0,
        callbacks=[keras_skip.SkipCorrectionCallback(), *callbacks],
    )


def skip_state_dtypes(optimizer):
    state = [
        c.value for c in internals.corrections(optimizer)
    ] + internals.slot_variables(optimizer)
    return {tf.as_dtype(v.dtype).name for v in state}


@pytest.mark.parametrize("policy", ["mixed_float16"], indirect=True)
def test_mixed_float16_wraps_in_loss_scaling_and_trains(policy):
    model = new_model(mirrored(2))
    history = fit(model)
    outer = model.optimizer
    assert isinstance(outer, keras.optimizers.LossScaleOptimizer)
    optimizer = outer.inner_optimizer
    assert isinstance(optimizer, keras_skip.SkipCorrectionOptimizer)
    assert optimizer.averages_performed == 2 * 3  # 2 + a boundary per epoch
    # Computation in float16; weights, corrections and slots in float32.
    assert model.layers[0].compute_dtype == "float16"
    assert {w.dtype for w in model.weights} == {"float32"}
    assert skip_state_dtypes(optimizer) == {"float32"}
    loss = history.history["loss"]
    assert np.isfinite(loss).all() and loss[1] < loss[0]
    assert max_replica_spread(model.weights) == 0.0


@pytest.mark.parametrize("policy", ["mixed_float16"], indirect=True)
def test_an_overflow_on_one_replica_skips_the_step_on_every_replica(policy):
    model = new_model(mirrored(2), interval=4)
    scale = None

    class Scale(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            nonlocal scale
            if batch == 1:
                scale = float(model.optimizer.dynamic_scale.numpy())

    fit(model, epochs=1, callbacks=[ArmAt(2), Scale()])
    optimizer = model.optimizer.inner_optimizer
    # Step 2 overflowed on replica 1 only: no replica took it.
    assert int(optimizer.iterations.numpy()) == SAMPLES // BATCH - 1
    assert float(model.optimizer.dynamic_scale.numpy()) == scale / 2
    weights = [components(w) for w in model.trainable_weights]
    assert all(np.isfinite(c).all() for copies in weights for c in copies)
    assert max_replica_spread(model.trainable_weights) == 0.0


def test_loss_scale_optimizer_inside_is_moved_around():
    given = keras.optimizers.LossScaleOptimizer(
        keras.optimizers.SGD(0.05), initial_scale=256.0, dynamic_growth_steps=7
    )
    optimizer = keras_skip.SkipCorrectionOptimizer(given, interval=3, correction=0.5)
    assert isinstance(optimizer, keras.optimizers.LossScaleOptimizer)
    skip = optimizer.inner_optimizer
    assert isinstance(skip, keras_skip.SkipCorrectionOptimizer)
    assert skip.inner_optimizer is given.inner_optimizer
    assert (skip.interval, skip.correction) == (3, 0.5)
    assert (optimizer.initial_scale, optimizer.dynamic_growth_steps) == (256.0, 7)
    assert optimizer.name == given.name
    restored = keras.optimizers.deserialize(keras.optimizers.serialize(optimizer))
    assert isinstance(restored.inner_optimizer, keras_skip.SkipCorrectionOptimizer)
    assert (restored.inner_optimizer.interval, restored.initial_scale) == (3, 256.0)


@pytest.mark.parametrize("policy", ["mixed_float16"], indirect=True)
def test_loss_scale_optimizer_inside_trains_as_the_one_keras_adds(policy):
    inside = new_model(mirrored(2), interval=4, loss_scale_inside=True)
    # compile kept it: one LossScaleOptimizer, around the wrapper.
    assert isinstance(inside.optimizer, keras.optimizers.LossScaleOptimizer)
    assert isinstance(
        inside.optimizer.inner_optimizer, keras_skip.SkipCorrectionOptimizer
    )
    fit(inside, epochs=1, callbacks=[ArmAt(2)])
    around = new_model(mirrored(2), interval=4)
    fit(around, epochs=1, callbacks=[ArmAt(2)])
    steps = int(inside.optimizer.iterations.numpy())
    assert steps == int(around.optimizer.iterations.numpy()) == SAMPLES // BATCH - 1
    for a, b in zip(inside.get_weights(), around.get_weights(), strict=True):
        np.testing.assert_array_equal(a, b)
    assert float(inside.optimizer.dynamic_scale.numpy()) == float(
        around.optimizer.dynamic_scale.numpy()
    )


@pytest.mark.parametrize("policy", ["mixed_float16"], indirect=True)
def test_stock_keras_takes_the_overflow_verdict_from_replica_0(policy):
    """Pins the upstream behaviour the loss-scale patch corrects."""
    model = new_model(mirrored(2), interval=4)
    with _compat.keras_fixes_removed():
        fit(model, epochs=1, callbacks=[ArmAt(2)])
    # Replica 0's verdict let step 2 through: replica 1 applied its overflow,
    # the average after step 3 spread it, and every later step overflowed.
    optimizer = model.optimizer.inner_optimizer
    assert int(optimizer.iterations.numpy()) == 4
    kernel = components(model.trainable_weights[0])
    assert not np.isfinite(kernel[0]).any() and not np.isfinite(kernel[1]).any()


@pytest.mark.parametrize("policy", ["mixed_bfloat16"], indirect=True)
def test_mixed_bfloat16_trains_close_to_float32(policy):
    model = new_model(mirrored(2))
    history = fit(model)
    optimizer = model.optimizer
    assert isinstance(optimizer, keras_skip.SkipCorrectionOptimizer)
    assert model.layers[0].compute_dtype == "bfloat16"
    assert {w.dtype for w in model.weights} == {"float32"}
    assert skip_state_dtypes(optimizer) == {"float32"}
    keras.mixed_precision.set_global_policy("float32")
    reference = new_model(mirrored(2))
    expected = fit(reference)
    np.testing.assert_allclose(
        history.history["loss"], expected.history["loss"], rtol=0.05
    )
    for w, r in zip(model.get_weights(), reference.get_weights(), strict=True):
        np.testing.assert_allclose(w, r, atol=0.02)
