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
from keras_skip.steering import tf_variable

#: The key, in a Keras weights store, of every replica's copies of the
#: optimizer's variable at `index`.
REPLICAS_KEY = "{index}@replicas"


def per_replica(variables, corrections, slots) -> list[tuple[int, object, bool]]:
    """``(index in variables, tf variable, is_correction)`` for the state
    that differs between replicas: `corrections` (restarted from zero on
    another number of replicas) and `slots` (restarted from their mean)."""
    corrections = {id(tf_variable(c)) for c in corrections}
    differ = corrections | {id(tf_variable(s)) for s in slots}
    state = []
    for i, v in enumerate(variables):
        variable = tf_variable(v)
        if id(variable) in differ:
            state.append((i, variable, id(variable) in corrections))
    return state


def save(store, variables, state, value_of) -> None:
    """Writes the optimizer's `variables` into a Keras weights store
    (`value_of(v)`: the value to save), and every replica's copies of the
    `state` that differs between them."""
    for i, v in enumerate(variables):
        store[str(i)] = value_of(v)
    for i, variable, _ in state:
        store[REPLICAS_KEY.format(index=i)] = read(variable)


def load(store, variables, state, name: str) -> None:
    """Reads what `save` wrote. A store of another configuration (another
    number of variables) is refused with a ValueError naming optimizer
    `name`; state saved on another number of replicas restarts (see
    `write`)."""
    # Keras' weight stores support keys() but neither `in` nor iteration.
    keys = set(store.keys())
    saved = sum(1 for k in keys if k.isdigit())
    if saved == 0:
        return  # saved before the optimizer was built: nothing to restore
    if saved != len(variables):
        raise _other_configuration(
            name, f"it has {len(variables)} variables but the file holds {saved}"
        )
    for i, v in enumerate(variables):
        value = np.asarray(store[str(i)])
        if value.shape != tuple(v.shape):
            raise _other_configuration(
                name,
                f"its variable {i} ('{v.name}') has shape {tuple(v.shape)} but "
                f"the file holds {value.shape}",
            )
        v.assign(value)
    for i, variable, is_correction in state:
        key = REPLICAS_KEY.format(index=i)
        stacked = store[key] if key in keys else np.asarray(store[str(i)])[None]
        write(variable, stacked, is_correction)


def _other_configuration(name: str, difference: str) -> ValueError:
    return ValueError(
        f"Cannot load the state of SkipCorrectionOptimizer '{name}': "
        f"{difference}. Was it saved with another inner or outer optimizer, "
        "other options that keep state (`correction` on or off, "
        "`compression`, `overlap`, `measure_drift`, `fragments`), or before "
        "the optimizer was built? Load it into a SkipCorrectionOptimizer "
        "configured as the one that saved it."
    )


def link(state, owners) -> None:
    """Makes `tf.train.Checkpoint` save every replica's copies too: it saves
    replica 0's copy of a mirrored variable, so a child of each per-replica
    variable carries them all. `owners`: the variables that may own that
    child (Keras or tf variables), among which each of `state`'s is found."""
    by_id = {id(tf_variable(o)): o for o in owners}
    for _, variable, is_correction in state:
        _compat.add_checkpoint_dependency(
            by_id[id(variable)],
            ReplicaValues(variable, is_correction),
            "keras_skip_replicas",
        )


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
