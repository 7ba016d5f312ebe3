"""The replicas' drift, measured at each average (``measure_drift=True``).

`Drift` records ``mean_i ||x_i - x_bar||`` before an average overwrites the
weights, into the optimizer's two-element variable (the sum over averages
and the last one); `NoDrift` measures nothing. Chosen when the optimizer is
built. Cross-replica context.
"""

from __future__ import annotations

import tensorflow as tf

from keras_skip import _updates


class NoDrift:
    """Averages measure no drift."""

    def values(self) -> tuple[float, float]:
        """``(sum over averages, last)`` of the drifts measured (eagerly)."""
        return 0.0, 0.0

    def record(self, distribution, codec, weights, means, cover, values=None):
        pass


class Drift(NoDrift):
    """Measures the drift with `codec`'s idea of the average ``x_bar``."""

    def __init__(self, variable):
        self.variable = variable

    def values(self) -> tuple[float, float]:
        total, last = self.variable.numpy().tolist()
        return total, last

    def record(self, distribution, codec, weights, means, cover, values=None):
        """`means`: the weights' part of the average's means; `cover`: the
        average's `_overlap.Cover` (with fragments, one drift per fragment it
        covers, in fragment order, as ``maths.simulate`` records them);
        `values`: the weights the average sent (a snapshot), if not the
        variables'."""
        groups = cover.groups or [list(range(len(weights)))]
        zero = tf.constant(0.0, tf.float64)

        def own_drifts(means, values):
            drifts = []
            for group in groups:
                squares = [zero]
                for i in group:
                    v = weights[i]
                    x = v.read_value() if values is None else values[i]
                    m = codec.averaged(v, x, means[i], _updates.each(cover.moved, i))
                    squares.append(tf.reduce_sum(tf.square(tf.cast(x - m, tf.float64))))
                drifts.append(tf.sqrt(tf.add_n(squares)))
            return tf.stack(drifts)

        extended = distribution.extended
        drifts = extended.call_for_each_replica(own_drifts, args=(means, values))
        (drifts,) = extended.batch_reduce_to(
            tf.distribute.ReduceOp.MEAN, [(drifts, drifts)]
        )
        drifts = distribution.experimental_local_results(drifts)[0]
        selected = cover.selected
        if selected is None:
            selected = tf.ones([len(groups)], tf.bool)
        total, last = tf.unstack(self.variable.value.read_value())
        total += tf.reduce_sum(tf.where(selected, drifts, zero))
        # The last fragment covered (the drift maths records last).
        chosen = tf.where(selected, tf.range(len(groups)), -1)
        last = tf.cond(
            tf.reduce_any(selected),
            lambda: drifts[tf.reduce_max(chosen)],
            lambda: last,
        )
        self.variable.value.assign(tf.stack([total, last]))


def build(add_variable, measure_drift: bool) -> NoDrift:
    """The part for `measure_drift`, its variable made with the optimizer's
    `add_variable`."""
    if not measure_drift:
        return NoDrift()
    # The sum of the drifts measured so far, and the last one.
    return Drift(add_variable((2,), dtype="float64", name="drift"))
