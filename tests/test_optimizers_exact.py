"""Every Keras optimizer, wrapped, trains exactly like the stock optimizer.

What this pins:

* Each built-in optimizer in `keras.optimizers` that has an `update_step`, with
  its common options (momentum, nesterov, amsgrad, centered, weight decay,
  `clipnorm`, `global_clipnorm`, `clipvalue`, a learning-rate schedule) and
  user subclasses that override the documented hooks, wrapped in
  `SkipCorrectionOptimizer`:

  - on one replica, at any interval, trains like the stock optimizer: there
    is nobody to average with, so every local step must be the optimizer's
    own step, hooks included;
  - at `interval=1` on several replicas, trains like stock synchronous
    training under the same `MirroredStrategy`, every replica's copy of
    every weight and optimizer variable.

  Keras optimizers are more than `update_step`: `Nadam` updates a scalar in
  `_backend_update_step` once per step, `Muon` decays its matrices and its
  other weights at different rates in `_apply_weight_decay`, and clipping
  happens in `_clip_gradients`. A wrapper that calls `update_step` alone
  silently trains another optimizer (Nadam divides by zero).

* The outer optimizer (`outer_optimizer=`) is a Keras optimizer too: its step
  on the pseudo-gradient `start - average` must be the stock optimizer's
  `apply` on that gradient, hooks and clipping included, or the configuration
  must be refused when the wrapper is created.

* Optimizers the wrapper cannot run step by step (those that do their work
  in `apply` or `_backend_apply_gradients`) are refused when the wrapper is
  created, with a message naming them.

Tolerances: the wrapped and the stock optimizer run the same float32
operations on the same values, so they agree to a few units in the last place
at most (an implementation may fuse or reorder a sum); `rtol=1e-6,
atol=1e-6` is a few float32 ulps at the weights' scale (about 1) after six
steps, far below what any option under test changes (the clip thresholds are
checked to clip; decays and schedules change the weights by 1e-3 or more).
"""

import keras
import numpy as np
import pytest
import tensorflow as tf
from conftest import components, mirrored
from keras import ops, optimizers

import keras_skip

D_IN, HIDDEN, D_OUT = 5, 4, 3
BATCH = 8
STEPS = 6
RTOL = ATOL = 1e-6


def data(samples=STEPS * BATCH, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(samples, D_IN)).astype("float32")
    # Large targets: gradient norms of a few units, above the clip thresholds.
    y = (3.0 * np.tanh(x @ rng.normal(size=(D_IN, D_OUT)))).astype("float32")
    return x, y


BIAS = keras.initializers.RandomNormal(stddev=0.5)


def build_model(seed=7):
    """Two Dense layers: 2-D kernels (Muon's matrix path, Adafactor's factored
    moments) and 1-D biases (their other path), nonzero so that their weight
    decay matters."""
    keras.utils.set_random_seed(seed)
    return keras.Sequential(
        [
            keras.Input((D_IN,)),
            keras.layers.Dense(HIDDEN, activation="tanh", bias_initializer=BIAS),
            keras.layers.Dense(D_OUT, bias_initializer=BIAS),
        ]
    )


# User subclasses ------------------------------------------------------------------


@keras.saving.register_keras_serializable(package="test_optimizers_exact")
class GlobalAdagradMomentum(optimizers.Optimizer):
    """A user optimizer written as the `optimizers.Optimizer` docstring
    asks: `build` makes a momentum slot per weight and one scalar state (the
    sum of squared gradients over all weights and steps), `update_step` uses
    both, `get_config` saves the hyperparameter."""

    def __init__(self, learning_rate=0.05, momentum=0.8, **kwargs):
        super().__init__(learning_rate=learning_rate, **kwargs)
        self.momentum = momentum

    def build(self, variables):
        if self.built:
            return
        super().build(variables)
        self._velocities = [
            self.add_variable_from_reference(v, name="velocity") for v in variables
        ]
        self._accumulator = self.add_variable(
            (), initializer="ones", dtype="float32", name="accumulator"
        )

    def update_step(self, gradient, variable, learning_rate):
        lr = ops.cast(learning_rate, variable.dtype)
        gradient = ops.cast(gradient, variable.dtype)
        self.assign_add(self._accumulator, ops.sum(ops.square(gradient)))
        velocity = self._velocities[self._get_variable_index(variable)]
        self.assign(velocity, self.momentum * velocity + gradient)
        scale = lr / ops.sqrt(ops.cast(self._accumulator, variable.dtype))
        self.assign_sub(variable, scale * velocity)

    def get_config(self):
        config = super().get_config()
        config["momentum"] = self.momentum
        return config


@keras.saving.register_keras_serializable(package="test_optimizers_exact")
class BiasCorrectedMomentum(GlobalAdagradMomentum):
    """Overrides `_backend_update_step`, as `Nadam` does, to update a scalar
    once per step before the per-weight updates: `beta_power = momentum**t`,
    the bias correction of an exponential average. Skipping the hook leaves
    it at 1 and divides by zero."""

    def build(self, variables):
        if self.built:
            return
        super().build(variables)
        self._beta_power = self.add_variable(
            (), initializer="ones", dtype="float32", name="beta_power"
        )

    def _backend_update_step(self, grads, trainable_variables, learning_rate):
        self.assign(self._beta_power, self._beta_power * self.momentum)
        super()._backend_update_step(grads, trainable_variables, learning_rate)

    def update_step(self, gradient, variable, learning_rate):
        lr = ops.cast(learning_rate, variable.dtype)
        gradient = ops.cast(gradient, variable.dtype)
        velocity = self._velocities[self._get_variable_index(variable)]
        self.assign(
            velocity, self.momentum * velocity + (1.0 - self.momentum) * gradient
        )
        correction = 1.0 - ops.cast(self._beta_power, variable.dtype)
        self.assign_sub(variable, lr * velocity / correction)


@keras.saving.register_keras_serializable(package="test_optimizers_exact")
class MatrixDecay(GlobalAdagradMomentum):
    """Overrides `_apply_weight_decay`, as `Muon` does: matrices decay at
    `weight_decay`, every other weight at `vector_decay`."""

    def __init__(self, vector_decay=0.0, **kwargs):
        super().__init__(**kwargs)
        self.vector_decay = vector_decay

    def _apply_weight_decay(self, variables):
        for variable in variables:
            rate = self.weight_decay if len(variable.shape) == 2 else self.vector_decay
            if not rate:
                continue
            lr = ops.cast(self.learning_rate, variable.dtype)
            variable.assign(variable - variable * ops.cast(rate, variable.dtype) * lr)

    def get_config(self):
        config = super().get_config()
        config["vector_decay"] = self.vector_decay
        return config


# The cases ------------------------------------------------------------------------


def _adamw_without_bias_decay():
    optimizer = optimizers.AdamW(0.02, weight_decay=0.2)
    optimizer.exclude_from_weight_decay(var_names=["bias"])
    return optimizer


CASES = {
    "SGD-momentum-nesterov-weight_decay": lambda: optimizers.SGD(
        0.05, momentum=0.9, nesterov=True, weight_decay=0.3
    ),
    "SGD-clipnorm": lambda: optimizers.SGD(0.1, clipnorm=0.2),
    "Adam-amsgrad": lambda: optimizers.Adam(0.02, beta_2=0.5, amsgrad=True),
    "AdamW-exclude_bias": _adamw_without_bias_decay,
    "Adamax-clipvalue": lambda: optimizers.Adamax(0.02, clipvalue=0.05),
    "Adagrad-schedule": lambda: optimizers.Adagrad(
        optimizers.schedules.ExponentialDecay(0.2, decay_steps=2, decay_rate=0.5)
    ),
    "Adadelta": lambda: optimizers.Adadelta(1.0),
    "RMSprop-centered-momentum-clipnorm": lambda: optimizers.RMSprop(
        0.01, momentum=0.5, centered=True, clipnorm=0.3
    ),
    "Nadam": lambda: optimizers.Nadam(0.01),
    "Ftrl-l1-l2-shrinkage": lambda: optimizers.Ftrl(
        0.2,
        l1_regularization_strength=0.01,
        l2_regularization_strength=0.01,
        l2_shrinkage_regularization_strength=0.01,
        beta=0.1,
    ),
    "Lion-weight_decay": lambda: optimizers.Lion(0.005, weight_decay=0.5),
    "Lamb-global_clipnorm": lambda: optimizers.Lamb(0.02, global_clipnorm=0.5),
    "Adafactor": lambda: optimizers.Adafactor(0.05),
    "Muon-weight_decays": lambda: optimizers.Muon(
        0.02, weight_decay=0.1, adam_weight_decay=0.9
    ),
    "ScheduleFreeAdamW-warmup-weight_decay": lambda: optimizers.ScheduleFreeAdamW(
        0.02, warmup_steps=2, weight_decay=1.0
    ),
    "user-subclass": lambda: GlobalAdagradMomentum(0.1, clipvalue=0.5),
    "user-_backend_update_step": lambda: BiasCorrectedMomentum(0.05),
    "user-_apply_weight_decay": lambda: MatrixDecay(
        learning_rate=0.1, weight_decay=0.2, vector_decay=0.6
    ),
}


# ScheduleFreeAdamW's `momentum` slot is its `z` sequence, weight-like: the
# averages must include it.
WRAPPER_OPTIONS = {
    "ScheduleFreeAdamW-warmup-weight_decay": {"optimizer_state": "average"},
}


def wrap(case, **options):
    return keras_skip.SkipCorrectionOptimizer(
        CASES[case](), **WRAPPER_OPTIONS.get(case, {}), **options
    )


def test_every_builtin_optimizer_with_an_update_step_has_a_case():
    builtins = {
        name
        for name in dir(optimizers)
        if isinstance(getattr(optimizers, name), type)
        and issubclass(getattr(optimizers, name), optimizers.Optimizer)
        and getattr(optimizers, name).update_step
        is not optimizers.Optimizer.update_step
    }
    covered = {type(make()).__name__ for make in CASES.values()}
    assert builtins <= covered, f"no case for {sorted(builtins - covered)}"


# Training -------------------------------------------------------------------------


def train(strategy, make_optimizer, steps=STEPS, callbacks=()):
    x, y = data(steps * BATCH)
    with strategy.scope():
        model = build_model()
        model.compile(optimizer=make_optimizer(), loss="mse")
    model.fit(
        x,
        y,
        batch_size=BATCH,
        epochs=1,
        shuffle=False,
        verbose=0,
        callbacks=list(callbacks),
    )
    return model


def stock_optimizer(model):
    optimizer = model.optimizer
    if isinstance(optimizer, keras_skip.SkipCorrectionOptimizer):
        return optimizer.inner_optimizer
    return optimizer


def _finite(array) -> bool:
    return bool(np.isfinite(array).all())


def _assert_close(what, expected, actual):
    reference = components(expected)[0]
    assert _finite(reference), f"stock {what} is not finite"
    for replica, copy in enumerate(components(actual)):
        assert _finite(copy), f"{what} on replica {replica} is not finite: {copy}"
        np.testing.assert_allclose(
            copy, reference, rtol=RTOL, atol=ATOL, err_msg=f"{what}, replica {replica}"
        )


def _names(variables):
    return [v.path.split("/")[-1] for v in variables]


def assert_trains_alike(expected, actual):
    """Every replica's copy of every weight, then of every optimizer
    variable, agrees with the stock run."""
    for a, b in zip(expected.weights, actual.weights, strict=True):
        _assert_close(f"weight {a.path}", a, b)
    expected_state = stock_optimizer(expected).variables
    actual_state = stock_optimizer(actual).variables
    assert len(actual_state) == len(expected_state), (
        f"optimizer variables {_names(actual_state)}, stock {_names(expected_state)}"
    )
    for a, b in zip(expected_state, actual_state, strict=True):
        _assert_close(f"optimizer variable {a.path}", a, b)


@pytest.mark.parametrize("case", list(CASES))
def test_one_replica_trains_like_the_stock_optimizer(case):
    """Six steps under the default strategy: two warm-up steps (synchronous,
    as at `interval=1`), a period of `interval=3` local steps ending in an
    (empty) interval average, and one more local step ending in `fit`'s
    boundary average."""
    strategy = tf.distribute.get_strategy()
    stock = train(strategy, CASES[case])
    wrapped = train(strategy, lambda: wrap(case, interval=3, warmup_steps=2))
    assert_trains_alike(stock, wrapped)
    assert wrapped.optimizer.synchronous_steps == 2
    assert wrapped.optimizer.averages_performed == 2


REPLICAS = 2


# What differs on several replicas is the distributed machinery, not an
# optimizer's arithmetic (which the one-replica test pins for every case): the
# all-reduce, clipping each replica's share before it (stock Keras clips per
# replica), the base weight decay's merge call, hooks run in replica context
# (`Nadam._backend_update_step`, `Muon._apply_weight_decay`), mirrored scalar
# state, a schedule read from the shared iteration count, slots initialised
# from the weights (ScheduleFreeAdamW) and state Keras keeps in plain
# variables (Adafactor). These cases cover each once, within the time budget.
SEVERAL_REPLICA_CASES = [
    "SGD-momentum-nesterov-weight_decay",
    "SGD-clipnorm",
    "Lamb-global_clipnorm",
    "Adagrad-schedule",
    "Nadam",
    "Muon-weight_decays",
    "ScheduleFreeAdamW-warmup-weight_decay",
    "Adafactor",
    "user-_backend_update_step",
    "user-_apply_weight_decay",
]


@pytest.mark.parametrize("case", SEVERAL_REPLICA_CASES)
def test_interval_1_on_several_replicas_is_stock_synchronous_training(case):
    stock = train(mirrored(REPLICAS), CASES[case])
    wrapped = train(
        mirrored(REPLICAS),
        lambda: wrap(case, interval=1),
        callbacks=[keras_skip.SkipCorrectionCallback()],
    )
    assert_trains_alike(stock, wrapped)
    assert wrapped.optimizer.averages_performed == 0
    assert wrapped.optimizer.synchronous_steps == STEPS


# Guards on the cases ----------------------------------------------------------------


def _first_batch_gradients(replicas):
    """Replica 0's gradient of the first batch at the initial weights, as
    stock Keras clips it: the loss of the replica's share of the batch,
    scaled by `1 / replicas`."""
    x, y = data()
    share = BATCH // replicas
    model = build_model()
    with tf.GradientTape() as tape:
        loss = ops.mean(ops.square(model(x[:share]) - y[:share])) / replicas
    return [g.numpy() for g in tape.gradient(loss, model.trainable_variables)]


def _clipping_is_active(optimizer, gradients):
    if optimizer.clipnorm:
        return max(np.linalg.norm(g) for g in gradients) > optimizer.clipnorm
    if optimizer.global_clipnorm:
        norm = np.sqrt(sum(np.sum(g**2) for g in gradients))
        return norm > optimizer.global_clipnorm
    return max(np.abs(g).max() for g in gradients) > optimizer.clipvalue


@pytest.mark.parametrize("replicas", [1, REPLICAS], ids=lambda n: f"replicas{n}")
def test_clip_thresholds_are_below_the_gradients(replicas):
    """Each clipping option clips already at the first step, on one replica
    and on each of several (where stock Keras clips every replica's share
    before the all-reduce), so a wrapper ignoring it fails the tests above."""
    gradients = _first_batch_gradients(replicas)
    clipping = {
        case: optimizer
        for case, optimizer in ((case, make()) for case, make in CASES.items())
        if optimizer.clipnorm or optimizer.global_clipnorm or optimizer.clipvalue
    }
    assert len(clipping) >= 3
    for case, optimizer in clipping.items():
        assert _clipping_is_active(optimizer, gradients), case


# The outer optimizer ----------------------------------------------------------------

PERIOD = 3  # local steps between two averages
PERIODS = 2
INNER_LR = 0.05


def outer_expected(make_outer):
    """Weights and outer optimizer after `PERIODS` periods on one replica,
    computed with stock Keras: each period, stock SGD takes `PERIOD` steps
    from the period's start (the average of one replica is its own weights),
    then the stock outer optimizer's `apply` moves the start with the
    pseudo-gradient `start - average`."""
    x, y = data(PERIOD * PERIODS * BATCH)
    model = build_model()
    model.compile(optimizer=optimizers.SGD(INNER_LR), loss="mse")
    outer = make_outer()
    starts = [keras.Variable(w) for w in model.get_weights()]
    pseudo_gradients = []
    for period in range(PERIODS):
        model.set_weights([s.numpy() for s in starts])
        rows = slice(period * PERIOD * BATCH, (period + 1) * PERIOD * BATCH)
        model.fit(x[rows], y[rows], batch_size=BATCH, shuffle=False, verbose=0)
        gradient = [
            s.numpy() - w for s, w in zip(starts, model.get_weights(), strict=True)
        ]
        pseudo_gradients.append(gradient)
        outer.apply(gradient, starts)
    return [s.numpy() for s in starts], outer, pseudo_gradients


def assert_outer_matches_stock(make_outer):
    expected, stock_outer, pseudo_gradients = outer_expected(make_outer)
    model = train(
        tf.distribute.get_strategy(),
        lambda: keras_skip.SkipCorrectionOptimizer(
            optimizers.SGD(INNER_LR),
            interval=PERIOD,
            outer_optimizer=make_outer(),
        ),
        steps=PERIOD * PERIODS,
    )
    for variable, e in zip(model.weights, expected, strict=True):
        w = variable.numpy()
        what = f"weight {variable.path} after {PERIODS} outer steps"
        assert _finite(w), f"{what} is not finite: {w}"
        np.testing.assert_allclose(w, e, rtol=RTOL, atol=ATOL, err_msg=what)
    outer = model.optimizer.outer_optimizer
    assert int(outer.iterations.numpy()) == PERIODS
    assert len(outer.variables) == len(stock_outer.variables), (
        f"outer optimizer variables {_names(outer.variables)}, "
        f"stock {_names(stock_outer.variables)}"
    )
    for a, b in zip(stock_outer.variables, outer.variables, strict=True):
        _assert_close(f"outer optimizer variable {a.path}", a, b)
    return pseudo_gradients


OUTER_LR = 0.7
CLIPPED_OUTERS = {
    "clipnorm": lambda: optimizers.SGD(OUTER_LR, clipnorm=0.05),
    "global_clipnorm": lambda: optimizers.SGD(OUTER_LR, global_clipnorm=0.1),
    "clipvalue": lambda: optimizers.SGD(OUTER_LR, clipvalue=0.01),
}


@pytest.mark.parametrize("option", list(CLIPPED_OUTERS))
def test_outer_optimizer_clipping_is_honoured_or_refused(option):
    """Either the outer step clips the pseudo-gradient exactly as the stock
    optimizer's `apply` does (`clipnorm` per weight, `global_clipnorm` over
    all of them), or the wrapper refuses the outer optimizer when created,
    naming `outer_optimizer` and the option."""
    make_outer = CLIPPED_OUTERS[option]

    def create():
        return keras_skip.SkipCorrectionOptimizer(
            optimizers.SGD(INNER_LR),
            interval=PERIOD,
            outer_optimizer=make_outer(),
        )

    try:
        create()
    except (ValueError, TypeError):
        with pytest.raises(
            (ValueError, TypeError),
            match=rf"(?s)(outer_optimizer.*{option}|{option}.*outer_optimizer)",
        ):
            create()
        return
    pseudo_gradients = assert_outer_matches_stock(make_outer)
    assert all(
        _clipping_is_active(make_outer(), gradient) for gradient in pseudo_gradients
    ), "the clip threshold is above the pseudo-gradients: the test tests nothing"


@pytest.mark.parametrize(
    "make_outer",
    [
        lambda: optimizers.SGD(OUTER_LR),
        lambda: optimizers.SGD(OUTER_LR, momentum=0.9, nesterov=True, weight_decay=0.3),
        lambda: optimizers.Nadam(0.05),
        lambda: BiasCorrectedMomentum(0.5),
    ],
    ids=["SGD", "SGD-nesterov-weight_decay", "Nadam", "user-_backend_update_step"],
)
def test_outer_optimizer_step_is_the_stock_optimizer_apply(make_outer):
    """Two periods, so that the outer optimizer's state (momentum, Nadam's
    per-step product) carries from the first outer step into the second.
    Plain SGD checks the expected values themselves."""
    assert_outer_matches_stock(make_outer)


# Optimizers the wrapper cannot run ----------------------------------------------------


class AdamWithNoisyApply(optimizers.Adam):
    """Inherits Adam's `update_step` but replaces `apply`, which the wrapper
    never calls: it would silently train plain Adam."""

    def apply(self, grads, trainable_variables=None):
        grads = [g + keras.random.normal(ops.shape(g), stddev=0.01) for g in grads]
        return super().apply(grads, trainable_variables)


class AdamWithOwnApplyGradients(optimizers.Adam):
    """Inherits Adam's `update_step` but replaces `_backend_apply_gradients`,
    where Keras runs clipping, weight decay and the step."""

    def _backend_apply_gradients(self, grads, trainable_variables):
        grads = [g * 0.5 for g in grads]
        return super()._backend_apply_gradients(grads, trainable_variables)


def _multi_optimizer():
    return optimizers.MultiOptimizer(
        optimizers.OptimizerMap(default_optimizer=optimizers.SGD(0.1))
    )


UNSUPPORTED = {
    "MultiOptimizer": (_multi_optimizer, "MultiOptimizer"),
    "subclass-overriding-apply": (AdamWithNoisyApply, "`apply`"),
    "subclass-overriding-_backend_apply_gradients": (
        AdamWithOwnApplyGradients,
        "`_backend_apply_gradients`",
    ),
}


@pytest.mark.parametrize("role", ["inner_optimizer", "outer_optimizer"])
@pytest.mark.parametrize("case", list(UNSUPPORTED))
def test_optimizers_that_replace_apply_are_refused(case, role):
    """The wrapper runs an optimizer's `update_step` and its hooks, never its
    `apply`: an optimizer that does its work in `apply` (or in
    `_backend_apply_gradients`) would silently not run as written. The
    message names the argument, the optimizer's type and what it overrides."""
    make, what = UNSUPPORTED[case]
    optimizer = make()
    arguments = {"inner_optimizer": optimizers.SGD(0.1), role: optimizer}
    with pytest.raises((TypeError, ValueError)) as refused:
        keras_skip.SkipCorrectionOptimizer(**arguments)
    message = str(refused.value)
    assert f"`{role}`" in message
    assert type(optimizer).__name__ in message
    assert what in message


@pytest.mark.parametrize(
    "option, pattern",
    [
        ({"gradient_accumulation_steps": 2}, "gradient_accumulation_steps"),
        ({"use_ema": True}, "use_ema"),
    ],
    ids=["gradient_accumulation_steps", "use_ema"],
)
def test_outer_optimizer_options_the_wrapper_cannot_run_are_refused(option, pattern):
    with pytest.raises(ValueError, match=rf"(?s)`outer_optimizer`.*{pattern}"):
        keras_skip.SkipCorrectionOptimizer(
            optimizers.SGD(0.1),
            outer_optimizer=optimizers.SGD(0.1, **option),
        )
