"""Argument checks whose messages name the argument, the value and what is allowed."""

from __future__ import annotations

import math
import numbers
import os
import sys
import warnings


def integer(name: str, value, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(
            f"`{name}` must be an integer >= {minimum}. "
            f"Received: {name}={value!r} of type {type(value).__name__}"
        )
    if value < minimum:
        raise ValueError(
            f"`{name}` must be an integer >= {minimum}. Received: {name}={value!r}"
        )
    return int(value)


def number(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(
            f"`{name}` must be a number. "
            f"Received: {name}={value!r} of type {type(value).__name__}"
        )
    return float(value)


def positive(name: str, value) -> float:
    value_ = number(name, value)
    if not math.isfinite(value_) or value_ <= 0:
        raise ValueError(f"`{name}` must be a number > 0. Received: {name}={value!r}")
    return value_


def share(name: str, value) -> float:
    value_ = number(name, value)
    if not 0 <= value_ <= 1:
        raise ValueError(
            f"`{name}` must be a share in [0, 1]. Received: {name}={value!r}"
        )
    return value_


def boolean(name: str, value) -> bool:
    if not isinstance(value, bool):
        raise TypeError(
            f"`{name}` must be True or False. "
            f"Received: {name}={value!r} of type {type(value).__name__}"
        )
    return bool(value)


#: Packages whose frames a warning skips to reach the user's code.
_INTERNAL = ("keras_skip", "keras", "tensorflow", "absl")


def warn_at_caller(message: str, category: type[Warning] = UserWarning) -> None:
    """Warns with the location of the first caller outside keras-skip, Keras
    and TensorFlow (usually the user's `fit` call), wherever the warning is
    raised from."""
    roots = []
    for name in _INTERNAL:
        module = sys.modules.get(name)
        if module is not None and getattr(module, "__file__", None):
            roots.append(os.path.dirname(os.path.abspath(module.__file__)) + os.sep)
    frame = sys._getframe(1)
    level = 2
    while frame is not None and frame.f_code.co_filename.startswith(tuple(roots)):
        frame = frame.f_back
        level += 1
    warnings.warn(message, category, stacklevel=level)
