"""Saving every replica's own copy of per-replica state.

Between averages, corrections and (under ``optimizer_state="local"``) the inner
optimizer's slots differ between replicas. Keras and TensorFlow save a
mirrored variable by reading replica 0's copy, which would lose the others;
these helpers read and write all of this worker's copies. State saved on one
number of replicas and loaded on another cannot be mapped replica to replica:
corrections restart from zero (they sum to zero across replicas) and slots
from their mean.
"""

from __future__ import annotations

import warnings

import numpy as np
import tensorflow as tf

from keras_skip import _compat


def components(variable) -> list:
    """This worker's copies of a tf variable (one if it is not distributed)."""
    return _compat.local_copies(variable)


def read(variable) -> np.ndarray:
    """This worker's copies, stacked: shape ``(local_replicas, *shape)``."""
    return np.stack([np.asarray(c.numpy()) for c in components(variable)])


def write(variable, stacked, is_correction: bool) -> bool:
    """Assigns stacked copies; returns False (after a warning) if the number
    of copies differs, in which case corrections become zero and slots their
    mean."""
    stacked = np.asarray(stacked)
    copies = components(variable)
    if stacked.shape[0] == len(copies):
        for copy, value in zip(copies, stacked, strict=True):
            copy.assign(value)
        return True
    value = np.zeros_like(stacked[0]) if is_correction else stacked.mean(axis=0)
    for copy in copies:
        copy.assign(value)
    warnings.warn(
        f"SkipCorrectionOptimizer state saved on {stacked.shape[0]} replicas was "
        f"loaded on {len(copies)}: corrections restart from zero and optimizer "
        "slots from their mean over the saved replicas.",
        stacklevel=3,
    )
    return False


class ReplicaValues(_compat.Trackable):
    """A checkpoint dependency holding every replica's copy of one variable.

    Attached as a child of the variable it covers, so `tf.train.Checkpoint`
    restores it after the variable itself (which writes replica 0's copy to
    every replica) and the per-replica values win.
    """

    def __init__(self, variable, is_correction: bool):
        self._variable = variable
        self._is_correction = is_correction

    def _serialize_to_tensors(self):
        return {
            "values": tf.stack([c.read_value() for c in components(self._variable)])
        }

    def _restore_from_tensors(self, restored_tensors):
        write(self._variable, restored_tensors["values"].numpy(), self._is_correction)
