"""The checks and rewrites of `SkipCorrectionOptimizer`'s arguments that need
Keras, in the constructor and when it is built: each message names the
argument, the value and what is allowed."""

from __future__ import annotations

import numbers

import keras

from keras_skip import _checks, _compat, maths


def replicas_per_group(group_size, strategy) -> int:
    """Resolves `group_size` against the replicas of this worker."""
    if group_size is None:
        return 1
    try:
        local = len(strategy.extended.worker_devices)
    except RuntimeError:  # the default strategy: one replica
        local = 1
    if group_size == "worker":
        return local
    if local % group_size:
        raise ValueError(
            "`group_size` must divide the number of replicas on each worker "
            f"({local} here), so that no group spans two workers. "
            f"Received: group_size={group_size!r}"
        )
    return group_size


def loss_scaling_around(cls, loss_scale, *args, **kwargs):
    """`SkipCorrectionOptimizer(LossScaleOptimizer(opt), ...)` rebuilt as
    `LossScaleOptimizer(SkipCorrectionOptimizer(opt, ...))`: the scaled
    gradients must be unscaled, checked and agreed on before any step or
    average, which is what the outer position does (see `_compat`)."""
    if loss_scale.built:
        raise ValueError(
            "The LossScaleOptimizer passed as `inner_optimizer` has already "
            "been built on variables. Pass a new, unused one (or the plain "
            "optimizer)."
        )
    skip = cls(loss_scale.inner_optimizer, *args, **kwargs)
    return keras.optimizers.LossScaleOptimizer(
        skip,
        initial_scale=loss_scale.initial_scale,
        dynamic_growth_steps=loss_scale.dynamic_growth_steps,
        name=loss_scale.name,
    )


def check_correction(value) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(
            "`correction` must be a number in [0, 1]. "
            f"Received: correction={value!r} of type {type(value).__name__}"
        )
    if not 0.0 <= float(value) <= 1.0:
        raise ValueError(
            "`correction` must be in [0, 1] (0 = plain local SGD). "
            f"Received: correction={value!r}"
        )
    return float(value)


def check_slot_policy(inner, optimizer_state) -> None:
    """Refuses an unknown slot policy, and those that would break an
    optimizer whose state holds a weight-like sequence (ScheduleFreeAdamW's
    `momentum` is its `z` sequence, from which the weights are interpolated):
    kept local it would never be averaged, and reset it would be zero."""
    if optimizer_state not in maths.OPTIMIZER_STATE_POLICIES:
        raise ValueError(
            "`optimizer_state` must be one of "
            f"{', '.join(repr(p) for p in maths.OPTIMIZER_STATE_POLICIES)}. "
            f"Received: optimizer_state={optimizer_state!r}"
        )
    schedule_free = getattr(keras.optimizers, "ScheduleFreeAdamW", ())  # keras 3.14+
    if isinstance(inner, schedule_free) and optimizer_state != "average":
        raise ValueError(
            "ScheduleFreeAdamW keeps a weight-like sequence in its state, "
            "which an average must include: pass optimizer_state='average'. "
            f"Received: optimizer_state={optimizer_state!r}"
        )


def check_compression(compression) -> str | None:
    if compression is not None and compression not in maths.COMPRESSIONS:
        raise ValueError(
            "`compression` must be None, "
            f"{' or '.join(repr(c) for c in maths.COMPRESSIONS)}. "
            f"Received: compression={compression!r}"
        )
    return compression


#: What the replicas show at an epoch's end (`keras_skip._boundary`).
BOUNDARIES = ("full", "latest")


def check_boundary(boundary) -> str:
    if not isinstance(boundary, str) or boundary not in BOUNDARIES:
        raise ValueError(
            f"`boundary` must be {' or '.join(repr(b) for b in BOUNDARIES)}. "
            f"Received: boundary={boundary!r}"
        )
    return boundary


def check_model(model) -> None:
    if not isinstance(model, keras.Model):
        raise TypeError(
            "`model` must be a keras.Model. Received: "
            f"model={model!r} of type {type(model).__name__}"
        )


def check_shows_latest(boundary: str) -> None:
    if boundary != "latest":
        raise ValueError(
            "show_latest_averages() needs SkipCorrectionOptimizer("
            f"boundary='latest'). Received: boundary={boundary!r}"
        )


def from_config(cls, config, custom_objects=None):
    """`SkipCorrectionOptimizer.from_config`: the wrapped optimizers
    deserialized."""
    config = dict(config)
    inner = keras.saving.deserialize_keras_object(
        config.pop("inner_optimizer"), custom_objects=custom_objects
    )
    outer = config.pop("outer_optimizer", None)
    if outer is not None:
        outer = keras.saving.deserialize_keras_object(
            outer, custom_objects=custom_objects
        )
    return cls(inner, outer_optimizer=outer, **config)


def check_overlap(overlap) -> int:
    """The local steps an interval average's all-reduce may run beside: 0
    (False), 1 (True: the step it is due after) or more (delayed)."""
    if isinstance(overlap, bool):
        return int(overlap)
    if not isinstance(overlap, int):
        raise TypeError(
            "`overlap` must be True, False or an integer >= 0 (local steps). "
            f"Received: overlap={overlap!r} of type {type(overlap).__name__}"
        )
    if overlap < 0:
        raise ValueError(
            "`overlap` must be True, False or an integer >= 0 (local steps). "
            f"Received: overlap={overlap!r}"
        )
    return overlap


def check_fragments(fragments, interval: int) -> int:
    """`fragments` as an integer >= 1 that `interval` can cover."""
    fragments = _checks.integer("fragments", fragments, minimum=1)
    check_interval_covers(interval, fragments)
    return fragments


def check_interval_covers(interval: int, fragments: int) -> None:
    """Refuses an interval that cannot average each fragment once."""
    if 1 < interval < fragments:
        raise ValueError(
            f"`interval` must be 1 (synchronous steps) or at least `fragments` "
            f"({fragments}): every fragment is averaged once per interval. "
            f"Received: interval={interval}"
        )


def config_of(optimizer) -> dict:
    """`SkipCorrectionOptimizer.get_config`: its arguments, the wrapped
    optimizers serialized."""
    outer = optimizer.outer_optimizer
    return {
        "name": optimizer.name,
        "inner_optimizer": keras.saving.serialize_keras_object(
            optimizer.inner_optimizer
        ),
        "interval": optimizer.interval,
        "correction": optimizer.correction,
        "optimizer_state": optimizer.optimizer_state,
        "warmup_steps": optimizer.warmup_steps,
        "measure_drift": optimizer.measure_drift,
        "compression": optimizer.compression,
        "group_size": optimizer.group_size,
        "overlap": optimizer.overlap,
        "fragments": optimizer.fragments,
        "boundary": optimizer.boundary,
        "outer_optimizer": (
            None if outer is None else keras.saving.serialize_keras_object(outer)
        ),
    }


def check_group_size(group_size) -> int | str | None:
    if group_size is None or group_size == "worker":
        return group_size
    if isinstance(group_size, str):
        raise ValueError(
            "`group_size` must be None, an integer >= 1 or "
            f"'worker'. Received: group_size={group_size!r}"
        )
    return _checks.integer("group_size", group_size, minimum=1)


def check_outer_optimizer(outer, inner, wrapper: type) -> None:
    if outer is None:
        return
    check_wrapped_optimizer(outer, wrapper, "outer_optimizer")
    if outer is inner:
        raise ValueError(
            "`outer_optimizer` must be another optimizer instance than "
            "`inner_optimizer`: they keep different state. Received "
            "the same object for both."
        )


def check_wrapped_optimizer(
    inner, wrapper: type, label: str = "inner_optimizer"
) -> None:
    """Refuses what cannot be wrapped by `wrapper` (SkipCorrectionOptimizer)
    as `label`, saying why and what to pass instead."""
    _check_optimizer_kind(inner, wrapper, label)
    _check_update_hooks(inner, label)
    _check_options(inner, label)


def _check_optimizer_kind(inner, wrapper: type, label: str) -> None:
    """Refuses what is not a plain Keras optimizer: a SkipCorrectionOptimizer,
    anything else than a `keras.optimizers.Optimizer`, a LossScaleOptimizer."""
    if isinstance(inner, wrapper):
        raise ValueError(
            f"`{label}` is already a SkipCorrectionOptimizer; wrapping "
            "it again would nest two averaging schedules. Wrap the plain "
            "optimizer once."
        )
    if not isinstance(inner, keras.optimizers.Optimizer):
        raise TypeError(
            f"`{label}` must be a keras.optimizers.Optimizer instance, "
            f"such as keras.optimizers.SGD(0.01). Received: {label}="
            f"{inner!r} of type {type(inner).__name__}"
        )
    if isinstance(inner, keras.optimizers.LossScaleOptimizer):
        raise TypeError(
            f"`{label}` must not be a LossScaleOptimizer: loss scaling belongs "
            "around the steps that use the scaled gradients. Pass the plain "
            "optimizer, and wrap the SkipCorrectionOptimizer instead "
            "(`keras.optimizers.LossScaleOptimizer(SkipCorrectionOptimizer(...))`"
            ", which `model.compile` does itself under mixed_float16)."
            f" Received: {label}={inner!r}"
        )


def _check_update_hooks(inner, label: str) -> None:
    """Refuses an optimizer whose update would not run: one that overrides a
    method SkipCorrectionOptimizer replaces, or has no `update_step`."""
    implements_update = (
        type(inner).update_step is not keras.optimizers.Optimizer.update_step
    )
    replaced = _compat.replaced_overrides(inner)
    if replaced and implements_update:
        raise TypeError(
            f"`{label}` overrides {', '.join(f'`{m}`' for m in replaced)}, "
            "which SkipCorrectionOptimizer replaces with its own local steps "
            "and averages, so the override would silently not run. Received: "
            f"{label}={inner!r} of type {type(inner).__name__}. Move the "
            "logic into `update_step`, `_backend_update_step` or "
            "`_apply_weight_decay`, which are kept."
        )
    if not implements_update:
        raise TypeError(
            f"`{label}` must implement `update_step`, as every "
            "optimizer in keras.optimizers does; wrappers that override "
            f"`apply` instead (such as {type(inner).__name__}) cannot be "
            "wrapped."
        )


def _check_options(inner, label: str) -> None:
    """Refuses the base options that cannot work with local steps:
    gradient accumulation and a moving average of the weights."""
    if inner.gradient_accumulation_steps:
        raise ValueError(
            f"SkipCorrectionOptimizer does not support an `{label}` with "
            "`gradient_accumulation_steps` (Keras accumulates under a "
            "replica-context condition that deadlocks under tf.distribute). "
            "Received: gradient_accumulation_steps="
            f"{inner.gradient_accumulation_steps!r}; use a larger batch or a "
            "larger `interval` instead."
        )
    if inner.use_ema:
        raise ValueError(
            f"SkipCorrectionOptimizer does not support an `{label}` with "
            "`use_ema=True` (each replica's moving average would drift on its "
            "own). Received: use_ema=True; keep the moving average outside, "
            "for example with a callback on the averaged model."
        )


BASE_ARGUMENTS = (
    "learning_rate",
    "weight_decay",
    "clipnorm",
    "clipvalue",
    "global_clipnorm",
    "use_ema",
    "ema_momentum",
    "ema_overwrite_frequency",
    "loss_scale_factor",
    "gradient_accumulation_steps",
)


def check_building_in(wrapper, inner, outer, strategy) -> None:
    """The optimizers are built where they were created, and the wrapped
    ones are new."""
    wrapped = [(inner, "inner_optimizer")]
    if outer is not None:
        wrapped.append((outer, "outer_optimizer"))
    for owner, label in [(wrapper, "SkipCorrectionOptimizer"), *wrapped]:
        if _compat.creation_strategy(owner) is not strategy:
            raise ValueError(
                f"The {label} was created outside the distribution "
                "strategy it is built in. Create the model, the inner "
                "optimizer and the SkipCorrectionOptimizer inside "
                "`strategy.scope()`."
            )
    for owner, label in wrapped:
        if owner.built:
            raise ValueError(
                f"The {label.replace('_', ' ')} has already been built on "
                "variables, possibly by another model. Pass a new, unused "
                "optimizer instance to SkipCorrectionOptimizer."
            )


def not_attached(replicas: int) -> RuntimeError:
    """The error of a step on several replicas without the callback."""
    return RuntimeError(
        f"SkipCorrectionOptimizer is training on {replicas} replicas but no "
        "keras_skip.SkipCorrectionCallback is in use. Pass it to fit: "
        "`model.fit(..., callbacks=[keras_skip.SkipCorrectionCallback()])` "
        "(AdaptiveIntervalCallback includes it). It averages the "
        "replicas at each epoch boundary, so that validation, "
        "checkpoints and the model after fit see the averaged model. "
        "In a custom training loop, call `optimizer.attach(model)` "
        "once before training and `optimizer.average()` before "
        "evaluating or saving."
    )


def reject_base_arguments(kwargs) -> None:
    for key in kwargs:
        if key in BASE_ARGUMENTS:
            raise ValueError(
                f"SkipCorrectionOptimizer does not take `{key}`; set it on "
                f"the inner optimizer instead. Received: {key}={kwargs[key]!r}"
            )
    if kwargs:
        raise TypeError(
            "SkipCorrectionOptimizer got unexpected arguments: "
            f"{', '.join(sorted(kwargs))}. Allowed: inner_optimizer, interval, "
            "correction, optimizer_state, warmup_steps, outer_optimizer, "
            "compression, measure_drift, group_size, overlap, fragments, boundary, "
            "name."
        )
