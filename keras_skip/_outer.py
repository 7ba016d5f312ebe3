"""Where a period started, and the outer optimizer's step from there.

A period is the local steps between two averages. The outer step
(``outer_optimizer``, DiLoCo style) and the compressed codec both need the
weights as they were when the period began; `PeriodStart` keeps them,
`NoPeriodStart` stands in when neither needs them. `OuterStep` takes the
outer optimizer's step after an average; `NoOuterStep` leaves the average as
it is. Both are chosen when the optimizer is built. Cross-replica context.
"""

from __future__ import annotations

from collections.abc import Callable

import tensorflow as tf

from keras_skip import _compat, _updates
from keras_skip.steering import tf_variable


class NoPeriodStart:
    """Nothing to keep: no part reads where the period started."""

    of = None

    def record_if_first(self, distribution, variables, first) -> None:
        pass

    def record(self, distribution, variables) -> None:
        pass


class PeriodStart(NoPeriodStart):
    """Keeps the weights at the first local step of a period (identical on
    every replica: they were just averaged or synchronized). `start_of`
    gives a trainable variable's period-start variable."""

    def __init__(self, start_of: Callable[[tf.Variable], tf.Variable]):
        self.of = start_of

    def record_if_first(self, distribution, variables, first) -> None:
        """Records the period's start if `first` (a boolean tensor) holds."""

        def record():
            self.record(distribution, variables)
            return tf.constant(True)

        tf.cond(first, record, lambda: tf.constant(False))

    def record(self, distribution, variables) -> None:
        for v in variables:
            distribution.extended.update(
                self.of(v), _updates.assign, args=(v,), group=False
            )


class NoOuterStep:
    """The average is the new weights."""

    def after_average(self, distribution, moved, variables, steps=None) -> None:
        pass


class OuterStep(NoOuterStep):
    """The outer optimizer's step after the average, if the period had local
    steps: the variables, which hold the average, go back to where the
    period started, and the outer optimizer takes one step there with the
    pseudo-gradient ``start - average``, exactly as its own ``apply`` would
    (clipping, weight decay, its update hooks), minus the gradient
    all-reduce: every replica holds the same values."""

    def __init__(self, outer, period: PeriodStart):
        self._outer = outer
        self._period = period

    def after_average(self, distribution, moved, variables, steps=None) -> None:
        """`steps`: None, or ``(counts, j)``: the outer step takes its step
        count from ``counts[j]`` (a fragment's) and writes it back there."""
        outer = self._outer
        extended = distribution.extended
        if not variables:
            return

        def step():
            if steps is not None:
                counts, j = steps
                outer.iterations.value.assign(counts.value[j])
            starts = [self._period.of(v) for v in variables]
            pseudo_gradients = [
                s.read_value() - tf_variable(v).read_value()
                for v, s in zip(variables, starts, strict=True)
            ]
            for v, start in zip(variables, starts, strict=True):
                extended.update(
                    tf_variable(v), _updates.assign, args=(start,), group=False
                )
            grads = _compat.clip_gradients(outer, pseudo_gradients)
            _compat.optimizer_step(
                outer, distribution, grads, variables, outer.learning_rate
            )
            outer.iterations.value.assign_add(1)
            if steps is not None:
                counts.value.assign(
                    tf.tensor_scatter_nd_update(
                        counts.value, [[j]], [outer.iterations.value]
                    )
                )
            return tf.constant(True)

        tf.cond(moved, step, lambda: tf.constant(False))


def build_period_start(add_optimizer_variables, var_list, index_of, needed: bool):
    """A `PeriodStart` with one variable per trainable variable, made with
    the optimizer's `add_optimizer_variables` (`index_of`: a variable's index
    among them), if `needed`; else `NoPeriodStart`."""
    if not needed:
        return NoPeriodStart()
    # The weights when the current period began (identical on all replicas).
    starts = add_optimizer_variables(var_list, "period_start")
    return PeriodStart(lambda v: tf_variable(starts[index_of(v)]))


def build_outer_step(outer, period) -> NoOuterStep:
    """The outer optimizer's step, or none when `outer` is None."""
    return NoOuterStep() if outer is None else OuterStep(outer, period)
