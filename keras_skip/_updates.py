"""The updates a local step and an average write on each replica, and the
cross-replica helpers that feed them.

Each update runs under ``strategy.extended.update`` on one replica's
variable; the helpers build what a cross-replica context hands them
(distributed values, group means). TensorFlow only: no option of the
optimizer is read here.
"""

from __future__ import annotations

import functools

import keras
import tensorflow as tf

from keras_skip import _compat


def function(body, *args):
    """``tf.function`` of ``body(*args)``, traced apart from every other
    optimizer's. TensorFlow counts retracing by the Python code a function
    was made from: functions made from one lambda by several optimizers in
    one process (a notebook, a test suite) look like one function traced
    again and again, and warn that "tracing is expensive". A
    `functools.partial` is counted on its own."""
    return tf.function(functools.partial(body, *args), autograph=False)


def in_strategy(body):
    """``body(strategy)`` with the strategy whose scope it runs in."""
    return body(tf.distribute.get_strategy())


def when(distribution, pred, fn, variables, dtypes=()) -> list:
    """`fn()`, a list of distributed values shaped like `variables`, if `pred`,
    else empty tensors: a `tf.cond` in cross-replica context, returning
    `PerReplica` values. `dtypes`: the values' types where they are not the
    variables' (a leading part of the list)."""
    local = len(distribution.extended.worker_devices)
    types = list(dtypes) + [v.dtype for v in variables[len(dtypes) :]]

    def taken():
        return [
            part
            for value in fn()
            for part in distribution.experimental_local_results(value)
        ]

    def skipped():
        return [tf.zeros([0], dtype) for dtype in types for _ in range(local)]

    flat = tf.cond(pred, taken, skipped, name="average_overlapped_sent")
    values = []
    for i, v in enumerate(variables):
        parts = flat[i * local : (i + 1) * local]
        for part in parts:
            part.set_shape(v.shape)
        values.append(_compat.per_replica(parts))
    return values


def tensors_of(distribution, values) -> list:
    """Every replica's tensors of the distributed `values` (gradients, None
    skipped), for ops that must wait for them."""
    tensors = []
    for value in values:
        if value is None:
            continue
        for part in distribution.experimental_local_results(value):
            tensors.append(part.values if isinstance(part, tf.IndexedSlices) else part)
    return tensors


def bytes(variables) -> int:
    """Bytes of the values of these variables (a dense payload)."""
    return sum(v.shape.num_elements() * tf.as_dtype(v.dtype).size for v in variables)


def group_means(distribution, grads, group_size) -> list:
    """Each replica's gradient replaced by the mean over its group (local
    replicas in consecutive groups of `group_size`), for hierarchical
    averaging. Every member gets the same tensor, so the group stays
    identical."""
    devices = distribution.extended.worker_devices
    grouped = []
    for g in grads:
        parts = distribution.experimental_local_results(g)
        means = []
        for first in range(0, len(parts), group_size):
            members = parts[first : first + group_size]
            with tf.device(devices[first]):
                if isinstance(members[0], tf.IndexedSlices):
                    total = tf.IndexedSlices(
                        tf.concat([m.values for m in members], 0),
                        tf.concat([m.indices for m in members], 0),
                        members[0].dense_shape,
                    )
                else:
                    total = tf.add_n(members)
                mean = scale(total, 1.0 / group_size)
            means.extend([mean] * group_size)
        grouped.append(_compat.per_replica(means))
    return grouped


def no_groups(distribution, grads) -> list:
    """No groups (``group_size=None``): each replica keeps its gradient."""
    return grads


def add_corrections(distribution, variables, corrections, lr) -> None:
    """``x_i += lr * c_i`` on each replica, after its local step."""
    for v, c in zip(variables, corrections, strict=True):
        distribution.extended.update(v, add_scaled, args=(c, lr), group=False)


def no_correction(distribution, variables, corrections, lr) -> None:
    """No correction (``correction=0``, or one replica): nothing to add."""


def scale(gradient, factor):
    if isinstance(gradient, tf.IndexedSlices):
        return tf.IndexedSlices(
            gradient.values * tf.cast(factor, gradient.values.dtype),
            gradient.indices,
            gradient.dense_shape,
        )
    return gradient * tf.cast(factor, gradient.dtype)


def add_scaled(variable, correction, lr):
    """``variable += lr * correction`` in place, in one fused kernel; a
    separate multiply and add made a model-sized temporary at every local
    step (see "Outer optimizer and compressed averages" in the benchmarks)."""
    tf.raw_ops.ResourceApplyGradientDescent(
        var=variable.handle,
        alpha=-tf.cast(lr, variable.dtype),
        delta=correction.read_value(),
    )


def learning_rate_dtype(optimizer) -> str:
    """The type of `optimizer`'s learning rate: its variable's (Keras' float
    type when the optimizer was made), or Keras' float type for a schedule.
    The learning rates' sum since an average is kept in it, so that a
    float64 model's correction is scaled in float64."""
    dtype = getattr(_compat.learning_rate_variable(optimizer), "dtype", None)
    return str(tf.as_dtype(dtype).name) if dtype else keras.backend.floatx()


def add_learning_rate(gamma, lr):

    return gamma.assign_add(tf.cast(lr, gamma.dtype))


def assign(variable, value):
    """`value` into `variable`, cast to the variable's type (a mean held
    wider than its wire type; a no-op cast otherwise)."""
    return variable.assign(tf.cast(value, variable.dtype))


def add(variable, value):
    return variable.assign_add(value)


def assign_learning_rate(gamma, lr):
    return gamma.assign(tf.cast(lr, gamma.dtype))


def each(value, i: int):
    """The `i`-th weight's `value`: `value` itself, or its `i`-th element if
    it is a list (one per weight)."""
    return value[i] if isinstance(value, list) else value


def assign_with_correction(variable, mean, correction, scale, value=None):
    """``x_i <- mean``, and ``c_i += scale (mean - x_i)``; `value`: the
    replica's weights the average sent (a snapshot), if not the variable's."""
    if correction is not None:
        x = variable.read_value() if value is None else value
        correction.assign_add((mean - x) * tf.cast(scale, variable.dtype))
    return variable.assign(mean)


def assign_compressed(
    variable, mean, start, error, correction, scale, moved, wire, value=None, keep=None
):
    x = variable.read_value() if value is None else value
    base = tf.where(moved, start.read_value(), x)
    update = x - base + error
    sent = tf.cast(tf.cast(update, wire), variable.dtype)
    if keep is not None:  # sent nothing (`_codecs.Compressed.send`)
        sent = tf.where(keep, tf.zeros_like(sent), sent)
    error.assign(update - sent)
    average = base + tf.cast(mean, variable.dtype)
    if correction is not None:
        # What this replica sent, not its exact weights: corrections sum to 0
        # up to the rounding of the mean, which the all-reduce computes in
        # the wire type.
        correction.assign_add(
            (average - (base + sent)) * tf.cast(scale, variable.dtype)
        )
    return variable.assign(average)


def reduce_mean(distribution, per_replica, payload, split=None, through=None) -> list:
    """The MEAN all-reduce of an average. With `split`, two batches: the
    first `split` values (the weights in the wire type), then the rest;
    one batch per type, as a batch may be packed into one tensor.
    `through`: a `tf.distribute.CrossDeviceOps` to reduce with instead of
    the strategy's own."""
    parts = [slice(0, None)] if split is None else [slice(0, split), slice(split, None)]
    means = []
    for part in parts:
        if per_replica[part]:
            pairs = list(zip(per_replica[part], payload[part], strict=True))
            if through is None:
                means += distribution.extended.batch_reduce_to(
                    tf.distribute.ReduceOp.MEAN, pairs
                )
            else:
                means += through.batch_reduce(tf.distribute.ReduceOp.MEAN, pairs)
    return means
