"""Workarounds for Keras and TensorFlow behaviour that keras-skip depends on.

Each workaround names the releases it was checked against and has a test in
``tests/test_compat.py`` that fails when an upstream release changes the
behaviour it patches, so that it can be removed or updated.

Checked with keras 3.15.1 and tensorflow 2.21.0.
"""

from __future__ import annotations

import keras
import tensorflow as tf

CHECKED_KERAS = "3.15.1"
CHECKED_TENSORFLOW = "2.21.0"


def averaged_model_state(model: keras.Model) -> list[keras.Variable]:
    """The model's non-trainable floating-point variables that training updates.

    These are the variables a layer creates with ``trainable=False`` (the
    moving statistics of ``BatchNormalization``) in layers that are trainable.
    Frozen layers (``layer.trainable = False``) are left out: training does not
    change them, so averaging them would only cost bandwidth. Integer state
    (seed generators, counters) is never averaged.

    Uses ``Layer._flatten_layers`` and ``Layer._non_trainable_variables``
    (keras 3.15): the public ``non_trainable_weights`` cannot tell a moving
    statistic from the weights of a frozen layer.
    """
    seen: set[int] = set()
    state = []
    for layer in model._flatten_layers(include_self=True, recursive=True):
        if not layer.trainable:
            continue
        for variable in layer._non_trainable_variables:
            if id(variable) in seen or not _is_float(variable):
                continue
            seen.add(id(variable))
            state.append(variable)
    return state


def _is_float(variable) -> bool:
    return tf.as_dtype(variable.dtype).is_floating


def needs_train_function(model: keras.Model) -> bool:
    """Whether ``model.fit`` needs :func:`make_train_function` to run.

    Keras 3.15 runs ``steps_per_execution > 1`` as a ``tf.while_loop`` whose
    body calls the one-step ``tf.function`` inside a ``tf.cond``. Under a
    ``tf.distribute`` strategy, the optimizer's ``merge_call`` inside that
    nested function fails at run time ("You must feed a value for placeholder
    tensor ... while/cond/Placeholder"), even with a stock ``SGD``
    (keras-team/keras#19246).
    """
    return model.steps_per_execution > 1 and not _is_default_strategy(
        model.distribute_strategy
    )


def _is_default_strategy(strategy) -> bool:
    from tensorflow.python.distribute import distribute_lib

    return strategy is distribute_lib._get_default_strategy()


def make_train_function(model: keras.Model):
    """A train function for ``steps_per_execution > 1`` under a strategy.

    It runs up to ``steps_per_execution`` steps in one ``tf.function``, calling
    ``strategy.run(model.train_step)`` directly in the loop body rather than
    through a nested ``tf.function`` inside a ``tf.cond``, and otherwise
    behaves as Keras' own: it returns the logs of the last step and raises
    ``StopIteration`` when the iterator is exhausted.
    """
    from keras.src.backend.tensorflow.trainer import reduce_per_replica

    strategy = model.distribute_strategy
    steps_per_execution = model.steps_per_execution

    def one_step(data):
        outputs = strategy.run(model.train_step, args=(data,))
        return reduce_per_replica(outputs, strategy, reduction="auto")

    @tf.function(reduce_retracing=True)
    def multi_step(iterator):
        # An exhausted iterator raises OutOfRangeError here, which Keras'
        # epoch iterator turns into the end of the epoch.
        logs = one_step(iterator.get_next())
        for _ in tf.range(steps_per_execution - 1):
            following = iterator.get_next_as_optional()
            if not following.has_value():
                break
            logs = one_step(following.get_value())
        return logs

    def function(iterator):
        if isinstance(iterator, (tf.data.Iterator, tf.distribute.DistributedIterator)):
            return multi_step(iterator)
        logs = None
        for _, data in zip(range(steps_per_execution), iterator, strict=False):
            logs = one_step(data)
        return logs

    function.keras_skip_train_function = True
    return function


_next_group_key = 10_000


def isolate_collective_keys(strategy) -> None:
    """Gives a ``MirroredStrategy`` collective keys no other strategy uses.

    Every ``MirroredStrategy`` in a process numbers its collectives from the
    same group and instance keys, and the runtime remembers each key's shape:
    a second strategy in the same process whose collectives differ in shape
    fails with "Shape mismatch in the collective instance"
    (tensorflow/tensorflow#62790). keras-skip adds collectives (averages)
    that stock training lacks, so it meets this whenever a notebook trains a
    second model. Moving the strategy to a group key of its own avoids it;
    functions traced before keep their keys. ``MultiWorkerMirroredStrategy``
    is left alone: its keys must agree across worker processes.
    """
    global _next_group_key
    if not isinstance(strategy, tf.distribute.MirroredStrategy):
        return
    if getattr(strategy, "_keras_skip_isolated", False):
        return
    from tensorflow.python.distribute import cross_device_ops

    collective = getattr(strategy.extended, "_collective_ops", None)
    if not isinstance(collective, cross_device_ops.CollectiveAllReduce):
        return
    keys = collective._collective_keys
    with keys._lock:
        keys._group_key = _next_group_key
        group_key = keys._get_new_group_key(collective._devices)
        keys._known_groups[",".join(collective._devices)] = group_key
        _next_group_key = keys._group_key
    for launcher in collective._launchers:
        launcher._group_key = group_key
    strategy._keras_skip_isolated = True
