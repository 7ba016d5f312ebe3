"""Checks that keras-skip can run here, without importing TensorFlow."""

from __future__ import annotations

import importlib.util
import json
import os
import sys

_INSTALL_HINT = (
    "Install TensorFlow with `pip install 'keras-skip[cpu]'` on a machine "
    "without a GPU, or `pip install 'keras-skip[tensorflow]'`; on Colab and "
    "GPU machines the `tensorflow` that is already installed is used."
)


def _configured_backend() -> str:
    """The Keras backend, found the way Keras finds it, without importing it."""
    keras = sys.modules.get("keras")
    if keras is not None and hasattr(keras, "backend"):
        return keras.backend.backend()
    if "KERAS_BACKEND" in os.environ:
        return os.environ["KERAS_BACKEND"]
    keras_home = os.environ.get("KERAS_HOME") or os.path.join(
        os.path.expanduser("~"), ".keras"
    )
    try:
        with open(os.path.join(keras_home, "keras.json")) as f:
            return str(json.load(f).get("backend", "tensorflow"))
    except (OSError, ValueError):
        return "tensorflow"


def check() -> None:
    """Raises ImportError with a fix when TensorFlow or its Keras backend is
    missing."""
    if importlib.util.find_spec("tensorflow") is None:
        raise ImportError(
            "keras-skip needs TensorFlow, which is not installed. " + _INSTALL_HINT
        )
    backend = _configured_backend()
    if backend != "tensorflow":
        raise ImportError(
            f"keras-skip needs the TensorFlow backend of Keras, but the Keras "
            f"backend is {backend!r}. keras-skip builds on tf.distribute, which "
            "only the TensorFlow backend has. Set the environment variable "
            "KERAS_BACKEND=tensorflow before importing keras."
        )
