"""Every error a user can cause names the argument, the value and what is allowed."""

import keras
import numpy as np
import pytest
import tensorflow as tf
from conftest import mirrored

import keras_skip
from keras_skip import SkipCorrectionOptimizer


def sgd():
    return keras.optimizers.SGD(0.1)


@pytest.mark.parametrize(
    "value, error, pattern",
    [
        (0, ValueError, r"`interval` must be an integer >= 1\. Received: interval=0"),
        (-3, ValueError, r"interval=-3"),
        (
            2.5,
            TypeError,
            r"`interval` must be an integer >= 1\. "
            r"Received: interval=2\.5 of type float",
        ),
        (8.0, TypeError, r"interval=8\.0"),
        ("8", TypeError, r"interval='8' of type str"),
        (True, TypeError, r"interval=True of type bool"),
        (None, TypeError, r"interval=None"),
    ],
)
def test_bad_interval(value, error, pattern):
    with pytest.raises(error, match=pattern):
        SkipCorrectionOptimizer(sgd(), interval=value)


def test_numpy_integers_are_accepted():
    assert SkipCorrectionOptimizer(sgd(), interval=np.int64(4)).interval == 4


@pytest.mark.parametrize(
    "value, error, pattern",
    [
        (
            -0.1,
            ValueError,
            r"`correction` must be in \[0, 1\].*Received: correction=-0\.1",
        ),
        (1.5, ValueError, r"correction=1\.5"),
        (float("nan"), ValueError, r"correction=nan"),
        (
            "1",
            TypeError,
            r"`correction` must be a number in \[0, 1\]\. Received: correction='1'",
        ),
        (True, TypeError, r"correction=True of type bool"),
    ],
)
def test_bad_correction(value, error, pattern):
    with pytest.raises(error, match=pattern):
        SkipCorrectionOptimizer(sgd(), correction=value)


def test_bad_optimizer_state():
    with pytest.raises(
        ValueError,
        match=r"`optimizer_state` must be one of 'local', 'average', "
        r"'average_second_moments', 'reset'\. "
        r"Received: optimizer_state='global'",
    ):
        SkipCorrectionOptimizer(sgd(), optimizer_state="global")


@pytest.mark.parametrize("value", [-1, 1.5])
def test_bad_warmup_steps(value):
    with pytest.raises(
        (ValueError, TypeError),
        match=rf"`warmup_steps` must be an integer >= 0\. "
        rf"Received: warmup_steps={value}",
    ):
        SkipCorrectionOptimizer(sgd(), warmup_steps=value)


@pytest.mark.parametrize("inner", ["sgd", keras.optimizers.SGD, None, 0.1])
def test_inner_must_be_a_keras_optimizer(inner):
    with pytest.raises(
        TypeError,
        match=r"`inner_optimizer` must be a keras\.optimizers\.Optimizer "
        r"instance.*Received: inner_optimizer=",
    ):
        SkipCorrectionOptimizer(inner)


def test_wrapper_cannot_wrap_itself():
    with pytest.raises(ValueError, match="already a SkipCorrectionOptimizer"):
        SkipCorrectionOptimizer(SkipCorrectionOptimizer(sgd()))


def test_loss_scale_optimizer_as_outer_optimizer_is_rejected():
    with pytest.raises(
        TypeError,
        match=r"`outer_optimizer` must not be a LossScaleOptimizer: loss scaling "
        r"belongs around.*Received: outer_optimizer=",
    ):
        SkipCorrectionOptimizer(
            sgd(), outer_optimizer=keras.optimizers.LossScaleOptimizer(sgd())
        )


def test_built_loss_scale_optimizer_inside_is_rejected():
    inner = keras.optimizers.LossScaleOptimizer(sgd())
    inner.build([keras.Variable(1.0)])
    with pytest.raises(ValueError, match="passed as `inner_optimizer` has already"):
        SkipCorrectionOptimizer(inner)


def test_gradient_accumulation_is_rejected():
    inner = keras.optimizers.SGD(0.1, gradient_accumulation_steps=4)
    with pytest.raises(
        ValueError,
        match=r"gradient_accumulation_steps.*Received: gradient_accumulation_steps=4",
    ):
        SkipCorrectionOptimizer(inner)


def test_ema_is_rejected():
    with pytest.raises(ValueError, match=r"use_ema.*Received: use_ema=True"):
        SkipCorrectionOptimizer(keras.optimizers.Adam(use_ema=True))


@pytest.mark.parametrize(
    "key", ["learning_rate", "clipnorm", "weight_decay", "use_ema"]
)
def test_base_optimizer_arguments_belong_on_the_inner_optimizer(key):
    with pytest.raises(
        ValueError, match=rf"does not take `{key}`; set it on the inner optimizer"
    ):
        SkipCorrectionOptimizer(sgd(), **{key: 0.1})


def test_unknown_arguments():
    with pytest.raises(TypeError, match="unexpected arguments: period"):
        SkipCorrectionOptimizer(sgd(), period=4)


def test_interval_setter_validates():
    optimizer = SkipCorrectionOptimizer(sgd())
    with pytest.raises(ValueError, match="interval=0"):
        optimizer.interval = 0
    with pytest.raises(TypeError, match=r"interval=1\.5"):
        optimizer.interval = 1.5
    optimizer.interval = 3
    assert optimizer.interval == 3


def test_attach_needs_a_model():
    with pytest.raises(
        TypeError, match=r"`model` must be a keras\.Model\. Received: model="
    ):
        SkipCorrectionOptimizer(sgd()).attach("model")


def test_inner_optimizer_already_built_is_rejected():
    inner = sgd()
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    inner.build(model.trainable_variables)
    optimizer = SkipCorrectionOptimizer(inner)
    with pytest.raises(ValueError, match="already been built"):
        optimizer.build(model.trainable_variables)


def test_optimizer_created_outside_the_strategy_scope_is_rejected():
    strategy = mirrored(2)
    optimizer = SkipCorrectionOptimizer(sgd())
    with strategy.scope():
        model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
        with pytest.raises(ValueError, match=r"inside `strategy.scope\(\)`"):
            optimizer.build(model.trainable_variables)


def test_apply_in_cross_replica_context_is_rejected():
    strategy = mirrored(2)
    with strategy.scope():
        model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
        optimizer = SkipCorrectionOptimizer(sgd())
        optimizer.build(model.trainable_variables)
        grads = [tf.zeros_like(v) for v in model.trainable_variables]
        with pytest.raises(RuntimeError, match=r"replica context.*strategy\.run"):
            optimizer.apply_gradients(
                zip(grads, model.trainable_variables, strict=True)
            )


def test_public_names():
    assert set(keras_skip.__all__) >= {
        "SkipCorrectionOptimizer",
        "SkipCorrectionCallback",
    }
    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        keras_skip.Nope  # noqa: B018


def test_unknown_arguments_list_every_allowed_argument():
    with pytest.raises(TypeError) as raised:
        SkipCorrectionOptimizer(sgd(), period=4)
    allowed = str(raised.value).split("Allowed: ")[1].rstrip(".").split(", ")
    import inspect

    parameters = inspect.signature(SkipCorrectionOptimizer.__init__).parameters
    assert set(allowed) == set(parameters) - {"self", "kwargs"}


class ApplyOverride(keras.optimizers.SGD):
    """An optimizer whose own `apply` would be bypassed by local steps."""

    def apply(self, grads, trainable_variables=None):
        return super().apply(grads, trainable_variables)


class GradientsOverride(keras.optimizers.SGD):
    def _backend_apply_gradients(self, grads, trainable_variables):
        return super()._backend_apply_gradients(grads, trainable_variables)


@pytest.mark.parametrize(
    "inner, method",
    [
        (ApplyOverride(0.1), "apply"),
        (GradientsOverride(0.1), "_backend_apply_gradients"),
    ],
)
def test_optimizers_overriding_what_the_wrapper_replaces_are_refused(inner, method):
    with pytest.raises(
        TypeError, match=rf"overrides `{method}`.*would silently not run"
    ):
        SkipCorrectionOptimizer(inner)
    with pytest.raises(TypeError, match=rf"`outer_optimizer` overrides `{method}`"):
        SkipCorrectionOptimizer(sgd(), outer_optimizer=type(inner)(0.1))


@pytest.mark.skipif(
    not hasattr(keras.optimizers, "MultiOptimizer"), reason="keras 3.15 and newer"
)
def test_multi_optimizer_is_refused_naming_it():
    multi = keras.optimizers.MultiOptimizer(sgd())
    with pytest.raises(
        TypeError, match=r"must implement `update_step`.*MultiOptimizer"
    ):
        SkipCorrectionOptimizer(multi)


@pytest.mark.skipif(
    not hasattr(keras.optimizers, "ScheduleFreeAdamW"), reason="keras 3.14 and newer"
)
@pytest.mark.parametrize("policy", ["local", "reset"])
def test_schedule_free_needs_averaged_state(policy):
    with pytest.raises(
        ValueError, match=rf"ScheduleFreeAdamW.*optimizer_state='average'.*{policy!r}"
    ):
        SkipCorrectionOptimizer(
            keras.optimizers.ScheduleFreeAdamW(), optimizer_state=policy
        )
    assert SkipCorrectionOptimizer(
        keras.optimizers.ScheduleFreeAdamW(), optimizer_state="average"
    )


class WeightStart(keras.optimizers.Optimizer):
    """A user optimizer whose state starts from the weights."""

    def build(self, variables):
        super().build(variables)
        self.anchors = [
            self.add_variable_from_reference(v, name="anchor") for v in variables
        ]
        for anchor, v in zip(self.anchors, variables, strict=True):
            anchor.assign(v)

    def update_step(self, gradient, variable, learning_rate):
        variable.assign_sub(learning_rate * gradient)


def test_reset_of_state_that_does_not_start_from_a_constant_is_refused():
    strategy = mirrored(2)  # one replica never resets
    with strategy.scope():
        optimizer = SkipCorrectionOptimizer(
            WeightStart(learning_rate=0.1), optimizer_state="reset"
        )
        variable = keras.Variable(np.arange(3.0, dtype="float32"))
        with pytest.raises(
            ValueError, match=r"WeightStart's variable '.*anchor.*' does"
        ):
            optimizer.build([variable])


def test_load_mismatch_names_every_option_that_keeps_state(tmp_path):
    def model(**options):
        keras.utils.set_random_seed(0)
        m = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
        m.compile(optimizer=SkipCorrectionOptimizer(sgd(), **options), loss="mse")
        m.optimizer.build(m.trainable_variables)
        return m

    model(compression="bfloat16").save_weights(tmp_path / "w.weights.h5")
    with pytest.raises(ValueError, match=r"`compression`, `overlap`, `measure_drift`"):
        model().load_weights(tmp_path / "w.weights.h5")


def test_reset_needs_the_optimizer_built_eagerly():
    strategy = mirrored(2)
    with strategy.scope():
        variable = keras.Variable(np.ones(3, dtype="float32"))
        optimizer = SkipCorrectionOptimizer(
            keras.optimizers.SGD(0.1, momentum=0.9), optimizer_state="reset"
        )

    @tf.function
    def build():
        optimizer.build([variable])

    with (
        strategy.scope(),
        pytest.raises(ValueError, match=r"built, which must happen eagerly"),
    ):
        build()


def test_steering_before_build_and_outside_a_hold_says_what_to_do():
    optimizer = SkipCorrectionOptimizer(keras.optimizers.SGD(0.1), interval=4)
    steering = optimizer.steering
    assert steering.strategy is tf.distribute.get_strategy()  # known unbuilt
    for call in (steering.counters, lambda: steering.hold(3), steering.release):
        with pytest.raises(RuntimeError, match=r"once the optimizer is built.*build"):
            call()
    optimizer.build([keras.Variable([1.0])])
    with pytest.raises(RuntimeError, match=r"only while the interval is held"):
        steering.interval_outside_hold = 5
    assert optimizer.interval == 4 and not steering.held
