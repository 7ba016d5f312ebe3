"""Variables without a gradient never move, whatever the options.

Keras passes `apply` only the variables that have a gradient: a weight a
layer creates but does not use, or the weights of a layer frozen after
`compile` (and recompiled). Averages, the outer step, compression, overlap,
the slot policies and groups must leave these exactly as they are, on every
replica, as stock Keras does; a layer unfrozen later trains again.
"""

import keras
import numpy as np
import pytest
from conftest import components, max_replica_spread, mirrored

import keras_skip

D = 4


class WithUnusedWeight(keras.layers.Layer):
    """A dense layer with a weight `call` never reads (no gradient)."""

    def build(self, input_shape):
        self.kernel = self.add_weight(shape=(input_shape[-1], 3), name="kernel")
        self.unused = self.add_weight(shape=(3,), initializer="ones", name="unused")

    def call(self, x):
        return keras.ops.tanh(x @ self.kernel)


def data(n=128, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, D)).astype("float32")
    y = (x @ rng.normal(size=(D, 1)) + rng.normal(size=(n, 1))).astype("float32")
    return x, y


OPTIONS = {
    "plain": {},
    "outer": {"outer_optimizer": "outer"},
    "outer-compression-overlap": {
        "outer_optimizer": "outer",
        "compression": "bfloat16",
        "overlap": True,
    },
    "slots-average-groups": {"optimizer_state": "average", "group_size": 2},
    "slots-reset-drift-warmup": {
        "optimizer_state": "reset",
        "measure_drift": True,
        "warmup_steps": 3,
    },
}


def skip_optimizer(options):
    options = dict(options)
    if options.get("outer_optimizer") == "outer":
        # Momentum and weight decay: a variable given a zero pseudo-gradient
        # would still move with either.
        options["outer_optimizer"] = keras.optimizers.SGD(
            0.8, momentum=0.9, nesterov=True, weight_decay=0.1
        )
    return keras_skip.SkipCorrectionOptimizer(
        keras.optimizers.SGD(0.05, momentum=0.5), interval=3, **options
    )


def build(strategy, options):
    keras.utils.set_random_seed(0)
    with strategy.scope():
        frozen = keras.layers.Dense(5, activation="tanh", name="frozen")
        model = keras.Sequential(
            [
                keras.Input((D,)),
                frozen,
                WithUnusedWeight(name="unused"),
                keras.layers.Dense(1, name="head"),
            ]
        )
        optimizer = skip_optimizer(options)
        model.compile(optimizer=optimizer, loss="mse")
    return model, frozen, optimizer


def recompile(strategy, model, optimizer):
    with strategy.scope():
        model.compile(optimizer=optimizer, loss="mse")


def fit(model, epochs=1, **kwargs):
    x, y = data()
    model.fit(
        x,
        y,
        batch_size=16,
        epochs=epochs,
        shuffle=False,
        verbose=0,
        callbacks=[keras_skip.SkipCorrectionCallback()],
        **kwargs,
    )


def copies(variables):
    return [components(v) for v in variables]


def assert_unchanged(before, variables, what):
    for old, v in zip(before, variables, strict=True):
        for replica, (a, b) in enumerate(zip(old, components(v), strict=True)):
            np.testing.assert_array_equal(
                b, a, err_msg=f"{what} {v.path} moved on replica {replica}"
            )


@pytest.mark.parametrize("options", list(OPTIONS.values()), ids=list(OPTIONS))
def test_variables_without_gradient_never_move(options):
    strategy = mirrored(4)
    model, frozen, optimizer = build(strategy, options)
    unused = model.get_layer("unused").unused
    fit(model)  # everything else trains
    assert optimizer.averages_performed >= 2
    np.testing.assert_array_equal(components(unused), np.ones((4, 3)))

    # Frozen after a first fit, with the same optimizer: its layer keeps its
    # weights exactly, on every replica, while the rest trains on.
    frozen.trainable = False
    recompile(strategy, model, optimizer)
    before = copies(frozen.weights)
    head = components(model.get_layer("head").kernel)
    averages = optimizer.averages_performed
    fit(model)
    assert optimizer.averages_performed >= averages + 2
    assert_unchanged(before, frozen.weights, "frozen")
    np.testing.assert_array_equal(components(unused), np.ones((4, 3)))
    assert not np.allclose(components(model.get_layer("head").kernel), head)

    # Unfrozen again: it trains, and the replicas end identical.
    frozen.trainable = True
    recompile(strategy, model, optimizer)
    fit(model)
    assert not np.allclose(components(frozen.kernel)[0], before[0][0])
    np.testing.assert_array_equal(components(unused), np.ones((4, 3)))
    assert max_replica_spread(model.weights) == 0.0


def test_outer_step_of_a_frozen_layer_matches_stock_keras():
    """The outer optimizer's momentum from a first fit does not carry a layer
    frozen before a second fit, as a stock optimizer's would not."""
    strategy = mirrored(2)
    model, frozen, optimizer = build(strategy, {"outer_optimizer": "outer"})
    fit(model)
    momentum = [
        v
        for v in optimizer.outer_optimizer.variables
        if "momentum" in v.path and "frozen" in v.path
    ]
    assert momentum and np.abs(components(momentum[0])[0]).max() > 0
    frozen.trainable = False
    recompile(strategy, model, optimizer)
    before = copies(frozen.weights)
    fit(model)
    assert_unchanged(before, frozen.weights, "frozen")
