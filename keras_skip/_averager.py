"""One average of the replicas, through the parts chosen when the optimizer
is built.

An average sends the payload (the weights the steps update, the model's
averaged state, any stop vote, the slots the policy sends) through the
codec, sets every replica to the means with its correction updated by
``correction / gamma * (x_bar - x_i)``, takes the outer step, and restarts
the period (``maths.average``, ``maths.outer_step``). An overlapped average
applies means whose all-reduce started before the step, keeping each
replica's step on top (``maths.overlapped_average``). Cross-replica context.
"""

from __future__ import annotations

from collections.abc import Callable

import tensorflow as tf

from keras_skip import _overlap, _updates
from keras_skip.steering import tf_variable


class Averager:
    """Averages the replicas with the optimizer's parts and variables.

    `correction`: the correction's factor; `corrections`: one per trainable
    variable (None without correction), found by `index_of`; `stepped()`:
    the variables the steps update; `model_state()`: the model's averaged
    non-trainable state; `gamma`, `bytes_sent`, `local_steps`, `averages`:
    the optimizer's variables of those names.
    """

    def __init__(
        self,
        *,
        correction: float,
        corrections: list,
        index_of: Callable,
        stepped: Callable[[], list],
        model_state: Callable[[], list],
        votes: tuple,
        period,
        codec,
        outer,
        drift,
        schedule,
        slots,
        boundary,
        gamma,
        bytes_sent,
        local_steps,
        averages,
    ):
        self._correction = correction
        self._corrections = corrections
        self._index_of = index_of
        self._stepped = stepped
        self._model_state = model_state
        self._votes = votes
        self._period = period
        self._codec = codec
        self._outer = outer
        self._drift = drift
        self._schedule = schedule
        self._slots = slots
        self._gamma = gamma
        self._bytes = bytes_sent
        self._local_steps = local_steps
        self._averages = averages
        # The eager boundary averages, by the variables the steps update.
        self.functions: dict[tuple, Callable] = {}
        self._boundary = boundary

    def own_corrections(self, variables) -> list:
        """The corrections of `variables` (None without correction)."""
        return [self._corrections[self._index_of(v)] for v in variables]

    def payload(self, include_slots: bool, fragment=None):
        """``(weights, slots, payload)``: what an average (of `fragment`, or
        of everything) sends is the payload, the trainable weights first."""
        schedule = self._schedule
        weights = [tf_variable(v) for v in schedule.weights(self._stepped(), fragment)]
        slots = schedule.slots(self._slots.slots(), fragment)
        sent = self._slots.sent(slots, include_slots)
        state = self._model_state() if schedule.carries_state(fragment) else []
        return weights, slots, weights + state + list(self._votes) + sent

    def average(self, distribution, include_slots=False, fragment=None):
        """Averages the replicas now (only `fragment`'s variables, if given);
        returns True."""
        schedule = self._schedule
        stepped = self._stepped()
        cover = schedule.cover(stepped, include_slots, fragment)
        if distribution.num_replicas_in_sync > 1:
            weights, slots, payload = self.payload(include_slots, fragment)
            rest = payload[len(weights) :]
            per_replica = self._codec.send(
                distribution, weights, rest, cover.moved, keep=cover.keep
            )
            means = self._codec.reduce(distribution, weights, rest, per_replica)
            gamma = schedule.gamma(fragment, schedule.weights(stepped, fragment))
            self._assign_means(
                distribution, payload, weights, means, cover, gamma=gamma
            )
            self._slots.after_average(slots, include_slots, overlapped=False)
        if schedule.carries_state(fragment):
            self._boundary.record_state(distribution, self._model_state())
        schedule.outer_step(self._outer, distribution, cover.moved, stepped, fragment)
        if fragment is None:
            self._gamma.value.assign(0.0)
            self._local_steps.value.assign(0)
        schedule.after_average(overlapped=False, fragment=fragment)
        return self._count(restart=False)

    def average_overlapped(self, distribution, sent, lr, fragment=None):
        """The average of the snapshots `sent` carries (whose all-reduce
        started before the step), applied after the step: each replica keeps
        its step's displacement on top, and the correction is updated on the
        snapshot (only `fragment`'s, if given). Returns True."""
        self._land(distribution, sent, fragment)
        if fragment is not None:
            self._schedule.after_average(overlapped=True, fragment=fragment)
            self._schedule.restart_gamma(distribution, fragment, lr)
            return self._count(restart=False)
        distribution.extended.update(
            self._gamma.value, _updates.assign_learning_rate, args=(lr,), group=False
        )
        self._schedule.after_average(overlapped=True)
        return self._count()

    def average_delayed(self, distribution, sent, fragment=None):
        """The average of the snapshots `sent` carries, sent while the steps
        after it computed (``maths.overlapped_average``): as an overlapped
        average, but the period that began at the snapshot goes on (its
        local steps and learning rates stay counted). Returns True."""
        self._land(distribution, sent, fragment)
        self._averages.value.assign_add(1)
        return tf.constant(True)

    def _land(self, distribution, sent, fragment=None):
        """Each replica to the means of `sent` plus its own displacement
        since the snapshot; the corrections updated on the snapshot (only
        `fragment`'s, if given)."""
        extended = distribution.extended
        weights, slots, payload = self.payload(False, fragment)
        displacements = extended.call_for_each_replica(
            lambda snapshot: [
                tf.identity(v) - s for v, s in zip(payload, snapshot, strict=True)
            ],
            args=(sent.snapshot,),
        )
        own = sent.snapshot[: len(weights)]
        self._assign_means(
            distribution,
            payload,
            weights,
            sent.means,
            _overlap.Cover(sent.moved),
            own,
            sent.gamma,
        )
        self._slots.after_average(slots, include_slots=False, overlapped=True)
        self._schedule.outer_step(
            self._outer, distribution, sent.moved, self._stepped(), fragment
        )
        # The next period starts from the (outer) average.
        self._period.record(distribution, weights)
        if self._schedule.carries_state(fragment):
            self._boundary.record_state(distribution, self._model_state())
        for v, d in zip(payload, displacements, strict=True):
            extended.update(v, _updates.add, args=(d,), group=False)

    def eager_average(self, key: tuple) -> Callable:
        """The compiled boundary average for the variables the steps update
        (`key`), traced on first use (call it inside the strategy scope;
        tracing it early keeps tracing out of timings)."""
        function = self.functions.get(key)
        if function is None:
            function = _updates.function(_updates.in_strategy, self.average_if_pending)
            function.get_concrete_function()
            self.functions[key] = function
        return function

    def average_if_pending(self, distribution, include_slots=False):
        """Averages if the replicas may differ: the weights moved since the
        last average, or (`include_slots`) the slots are apart. Returns
        whether it averaged (a boolean tensor)."""
        pending = self._schedule.moved()
        if include_slots:
            pending = tf.logical_or(pending, self._slots.apart.value > 0)
        return tf.cond(
            pending,
            lambda: self.average(distribution, include_slots),
            lambda: tf.constant(False),
            name="average_pending",
        )

    def _assign_means(
        self, distribution, payload, weights, means, cover, own=None, gamma=None
    ) -> None:
        """Every replica's payload to the means, the weights through the codec
        (corrections by ``correction / gamma * (average - x_i)``); the drift
        measured before. `own`: the weights that were sent (a snapshot), if
        not the variables'; `gamma`: the learning rates' sum they were taken
        at, if not the current one."""
        codec = self._codec
        gamma = self._gamma.value if gamma is None else gamma
        if isinstance(gamma, list):  # one per weight
            scale = [self._scale(g) for g in gamma]
        else:
            scale = self._scale(gamma)
        rest = payload[len(weights) :]
        self._bytes.value.assign_add(codec.bytes(weights, rest))
        moved = cover.moved
        self._drift.record(
            distribution, codec, weights, means[: len(weights)], cover, own
        )
        corrections = [tf_variable(c) for c in self.own_corrections(weights)]
        codec.assign(
            distribution, weights, means, corrections, scale, moved, own, cover.keep
        )
        for v, mean in zip(rest, means[len(weights) :], strict=True):
            distribution.extended.update(v, _updates.assign, args=(mean,), group=False)

    def _scale(self, gamma):
        """The corrections' factor ``correction / gamma`` (0 for 0)."""
        return tf.math.divide_no_nan(tf.constant(self._correction, gamma.dtype), gamma)

    def _count(self, restart=True):
        if restart:
            self._local_steps.value.assign(0)
        self._averages.value.assign_add(1)
        return tf.constant(True)
