"""The replicas' drift, measured at each average (``measure_drift=True``).

`Drift` records ``mean_i ||x_i - x_bar||`` before an average overwrites the
weights, into the optimizer's two-element variable (the sum over averages
and the last one); `NoDrift` measures nothing. Chosen when the optimizer is
built. Cross-replica context.
"""

from __future__ import annotations

import tensorflow as tf


class NoDrift:
    """Averages measure no drift."""

    def values(self) -> tuple[float, float]:
        """``(sum over averages, last)`` of the drifts measured (eagerly)."""
        return 0.0, 0.0

    def record(self, distribution, codec, weights, means, moved, values=None):
        pass


class Drift(NoDrift):
    """Measures the drift with `codec`'s idea of the average ``x_bar``."""

    def __init__(self, variable):
        self.variable = variable

    def values(self) -> tuple[float, float]:
        total, last = self.variable.numpy().tolist()
        return total, last

    def record(self, distribution, codec, weights, means, moved, values=None):
        """`means`: the weights' part of the average's means; `values`: the
        weights the average sent (a snapshot), if not the variables'."""
        if not weights:
            return  # a fragment none of whose variables the steps update

        def own_drift(means, values):
            squares = []
            for i, (v, m) in enumerate(zip(weights, means, strict=True)):
                x = v.read_value() if values is None else values[i]
                m = codec.averaged(v, x, m, moved)
                squares.append(tf.reduce_sum(tf.square(tf.cast(x - m, tf.float64))))
            return tf.sqrt(tf.add_n(squares))

        extended = distribution.extended
        drift = extended.call_for_each_replica(own_drift, args=(means, values))
        (drift,) = extended.batch_reduce_to(
            tf.distribute.ReduceOp.MEAN, [(drift, drift)]
        )
        drift = distribution.experimental_local_results(drift)[0]
        total = self.variable.value.read_value()[0]
        self.variable.value.assign(tf.stack([total + drift, drift]))


def build(add_variable, measure_drift: bool) -> NoDrift:
    """The part for `measure_drift`, its variable made with the optimizer's
    `add_variable`."""
    if not measure_drift:
        return NoDrift()
    # The sum of the drifts measured so far, and the last one.
    return Drift(add_variable((2,), dtype="float64", name="drift"))
