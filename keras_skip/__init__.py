"""keras-skip: data-parallel Keras training that skips most synchronizations.

Every replica takes local optimizer steps; every ``interval`` steps the
replicas average their weights, and each replica keeps a correction that
cancels its own drift (VRL-SGD / SCAFFOLD). See :class:`SkipCorrectionOptimizer`.

``import keras_skip`` is light: TensorFlow and Keras are imported when a class
is first used, or when Keras itself is imported.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
from typing import TYPE_CHECKING

from keras_skip import _environment
from keras_skip._version import __version__

if TYPE_CHECKING:  # for type checkers and the API reference; loaded lazily
    from keras_skip._compat import apply_keras_fixes
    from keras_skip.adaptive import choose_interval
    from keras_skip.adaptive_callback import AdaptiveIntervalCallback
    from keras_skip.backup import BackupAndRestore
    from keras_skip.callbacks import SkipCorrectionCallback
    from keras_skip.multi_worker import multi_worker_strategy
    from keras_skip.optimizer import SkipCorrectionOptimizer
    from keras_skip.trace_callback import TraceCallback

_environment.check()

_LAZY = {
    "SkipCorrectionOptimizer": "keras_skip.optimizer",
    "SkipCorrectionCallback": "keras_skip.callbacks",
    "AdaptiveIntervalCallback": "keras_skip.adaptive_callback",
    "BackupAndRestore": "keras_skip.backup",
    "multi_worker_strategy": "keras_skip.multi_worker",
    "apply_keras_fixes": "keras_skip._compat",
    "choose_interval": "keras_skip.adaptive",
    "TraceCallback": "keras_skip.trace_callback",
}

__all__ = [
    "AdaptiveIntervalCallback",
    "BackupAndRestore",
    "SkipCorrectionCallback",
    "SkipCorrectionOptimizer",
    "TraceCallback",
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
    if "keras" in sys.modules:
        _load_all()
    return value


def __dir__():
    return sorted(set(globals()) | set(_LAZY))


def _load_all() -> None:
    for module in dict.fromkeys(_LAZY.values()):
        if module not in sys.modules:  # else it is being imported right now
            importlib.import_module(module)


class _LoadWithKeras(importlib.abc.MetaPathFinder):
    """Loads keras-skip's classes right after Keras itself is imported.

    `keras.models.load_model` finds SkipCorrectionOptimizer only once its
    module has run (it registers the class); without this, `import
    keras_skip; import keras; keras.models.load_model(...)` would fail.
    """

    def find_spec(self, name, path=None, target=None):
        if name != "keras":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec("keras")
        if spec is None or spec.loader is None:
            return spec
        execute = spec.loader.exec_module

        def exec_module(module):
            execute(module)
            # When a keras-skip module imported Keras, it is itself half
            # imported: __getattr__ loads the rest once it is done.
            if not any(
                getattr(getattr(m, "__spec__", None), "_initializing", False)
                for name, m in list(sys.modules.items())
                if name.startswith("keras_skip.")
            ):
                _load_all()

        spec.loader.exec_module = exec_module
        return spec


if "keras" in sys.modules:
    _load_all()  # Keras is loaded already: registering the classes costs nothing.
elif not any(isinstance(f, _LoadWithKeras) for f in sys.meta_path):
    sys.meta_path.insert(0, _LoadWithKeras())
