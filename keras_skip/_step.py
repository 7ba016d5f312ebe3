"""One training step: synchronous, or local with the average when one is due.

A step is synchronous (the gradients all-reduced, ``interval <= 1`` or
during warm-up) or local: each replica's own step plus its correction
(``maths.local_step``), then the average if one is due. The choice is a
`tf.cond` in cross-replica context, so that the branch that communicates
never runs in replica context.

Tracing both branches costs about as much as everything else in the first
execution, yet most executions take only one. So `model.fit` asks, before
each execution, which branch all its steps take (`branch_of_execution`,
from the counters) and runs a train function traced with that branch alone
(`Step.taking`). A function with the condition remains for a fit with a
warm-up (an execution may cross its end; once traced, that function serves
every later execution) and for custom training loops.
"""

from __future__ import annotations

import contextlib
import functools

import keras
import tensorflow as tf

from keras_skip import _compat, _updates
from keras_skip.steering import read, tf_variable

#: The branches an execution's steps can all take (`branch_of_execution`).
SYNCHRONOUS, LOCAL = "synchronous", "local"
#: With fragments, a local step whose interval the host holds (its average
#: is a full one) and one whose interval it does not (the fragments fall due
#: on their own), each traced alone (`Step.branch_of_next_execution`).
LOCAL_HELD, LOCAL_FREE = "local, held", "local, not held"
_BRANCHES = (None, SYNCHRONOUS, LOCAL, LOCAL_HELD, LOCAL_FREE)


def branch_of_execution(
    interval: int, iterations: int, warmup_steps: int
) -> str | None:
    """The branch every step of the next execution takes, from the interval
    and the iteration count before it: `SYNCHRONOUS`, `LOCAL`, or None for
    a condition at each step. Neither counter changes otherwise during an
    execution, and the iterations only grow. During a warm-up, None: an
    execution may cross its end, and a function with the condition, once
    traced, serves the rest of the training."""
    if interval <= 1:
        return SYNCHRONOUS
    if iterations >= warmup_steps:
        return LOCAL
    return None


def build_counters(add_variable, interval: int, inner) -> tuple:
    """The step's state, as optimizer variables in the checkpoint's order: the
    interval, the learning rates' sum since the period began (in `inner`'s
    learning-rate type), the local steps since the last average, and the
    counts of averages, synchronous steps and bytes sent."""
    counter = functools.partial(add_variable, (), dtype="int64")
    start = keras.initializers.Constant(interval)
    return (
        add_variable((), initializer=start, dtype="int64", name="interval"),
        add_variable((), dtype=_updates.learning_rate_dtype(inner), name="gamma"),
        counter(name="local_steps"),
        counter(name="averages"),
        counter(name="synchronous_steps"),
        counter(name="bytes_sent"),
    )


def gradients(inner, grads, n: int) -> tuple[list, list]:
    """``(synchronous, local)``: a replica's gradients (replica context) for
    a synchronous step and for a local one, unscaled by `inner`'s loss-scale
    factor and clipped by its clipping options."""
    if inner.loss_scale_factor is not None:
        grads = [g / inner.loss_scale_factor for g in grads]
    # Keras scales each replica's loss by 1/n so that a SUM all-reduce is
    # a mean; a local step uses the replica's own, unscaled gradient.
    synchronous = _compat.clip_gradients(inner, grads)
    if n == 1:
        return synchronous, synchronous
    return synchronous, _compat.clip_gradients(
        inner, [_updates.scale(g, n) for g in grads]
    )


class Step:
    """The optimizer's step, from its parts and variables.

    `inner`: the wrapped optimizer; `averager`: the `_averager.Averager`;
    `group`: replicas per synchronous group (a local step takes the group's
    mean gradient), 1 for none; `corrected`: a local step adds the
    corrections; `interval`, `iterations`, `local_steps`, `gamma`,
    `synchronous`, `bytes_sent`: the optimizer's variables of those names.
    """

    def __init__(
        self,
        *,
        inner,
        averager,
        warmup_steps: int,
        votes: tuple,
        period,
        schedule,
        slots,
        group: int,
        corrected: bool,
        interval,
        iterations,
        local_steps,
        gamma,
        synchronous,
        bytes_sent,
    ):
        self._inner = inner
        self._averager = averager
        self._warmup_steps = warmup_steps
        self._votes = votes
        self._period = period
        self._schedule = schedule
        self._slots = slots
        self._local_gradients = _updates.no_groups
        if group > 1:
            self._local_gradients = functools.partial(
                _updates.group_means, group_size=group
            )
        self._correct = (
            _updates.add_corrections if corrected else _updates.no_correction
        )
        self._interval = interval
        self._iterations = iterations
        self._local_steps = local_steps
        self._gamma = gamma
        self._synchronous = synchronous
        self._bytes = bytes_sent
        #: While a train function traces: the only branch it takes, or None
        #: for both (`taking`).
        self._only: str | None = None

    def branch_of_next_execution(self) -> str | None:
        """`branch_of_execution` for the next execution, from the counters
        as they are now (read eagerly). With fragments, a local execution is
        `LOCAL_HELD` or `LOCAL_FREE` after the schedule's `hold` variable,
        which only the host writes between executions: a function traced
        with one of them holds no condition on it and no path for the other
        (the full average that ends a held interval, or the fragments')."""
        branch = branch_of_execution(
            int(read(self._interval)), int(read(self._iterations)), self._warmup_steps
        )
        hold = self._schedule.hold
        if branch != LOCAL or hold is None:
            return branch
        return LOCAL_HELD if int(read(hold)) > 0 else LOCAL_FREE

    @contextlib.contextmanager
    def taking(self, branch: str | None):
        """Within the block, a traced step takes only `branch` (`SYNCHRONOUS`,
        `LOCAL`, or with fragments `LOCAL_HELD` or `LOCAL_FREE`), or chooses
        with a condition (None)."""
        if branch not in _BRANCHES:
            allowed = ", ".join(repr(b) for b in _BRANCHES[1:])
            raise ValueError(f"branch must be None, {allowed}; got {branch!r}.")
        schedule = self._schedule
        hold = {LOCAL_HELD: True, LOCAL_FREE: False}.get(branch)
        if hold is not None and schedule.hold is None:
            raise ValueError(f"branch {branch!r} needs fragments.")
        before = self._only, schedule.traced_hold
        self._only = LOCAL if hold is not None else branch
        schedule.traced_hold = hold
        try:
            yield
        finally:
            self._only, schedule.traced_hold = before

    def __call__(self, distribution, sync_grads, local_grads, variables, lr):
        """Takes the step (cross-replica context); returns whether an
        interval average ran (a boolean tensor)."""
        if self._only == SYNCHRONOUS:
            return self.synchronous(distribution, sync_grads, variables, lr)
        if self._only == LOCAL:
            return self.local(distribution, local_grads, variables, lr)
        is_synchronous = tf.logical_or(
            self._interval.value <= 1,
            self._iterations.value < self._warmup_steps,
        )
        return tf.cond(
            is_synchronous,
            lambda: self.synchronous(distribution, sync_grads, variables, lr),
            lambda: self.local(distribution, local_grads, variables, lr),
            name="synchronous_step",
        )

    def synchronous(self, distribution, grads, variables, lr):
        """All-reduces the gradients (and any stop vote) and takes the inner
        optimizer's step on their mean, after averaging whatever differs
        between the replicas. Returns False: no interval average."""
        with _after_the_data(distribution, grads):
            return self._synchronous_step(distribution, grads, variables, lr)

    def _synchronous_step(self, distribution, grads, variables, lr):
        self._averager.average_if_pending(distribution, include_slots=True)
        n = distribution.num_replicas_in_sync
        extended = distribution.extended
        tf_variables = [tf_variable(v) for v in variables]
        if n > 1:
            votes = [
                (extended.call_for_each_replica(v.read_value), v) for v in self._votes
            ]
            grads = extended.batch_reduce_to(
                tf.distribute.ReduceOp.SUM,
                list(zip(grads, tf_variables, strict=True)) + votes,
            )
            for v, total in zip(self._votes, grads[len(tf_variables) :], strict=True):
                extended.update(v, _updates.assign, args=(total / n,), group=False)
            grads = grads[: len(tf_variables)]
        _compat.optimizer_step(self._inner, distribution, grads, variables, lr)
        self._synchronous.value.assign_add(1)
        self._schedule.after_synchronous_step()
        if n > 1:
            self._bytes.value.assign_add(_updates.bytes(tf_variables))
        return tf.constant(False)

    def local(self, distribution, grads, variables, lr):
        """Each replica's own step (`grads`: its unscaled gradients) plus its
        correction; then the average, if one is due. Returns whether one ran."""
        averager = self._averager
        tf_variables = [tf_variable(v) for v in variables]
        self._schedule.record_starts(self._period, distribution, tf_variables)
        sent = self._schedule.before_step(distribution)
        grads = self._local_gradients(distribution, grads)
        _compat.optimizer_step(self._inner, distribution, grads, variables, lr)
        corrections = [tf_variable(c) for c in averager.own_corrections(tf_variables)]
        self._correct(distribution, tf_variables, corrections, lr)
        # An overlapped average's all-reduce, started above, waits for none
        # of the step; what follows counts the step, so it waits for it.
        with _after_the_data(distribution, grads):
            distribution.extended.update(
                self._gamma.value, _updates.add_learning_rate, args=(lr,), group=False
            )
            local_steps = self._local_steps.value.assign_add(1)
            if distribution.num_replicas_in_sync > 1:
                self._slots.after_local_step(self._slots.slots())
            self._schedule.count_step(distribution, lr)
            return self._schedule.after_step(
                sent,
                local_steps,
                lambda fragment=None: averager.average(distribution, fragment=fragment),
                lambda sent, fragment=None: averager.average_overlapped(
                    distribution, sent, lr, fragment
                ),
            )


def _after_the_data(distribution, grads):
    """Ops created inside wait for the gradients. A train function whose
    input ran out (the end of an epoch of unknown length) still runs every
    op that does not wait for the data: without this, the counters took a
    step that never happened."""
    return tf.control_dependencies(_updates.tensors_of(distribution, grads))
