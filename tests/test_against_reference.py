"""The TensorFlow implementation against the NumPy reference (keras_skip.maths).

A linear model trains with `model.fit` on 4 MirroredStrategy replicas. The
global batch of 4 * B rows is split in order, so replica r sees rows
[r*B, (r+1)*B) of every global batch; the rows of each replica come from a
different linear target, so the replicas drift apart between averages.
"""

import internals
import keras
import numpy as np
import pytest
import tensorflow as tf
from conftest import components, mirrored

import keras_skip
from keras_skip import maths

REPLICAS, B, D = 4, 4, 5
STEPS_PER_EPOCH, EPOCHS = 6, 2
GLOBAL_BATCH = REPLICAS * B
LR = 0.05


def make_data(seed=0):
    rng = np.random.default_rng(seed)
    targets = rng.normal(size=(REPLICAS, D + 1))
    x = rng.normal(size=(STEPS_PER_EPOCH, REPLICAS, B, D))
    y = np.einsum("srbd,rd->srb", x, targets[:, :D]) + targets[:, None, D]
    y += 0.1 * rng.normal(size=y.shape)
    return x, y


def start_weights(seed=1):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(D, 1)) * 0.1, rng.normal(size=(1,)) * 0.1


def grad_fn(x, y):
    def fn(t, params):
        xb, yb = x[t % STEPS_PER_EPOCH], y[t % STEPS_PER_EPOCH]
        residual = np.einsum("rbd,rd->rb", xb, params[:, :D]) + params[:, D:] - yb
        g_kernel = 2 / B * np.einsum("rb,rbd->rd", residual, xb)
        g_bias = 2 / B * residual.sum(axis=1, keepdims=True)
        return np.concatenate([g_kernel, g_bias], axis=1)

    return fn


def linear_model(*extra_layers):
    """The linear model every test of this file trains, from `start_weights`,
    followed by `extra_layers`."""
    kernel, bias = start_weights()
    return keras.Sequential(
        [
            keras.Input((D,)),
            keras.layers.Dense(
                1,
                kernel_initializer=keras.initializers.Constant(kernel),
                bias_initializer=keras.initializers.Constant(bias),
            ),
            *extra_layers,
        ]
    )


def train_keras(
    strategy,
    make_inner,
    *,
    steps_per_execution=1,
    dataset=False,
    callbacks=(),
    make_outer=None,
    **skip,
):
    x, y = make_data()
    with strategy.scope():
        model = linear_model()
        if make_outer is not None:
            skip["outer_optimizer"] = make_outer()
        optimizer = keras_skip.SkipCorrectionOptimizer(make_inner(), **skip)
        model.compile(
            optimizer=optimizer, loss="mse", steps_per_execution=steps_per_execution
        )
    xs = x.reshape(-1, D).astype("float32")
    ys = y.reshape(-1, 1).astype("float32")
    callbacks = [keras_skip.SkipCorrectionCallback(), *callbacks]
    if dataset:
        data = tf.data.Dataset.from_tensor_slices((xs, ys)).batch(GLOBAL_BATCH)
        model.fit(data, epochs=EPOCHS, verbose=0, callbacks=callbacks)
    else:
        model.fit(
            xs,
            ys,
            batch_size=GLOBAL_BATCH,
            epochs=EPOCHS,
            shuffle=False,
            verbose=0,
            callbacks=callbacks,
        )
    return model, optimizer


def reference(inner, learning_rate=LR, **skip):
    x, y = make_data()
    kernel, bias = start_weights()
    x0 = np.concatenate([kernel[:, 0], bias])
    steps = STEPS_PER_EPOCH * EPOCHS
    return maths.simulate(
        x0,
        grad_fn(x, y),
        n=REPLICAS,
        steps=steps,
        learning_rate=learning_rate,
        inner=inner,
        boundaries=range(STEPS_PER_EPOCH, steps + 1, STEPS_PER_EPOCH),
        **skip,
    )


def weights_of(model):
    kernel, bias = model.layers[0].kernel, model.layers[0].bias
    return np.stack(
        [
            np.concatenate([k[:, 0], b])
            for k, b in zip(components(kernel), components(bias), strict=True)
        ]
    )


def corrections_of(optimizer):
    kernel_c, bias_c = internals.corrections(optimizer)[:2]  # the Dense layer's
    return np.stack(
        [
            np.concatenate([k[:, 0], b])
            for k, b in zip(components(kernel_c), components(bias_c), strict=True)
        ]
    )


def assert_relative(actual, expected, tolerance=1e-5):
    error = np.linalg.norm(actual - expected) / max(np.linalg.norm(expected), 1e-12)
    assert error <= tolerance, f"relative error {error:.2e} > {tolerance:.0e}"


INNERS = {
    "sgd": (lambda: keras.optimizers.SGD(LR), maths.sgd),
    "momentum": (
        lambda: keras.optimizers.SGD(LR, momentum=0.9),
        lambda: maths.sgd(0.9),
    ),
}


@pytest.mark.parametrize("interval", [1, 3, 8])
@pytest.mark.parametrize("correction", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("inner", ["sgd", "momentum"])
def test_fit_matches_reference(inner, correction, interval):
    make_keras, make_reference = INNERS[inner]
    model, optimizer = train_keras(
        mirrored(REPLICAS), make_keras, interval=interval, correction=correction
    )
    expected = reference(make_reference(), interval=interval, correction=correction)
    weights = weights_of(model)
    assert_relative(weights, expected.x)
    if correction:
        assert_relative(corrections_of(optimizer), expected.correction)
    assert optimizer.averages_performed == expected.averages
    assert optimizer.local_steps_since_average == expected.local_steps == 0


@pytest.mark.parametrize("policy", ["average", "reset"])
def test_slot_policies_match_reference(policy):
    make_keras, make_reference = INNERS["momentum"]
    model, _ = train_keras(
        mirrored(REPLICAS),
        make_keras,
        interval=4,
        correction=1.0,
        optimizer_state=policy,
    )
    expected = reference(
        make_reference(), interval=4, correction=1.0, optimizer_state=policy
    )
    assert_relative(weights_of(model), expected.x)


def test_adam_local_steps_match_reference():
    model, optimizer = train_keras(
        mirrored(REPLICAS),
        lambda: keras.optimizers.Adam(0.01),
        interval=3,
        correction=1.0,
    )
    expected = reference(maths.adam(), learning_rate=0.01, interval=3, correction=1.0)
    assert_relative(weights_of(model), expected.x)
    assert_relative(corrections_of(optimizer), expected.correction, tolerance=1e-4)


def test_adamw_local_steps_match_reference():
    model, _ = train_keras(
        mirrored(REPLICAS),
        lambda: keras.optimizers.AdamW(0.01, weight_decay=0.1),
        interval=3,
        correction=0.5,
    )
    expected = reference(
        maths.adam(weight_decay=0.1), learning_rate=0.01, interval=3, correction=0.5
    )
    assert_relative(weights_of(model), expected.x)


def test_warmup_then_local_steps_match_reference():
    make_keras, make_reference = INNERS["momentum"]
    model, _ = train_keras(
        mirrored(REPLICAS), make_keras, interval=4, correction=1.0, warmup_steps=5
    )
    expected = reference(make_reference(), interval=4, correction=1.0, warmup_steps=5)
    assert_relative(weights_of(model), expected.x)


def test_gamma_sums_the_scheduled_learning_rate():
    def schedule():
        return keras.optimizers.schedules.ExponentialDecay(
            0.1, decay_steps=2, decay_rate=0.5
        )

    model, _ = train_keras(
        mirrored(REPLICAS),
        lambda: keras.optimizers.SGD(schedule()),
        interval=5,
        correction=1.0,
    )
    expected = reference(
        maths.sgd(),
        learning_rate=lambda t: 0.1 * 0.5 ** (t / 2),
        interval=5,
        correction=1.0,
    )
    assert_relative(weights_of(model), expected.x)


@pytest.mark.parametrize("steps_per_execution", [4, 5])
def test_steps_per_execution_matches_reference(steps_per_execution):
    make_keras, make_reference = INNERS["momentum"]
    model, optimizer = train_keras(
        mirrored(REPLICAS),
        make_keras,
        steps_per_execution=steps_per_execution,
        interval=3,
        correction=1.0,
    )
    expected = reference(make_reference(), interval=3, correction=1.0)
    assert_relative(weights_of(model), expected.x)
    assert optimizer.iterations.numpy() == STEPS_PER_EPOCH * EPOCHS


def test_tf_data_input_matches_reference():
    make_keras, make_reference = INNERS["momentum"]
    model, _ = train_keras(
        mirrored(REPLICAS), make_keras, dataset=True, interval=3, correction=1.0
    )
    expected = reference(make_reference(), interval=3, correction=1.0)
    assert_relative(weights_of(model), expected.x)


def test_two_replicas():
    """Two replicas: the first two data blocks of each global batch."""
    make_keras, _make_reference = INNERS["sgd"]
    x, y = make_data()
    kernel, bias = start_weights()
    strategy = mirrored(2)
    with strategy.scope():
        model = keras.Sequential([keras.Input((D,)), keras.layers.Dense(1)])
        model.layers[0].set_weights([kernel, bias])
        model.compile(
            optimizer=keras_skip.SkipCorrectionOptimizer(make_keras(), interval=4),
            loss="mse",
        )
    xs, ys = x[:, :2].reshape(-1, D), y[:, :2].reshape(-1, 1)
    model.fit(
        xs,
        ys,
        batch_size=2 * B,
        epochs=1,
        shuffle=False,
        verbose=0,
        callbacks=[keras_skip.SkipCorrectionCallback()],
    )

    def grads(t, params):
        return grad_fn(x, y)(t, np.concatenate([params, params]))[:2]

    expected = maths.simulate(
        np.concatenate([kernel[:, 0], bias]),
        grads,
        n=2,
        steps=STEPS_PER_EPOCH,
        learning_rate=LR,
        interval=4,
        correction=1.0,
        boundaries=[STEPS_PER_EPOCH],
    )
    assert_relative(weights_of(model), expected.x)
