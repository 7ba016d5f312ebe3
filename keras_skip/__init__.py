"""keras-skip: data-parallel Keras training that skips most synchronizations.

Every replica takes local optimizer steps; every ``interval`` steps the
replicas average their weights, and each replica keeps a correction that
cancels its own drift (VRL-SGD / SCAFFOLD). See :class:`SkipCorrectionOptimizer`.

``import keras_skip`` is light: TensorFlow and Keras are imported when a class
is first used (or at once, if Keras is already imported).
"""

from __future__ import annotations

import importlib
import sys

from keras_skip import _environment
from keras_skip._version import __version__

_environment.check()

_LAZY = {
    "SkipCorrectionOptimizer": "keras_skip.optimizer",
    "SkipCorrectionCallback": "keras_skip.callbacks",
    "AdaptiveIntervalCallback": "keras_skip.callbacks",
    "BackupAndRestore": "keras_skip.callbacks",
    "multi_worker_strategy": "keras_skip.multi_worker",
    "apply_keras_fixes": "keras_skip._compat",
    "choose_interval": "keras_skip.adaptive",
}

__all__ = [
    "AdaptiveIntervalCallback",
    "BackupAndRestore",
    "SkipCorrectionCallback",
    "SkipCorrectionOptimizer",
    "__version__",
    "apply_keras_fixes",
    "choose_interval",
    "multi_worker_strategy",
]


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'keras_skip' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_LAZY))


if "keras" in sys.modules:
    # Keras is loaded already, so registering the classes for
    # `keras.models.load_model` costs nothing.
    for _name in _LAZY:
        __getattr__(_name)
