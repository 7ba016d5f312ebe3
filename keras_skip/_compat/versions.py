"""The Keras and TensorFlow releases the workarounds were checked with, and
the warning outside that range."""

from __future__ import annotations

import re

import keras
import tensorflow as tf

CHECKED_KERAS = "3.15.1"
CHECKED_TENSORFLOW = "2.21.0"
#: The oldest releases the workarounds were tested with
#: (tests/test_oldest_versions.py runs the core of the suite with them).
OLDEST_KERAS = "3.12.0"
OLDEST_TENSORFLOW = "2.19.0"


def _minor(version: str) -> tuple[int, int]:
    """``(major, minor)`` of a version string such as ``"3.15.1"`` or
    ``"2.22.0rc1"``."""
    match = re.match(r"(\d+)\.(\d+)", version)
    if match is None:
        raise ValueError(f"Not a version number: {version!r}")
    return int(match.group(1)), int(match.group(2))


def untested_versions(
    keras_version: str | None = None, tensorflow_version: str | None = None
) -> list[str]:
    """The installed Keras and TensorFlow releases outside the tested range
    (compared by minor release), described for a warning; empty if none."""
    found = []
    for name, version, oldest, newest in (
        ("Keras", keras_version or keras.__version__, OLDEST_KERAS, CHECKED_KERAS),
        (
            "TensorFlow",
            tensorflow_version or tf.__version__,
            OLDEST_TENSORFLOW,
            CHECKED_TENSORFLOW,
        ),
    ):
        if not _minor(oldest) <= _minor(version) <= _minor(newest):
            low, high = (".".join(map(str, _minor(v))) for v in (oldest, newest))
            found.append(f"{name} {version} (tested: {low} to {high})")
    return found


def check_versions() -> None:
    """Warns once, naming the versions, when Keras or TensorFlow is outside
    the range keras-skip's workarounds were tested with."""
    untested = untested_versions()
    if untested:
        from keras_skip import _checks

        _checks.warn_at_caller(
            "keras-skip relies on Keras and TensorFlow internals that were "
            f"tested only within its supported range; found {', '.join(untested)}. "
            "Training may fail or give wrong results. Install versions in the "
            "supported range (see the installation docs) or run keras-skip's "
            "test suite against these versions first.",
            RuntimeWarning,
        )
