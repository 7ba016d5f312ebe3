"""What an average sends of the weights, and how each replica applies the mean.

A codec is chosen once, when the optimizer is built: `Dense` sends every
replica's weights as they are (``maths.average``); `Compressed` sends each
weight's update since the period began in a 16-bit type with error feedback
(``maths.compress_with_feedback`` and ``maths.wire_mean``). Both work in
cross-replica context on the weights (the payload's first part) and pass the
rest of the payload (model state, the stop vote, averaged slots) through as
it is.
"""

from __future__ import annotations

from collections.abc import Callable

import tensorflow as tf

from keras_skip import _updates
from keras_skip.steering import tf_variable


class Dense:
    """Sends the weights themselves; the mean is the average."""

    #: Per replica and trainable variable, what has not been sent yet.
    errors: tuple = ()
    #: The all-reduces one average makes: one batch of the payload.
    all_reduces = 1

    def wire_types(self, weights) -> list:
        """The types of the weights' part of a payload where they are not the
        variables' own (none here)."""
        return []

    def send(self, distribution, weights, rest, moved, values=None, keep=None) -> list:
        """Per replica, what the average sends: copies of the variables, or
        `values` (a snapshot taken before a step) as they are. `moved`: see
        `_overlap.Cover`, as `keep`, the weights the average leaves as they
        are (identical on every replica, so their means are their values)."""
        if values is not None:
            return values
        return distribution.extended.call_for_each_replica(
            lambda: [tf.identity(v) for v in weights + rest]
        )

    def reduce(self, distribution, weights, rest, per_replica, through=None) -> list:
        """The means of what `send` returned, in one batch; `through`: the
        cross-device ops to reduce with, if not the strategy's own."""
        return _updates.reduce_mean(
            distribution, per_replica, weights + rest, through=through
        )

    def bytes(self, weights, rest) -> int:
        """Bytes each replica puts into the all-reduce."""
        return _updates.bytes(weights + rest)

    def averaged(self, variable, x, mean, moved):
        """The average of one weight, from a replica's value `x` and the mean
        of what was sent (per replica, as `assign` computes it)."""
        return mean

    def assign(
        self,
        distribution,
        weights,
        means,
        corrections,
        scale,
        moved,
        values=None,
        keep=None,
    ) -> None:
        """On each replica: the weights to the average, the corrections by
        ``scale * (average - x_i)``; `values`: the weights that were sent (a
        snapshot), if not the variables'; `keep`: see `send` (the means of
        weights identical on every replica are their values already)."""
        for i, v in enumerate(weights):
            distribution.extended.update(
                v,
                _updates.assign_with_correction,
                args=(
                    means[i],
                    corrections[i],
                    _updates.each(scale, i),
                    None if values is None else values[i],
                ),
                group=False,
            )


class Compressed(Dense):
    """Sends each weight's update since the period began plus what earlier
    rounds did not send, rounded to `dtype`; keeps the rounding's loss."""

    #: The 16-bit weights, then the rest of the payload in its own types.
    all_reduces = 2

    def __init__(
        self,
        dtype: str,
        start_of: Callable[[tf.Variable], tf.Variable],
        errors: list,
        index_of: Callable[[tf.Variable], int],
    ):
        self.wire = tf.as_dtype(dtype)
        self.errors = list(errors)
        self._start_of = start_of
        self._error_of = lambda v: tf_variable(self.errors[index_of(v)])

    def wire_types(self, weights) -> list:
        return [self.wire] * len(weights)

    def send(self, distribution, weights, rest, moved, values=None, keep=None) -> list:
        starts = [self._start_of(v) for v in weights]
        errors = [self._error_of(v) for v in weights]

        def payload(values):
            sent = []
            for i, (v, start, error) in enumerate(
                zip(weights, starts, errors, strict=True)
            ):
                x = v.read_value() if values is None else values[i]
                base = tf.where(_updates.each(moved, i), start.read_value(), x)
                update = tf.cast(x - base + error.read_value(), self.wire)
                if keep is not None:
                    # Sends nothing of it: the mean 0 keeps its weights
                    # and its error as they are.
                    update = tf.where(keep[i], tf.zeros_like(update), update)
                sent.append(update)
            if values is None:
                return sent + [tf.identity(v) for v in rest]
            return sent + list(values[len(weights) :])

        return distribution.extended.call_for_each_replica(payload, args=(values,))

    def reduce(self, distribution, weights, rest, per_replica, through=None) -> list:
        # One batch per type: a batch may be packed into one tensor.
        return _updates.reduce_mean(
            distribution, per_replica, weights + rest, len(weights), through
        )

    def bytes(self, weights, rest) -> int:
        return sum(
            v.shape.num_elements() * self.wire.size for v in weights
        ) + _updates.bytes(rest)

    def averaged(self, variable, x, mean, moved):
        base = tf.where(moved, self._start_of(variable).read_value(), x)
        return base + tf.cast(mean, x.dtype)

    def assign(
        self,
        distribution,
        weights,
        means,
        corrections,
        scale,
        moved,
        values=None,
        keep=None,
    ) -> None:
        for i, v in enumerate(weights):
            distribution.extended.update(
                v,
                _updates.assign_compressed,
                args=(
                    means[i],
                    self._start_of(v),
                    self._error_of(v),
                    corrections[i],
                    _updates.each(scale, i),
                    _updates.each(moved, i),
                    self.wire,
                    None if values is None else values[i],
                    None if keep is None else keep[i],
                ),
                group=False,
            )


def build(compression, add_optimizer_variables, var_list, index_of, period):
    """The codec for `compression` (None: `Dense`). `Compressed` keeps, per
    replica, what rounding to the wire type has not sent yet, in variables
    made with the optimizer's `add_optimizer_variables`; `period` gives the
    period's start (a `PeriodStart`)."""
    if compression is None:
        return Dense()
    errors = add_optimizer_variables(var_list, "unsent")
    return Compressed(compression, period.of, errors, index_of)
