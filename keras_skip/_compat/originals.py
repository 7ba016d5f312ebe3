"""Keras' own trainer functions before any patch, and what every fix asks
first: whether a model trains with keras-skip, whether the strategy spans
workers, whether the fixes are in force."""

from __future__ import annotations

import keras


def _trainer_class():
    from keras.src.backend.tensorflow import trainer

    return trainer.TensorFlowTrainer


def _trainer_module():
    from keras.src.backend.tensorflow import trainer

    return trainer


#: Keras' own methods and functions, as they were before any patch.
_KERAS: dict[str, object] = {}
#: Whether `apply_keras_fixes` extended the trainer fixes to every model.
_GLOBAL_FIXES = False
#: Inside `keras_fixes_removed`: no model or optimizer gets a fix.
_STOCK = False


def _keep_keras_originals() -> None:
    if not _KERAS:
        trainer = _trainer_module()
        _KERAS["_maybe_symbolic_build"] = trainer.TensorFlowTrainer.__dict__[
            "_maybe_symbolic_build"
        ]
        _KERAS["_make_function"] = trainer.TensorFlowTrainer.__dict__["_make_function"]
        _KERAS["reduce_per_replica"] = trainer.reduce_per_replica
        _KERAS["check_finite"] = keras.optimizers.LossScaleOptimizer.__dict__[
            "check_finite"
        ]


def skip_optimizer(optimizer):
    """The SkipCorrectionOptimizer that `optimizer` is or wraps (in the
    LossScaleOptimizer Keras adds under ``mixed_float16``), or None."""
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        optimizer = optimizer.inner_optimizer
    return optimizer if getattr(optimizer, "takes_local_steps", False) else None


def is_multi_worker(strategy) -> bool:
    return _trainer_module()._collective_all_reduce_multi_worker(strategy)
