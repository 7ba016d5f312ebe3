"""Streaming averages (``fragments=F``): each fragment of the trainable
variables averaged on its own schedule, so that an interval's averages each
send about 1/F of the model (``maths.simulate`` with ``fragments``).

Fragment ``j`` (a set of whole variables, `_fragments.partition`) falls due
after ``(j + 1) * interval // F`` local steps counted from a full average,
then every ``interval`` local steps (``maths.fragment_offsets``). Its average
covers its variables, their slots and corrections, and scales its
corrections by its own learning rates' sum; the model's averaged state rides
with the last fragment (the cadence of ``F = 1``), any stop vote with every
fragment. A full average (the epoch boundary's, before a synchronous step,
`SkipCorrectionOptimizer.average`) covers every fragment at once and starts
every fragment's schedule again from its offset.

While the host holds the interval (`steering.Steering.hold`), no fragment
falls due: the held interval's average is a full one, as with ``F = 1``.
The host holds only executions in which no fragment falls due.

The optimizer's scalar counters keep their meaning: ``local_steps`` is the
most local steps any fragment's weights hold unaveraged (0 exactly when no
fragment moved), ``gamma`` the last fragment's learning rates' sum.
Cross-replica context.
"""

from __future__ import annotations

import keras
import numpy as np
import tensorflow as tf

from keras_skip import _compat, _fragments, _overlap, _updates
from keras_skip.steering import read, tf_variable


class Streaming(_overlap.Sequential):
    """Each fragment's average runs after the step it falls due after.

    `members`: each fragment's variable indices (`_fragments.partition`);
    `index_of`: a trainable variable's index; `slots_of`: per trainable
    variable, its slot variables (the others travel with the last fragment);
    `local`, `gammas`, `fresh`, `apart`, `hold`, `outer_steps`: the
    fragments' variables (`build`); `gamma`, `slots_apart`: the optimizer's
    variables.
    """

    def __init__(
        self,
        local_steps,
        interval,
        *,
        members: list[list[int]],
        index_of,
        slots_of: list[list],
        gamma,
        slots_apart,
        local,
        gammas,
        fresh,
        apart,
        hold,
        outer_steps,
        carried=None,
        full_at=None,
    ):
        super().__init__(local_steps, interval, carried, full_at)
        self.members = members
        self._fragment_of = {i: j for j, m in enumerate(members) for i in m}
        self._index_of = index_of
        self._slot_fragment = {
            id(tf_variable(s)): self._fragment_of[i]
            for i, slots in enumerate(slots_of)
            for s in slots
        }
        self._gamma = gamma
        self._slots_apart = slots_apart
        self.local = local
        self.gammas = gammas
        self.fresh = fresh
        self.apart = apart
        self.hold = hold
        self.outer_steps = outer_steps

    @property
    def count(self) -> int:
        return len(self.members)

    def parts(self) -> list:
        return list(range(self.count))

    def may_hold(self, count: int) -> bool:
        # A held execution runs a train function of its own, with the full
        # average in place of the fragments' (`_step.LOCAL_HELD`): tracing
        # it costs more than the boundary average after the execution.
        return False

    def moved(self, fragment=None):
        if fragment is None:
            return super().moved()
        return self.local.value[fragment] > 0

    def steps_to_next_average(self) -> int:
        interval = int(read(self._interval))
        offsets = np.arange(1, self.count + 1) * interval // self.count
        due = np.where(read(self.fresh) > 0, offsets, interval)
        return int(np.min(due - read(self.local)))

    def weights(self, stepped: list, fragment=None) -> list:
        if fragment is None:
            return stepped
        return [v for v in stepped if self._fragment_of[self._index_of(v)] == fragment]

    def _moved_each(self):
        """Per fragment, whether its weights moved since its last average."""
        return self.local.value > 0

    def _fragments_of(self, weights) -> list[int]:
        return [self._fragment_of[self._index_of(v)] for v in weights]

    def cover(self, weights: list, include_slots: bool, fragment=None):
        if fragment is not None:
            return _overlap.Cover(self.moved(fragment))
        # A full average covers the fragments that moved or, with the slots,
        # whose slots are apart; the others it leaves as they are.
        moved = self._moved_each()
        selected = moved
        if include_slots:
            selected = tf.logical_or(moved, self.apart.value > 0)
        owner = self._fragments_of(weights)
        return _overlap.Cover(
            moved=[moved[j] for j in owner],
            keep=[tf.logical_not(selected[j]) for j in owner],
            groups=[
                [i for i, j in enumerate(owner) if j == fragment]
                for fragment in range(self.count)
            ],
            selected=selected,
        )

    def record_starts(self, period, distribution, variables) -> None:
        owner = self._fragments_of(variables)
        for j in range(self.count):
            part = [v for v, f in zip(variables, owner, strict=True) if f == j]
            if part:
                period.record_if_first(distribution, part, self.local.value[j] == 0)

    def outer_step(self, outer, distribution, moved, stepped: list, fragment=None):
        moved_each = self._moved_each()
        for j in range(self.count) if fragment is None else [fragment]:
            outer.after_average(
                distribution,
                moved if fragment is not None else moved_each[j],
                self.weights(stepped, j),
                steps=(self.outer_steps, j),
            )

    def slots(self, slots: list, fragment=None) -> list:
        if fragment is None:
            return slots
        last = self.count - 1
        return [s for s in slots if self._slot_fragment.get(id(s), last) == fragment]

    def carries_state(self, fragment=None) -> bool:
        return fragment is None or fragment == self.count - 1

    def gamma(self, fragment, weights: list):
        gammas = self.gammas.value
        if fragment is not None:
            return gammas[fragment]
        return [gammas[self._fragment_of[self._index_of(v)]] for v in weights]

    def count_step(self, distribution, lr) -> None:
        self.local.value.assign_add(tf.ones([self.count], tf.int64))
        distribution.extended.update(
            self.gammas.value, _add_to_each, args=(lr,), group=False
        )
        # A local step sets the slots apart (or not) for every fragment.
        self.apart.value.assign(tf.fill([self.count], self._slots_apart.value))

    def after_synchronous_step(self) -> None:
        self.fresh.value.assign(tf.ones([self.count], tf.int64))

    def _thresholds(self, interval):
        """Each fragment's local steps when it falls due (a tensor)."""
        offsets = tf.range(1, self.count + 1, dtype=tf.int64) * interval
        offsets //= self.count
        return tf.where(self.fresh.value > 0, offsets, interval)

    def _after_step(self, fragment: int, due, sent, average, average_overlapped):
        """Runs `fragment`'s average if it is `due` after the step."""
        return tf.cond(
            due,
            lambda: self._due(fragment, average, sent),
            _overlap.nothing,
            name="average_due",
        )

    def _due(self, fragment: int, average, sent):
        """The average of `fragment`, which falls due after this step."""
        return average(fragment)

    def after_step(self, sent, local_steps, average, average_overlapped):
        """Runs each due fragment's average, in fragment order; while held,
        the held interval's full average instead."""
        interval = self._interval.value

        def fragments():
            due = self.local.value >= self._thresholds(interval)
            ran = tf.constant(False)
            for j in range(self.count):
                ran_j = self._after_step(j, due[j], sent, average, average_overlapped)
                ran = tf.logical_or(ran, ran_j)
            return ran

        def held():
            return tf.cond(
                local_steps >= interval, average, _overlap.nothing, name="average_due"
            )

        if self.traced_hold is not None:
            return held() if self.traced_hold else fragments()
        return tf.cond(self.hold.value > 0, held, fragments, name="average_held")

    def after_average(self, overlapped: bool, fragment=None) -> None:
        count = self.count
        if fragment is None:
            self.local.value.assign(tf.zeros([count], tf.int64))
            self.gammas.value.assign(tf.zeros([count], self.gammas.dtype))
            self.fresh.value.assign(tf.ones([count], tf.int64))
            self.apart.value.assign(tf.fill([count], self._slots_apart.value))
            return
        at = [[fragment]]
        local = tf.tensor_scatter_nd_update(self.local.value, at, [0])
        gammas = self.gammas.value
        self.local.value.assign(local)
        self.gammas.value.assign(
            tf.tensor_scatter_nd_update(gammas, at, tf.zeros([1], gammas.dtype))
        )
        self.fresh.value.assign(tf.tensor_scatter_nd_update(self.fresh.value, at, [0]))
        # The slot policy cleared the optimizer's flag if this average made
        # the fragment's slots agree.
        agree = tf.minimum(self.apart.value[fragment], self._slots_apart.value)
        apart = tf.tensor_scatter_nd_update(self.apart.value, at, [agree])
        self.apart.value.assign(apart)
        self._slots_apart.value.assign(tf.reduce_max(apart))
        self._local_steps.value.assign(tf.reduce_max(local))
        self._gamma.value.assign(self.gammas.value[count - 1])


class StreamingOverlapped(Streaming):
    """`Streaming` with ``overlap=True``: the all-reduce of a fragment's
    average due after the step starts before it, on the values the step
    starts from, and its mean lands after the step, each replica keeping
    its step's displacement on top (``maths.simulate``'s overlapped
    average, per fragment). Until the fragment's next average includes that
    step, its weights carry it (`carried_each`, one flag per fragment; the
    optimizer's `carried` holds the most steps any fragment's weights hold
    beyond the local step count). A step the host made full (`full_at`)
    and a held interval overlap nothing."""

    def __init__(self, *args, carried_each, iterations, codec, payload, **kwargs):
        super().__init__(*args, **kwargs)
        self.carried_each = carried_each
        self._iterations = iterations
        self._codec = codec
        self._payload = payload

    def moved(self, fragment=None):
        carried = self.carried_each.value > 0
        if fragment is None:
            return tf.logical_or(super().moved(), tf.reduce_any(carried))
        return tf.logical_or(super().moved(fragment), carried[fragment])

    def _moved_each(self):
        return tf.logical_or(self.local.value > 0, self.carried_each.value > 0)

    def record_starts(self, period, distribution, variables) -> None:
        owner = self._fragments_of(variables)
        # After an overlapped average the weights hold a local step: the
        # period's start was recorded by that average.
        first = tf.logical_not(self._moved_each())
        for j in range(self.count):
            part = [v for v, f in zip(variables, owner, strict=True) if f == j]
            if part:
                period.record_if_first(distribution, part, first[j])

    def before_step(self, distribution):
        """Per fragment, the `_overlap.Sent` of its average if one is due
        after the step (its all-reduce started here), as
        `_overlap.Overlapped.before_step` does for the whole payload."""
        interval = self._interval.value
        due = self.local.value + 1 >= self._thresholds(interval)
        free = tf.logical_and(
            self._iterations.value != self.full_at.value, self.hold.value == 0
        )
        moved = self._moved_each()
        gammas = tf.identity(self.gammas.value)
        return [
            _overlap.start(
                distribution,
                self._codec,
                self._payload(j),
                due[j],
                tf.logical_and(due[j], free),
                moved[j],
                gammas[j],
            )
            for j in range(self.count)
        ]

    def _after_step(self, fragment: int, due, sent, average, average_overlapped):
        each = sent[fragment]
        return tf.cond(
            each.overlapped,
            lambda: average_overlapped(each, fragment),
            lambda: super(StreamingOverlapped, self)._after_step(
                fragment, due, None, average, average_overlapped
            ),
            name="average_overlapped",
        )

    def after_average(self, overlapped: bool, fragment=None) -> None:
        count = self.count
        if fragment is None:
            carried = tf.zeros([count], tf.int64)
        else:
            carried = tf.tensor_scatter_nd_update(
                self.carried_each.value, [[fragment]], [1 if overlapped else 0]
            )
        self.carried_each.value.assign(carried)
        super().after_average(overlapped, fragment)
        local = self.local.value
        self.carried.value.assign(tf.reduce_max(local + carried) - tf.reduce_max(local))

    def restart_gamma(self, distribution, fragment: int, lr) -> None:
        """The fragment's learning rates' sum restarts at `lr` (it holds the
        step its overlapped average ran alongside)."""
        distribution.extended.update(
            self.gammas.value,
            _assign_at,
            args=(fragment, lr),
            group=False,
        )
        self._gamma.value.assign(self.gammas.value[self.count - 1])


class StreamingDelayed(Streaming):
    """`Streaming` with ``overlap=k``: a due fragment's average is copied and
    sent while the next local steps compute (`_flight.Flight` reduces and
    lands it), as `_overlap.Delayed` does for the whole payload.

    One copy is on its way at a time. The graph copies fragment ``j`` only
    if the host armed it (`armed`: the steps of the coming execution), the
    step is not one the host made full (`full_at`), and no other fragment
    could fall due in the execution after this one, so that the copy can
    run beside at least one execution (``maths.simulate``'s rule); otherwise
    the fragment averages after the step. `pending_fragment`: the fragment
    of the copy on its way; `snapshot_gamma`, `snapshot_steps`: its
    learning rates' sum and local steps when copied.
    """

    delays = True

    def __init__(self, *args, iterations, buffers: _overlap.Buffers, payload, **kwargs):
        super().__init__(*args, **kwargs)
        self._iterations = iterations
        self._payload = payload
        self.buffers = buffers
        with buffers.strategy.scope():
            self.armed = _overlap.buffer((), tf.int64, "armed")
            self.pending = _overlap.buffer((), tf.int64, "pending")
            self.pending_fragment = _overlap.buffer((), tf.int64, "fragment")
            self.snapshot_gamma = _overlap.buffer((), self.gammas.dtype, "gamma")
            self.snapshot_steps = _overlap.buffer((), tf.int64, "steps")

    def _flying(self) -> int | None:
        """The fragment on its way, eagerly, or None."""
        if not int(self.pending.numpy()):
            return None
        return int(self.pending_fragment.numpy())

    def flying_fragment(self) -> int | None:
        return self._flying()

    def carried_steps(self) -> int:
        fragment = self._flying()
        if fragment is None:
            return 0
        local = read(self.local)
        held = int(local[fragment]) + int(self.snapshot_steps.numpy())
        return max(0, held - int(np.max(local)))

    def must_land(self, steps_per_execution: int, steps: int, held: bool) -> bool:
        fragment = self._flying()
        return (
            held
            or int(read(self._interval)) <= 1
            or int(read(self.local)[fragment]) >= steps
            or self.steps_to_next_average() <= steps_per_execution
        )

    def record_starts(self, period, distribution, variables) -> None:
        owner = self._fragments_of(variables)
        for j in range(self.count):
            part = [v for v, f in zip(variables, owner, strict=True) if f == j]
            if not part:
                continue
            # The period of a fragment on its way owns the start until it lands.
            in_flight = tf.logical_and(
                self.pending.value() > 0, self.pending_fragment.value() == j
            )
            first = tf.logical_and(self.local.value[j] == 0, tf.logical_not(in_flight))
            period.record_if_first(distribution, part, first)

    def before_step(self, distribution):
        return distribution, self._iterations.value != self.full_at.value

    def after_step(self, sent, local_steps, average, average_overlapped):
        if not self.buffers.ready:
            return super().after_step(None, local_steps, average, average_overlapped)
        return super().after_step(sent, local_steps, average, average_overlapped)

    def _due(self, fragment: int, average, sent):
        if sent is None:
            return average(fragment)
        interval = self._interval.value
        distribution, not_full = sent
        others = tf.where(
            tf.range(self.count) == fragment,
            interval,
            self._thresholds(interval) - self.local.value,
        )
        armed = self.armed.value()
        delayed = tf.reduce_all(
            tf.stack(
                [
                    armed > 0,
                    not_full,
                    self.pending.value() == 0,
                    tf.reduce_min(others) > armed,
                ]
            )
        )
        return tf.cond(
            delayed,
            lambda: self._snapshot(distribution, fragment),
            lambda: average(fragment),
            name="average_delayed",
        )

    def _snapshot(self, distribution, fragment: int):
        extended = distribution.extended
        _, _, payload = self._payload(fragment)
        values = extended.call_for_each_replica(
            lambda: [tf.identity(v) for v in payload]
        )
        for buffer, value in zip(
            self.buffers.snapshot_of(payload), values, strict=True
        ):
            extended.update(buffer, _updates.assign, args=(value,), group=False)
        at = [[fragment]]
        self.pending_fragment.assign(fragment)
        self.snapshot_gamma.assign(self.gammas.value[fragment])
        self.snapshot_steps.assign(self.local.value[fragment])
        local = tf.tensor_scatter_nd_update(self.local.value, at, [0])
        self.local.value.assign(local)
        gammas = self.gammas.value
        self.gammas.value.assign(
            tf.tensor_scatter_nd_update(gammas, at, tf.zeros([1], gammas.dtype))
        )
        self.fresh.value.assign(tf.tensor_scatter_nd_update(self.fresh.value, at, [0]))
        self._local_steps.value.assign(tf.reduce_max(local))
        self._gamma.value.assign(self.gammas.value[self.count - 1])
        self.armed.assign(0)
        self.pending.assign(1)
        return tf.constant(False)


def _assign_at(gammas, fragment, lr):
    value = tf.reshape(tf.cast(lr, gammas.dtype), [1])
    return gammas.assign(tf.tensor_scatter_nd_update(gammas, [[fragment]], value))


def _add_to_each(gammas, lr):
    return gammas.assign_add(tf.fill(tf.shape(gammas), tf.cast(lr, gammas.dtype)))


def build(
    add_variable,
    fragments: int,
    var_list: list,
    *,
    inner,
    local_steps,
    interval,
    index_of,
    gamma,
    slots_apart,
    slots: list,
    base: _overlap.Sequential,
    payload,
    iterations,
    codec,
) -> Streaming:
    """The schedule of `fragments` > 1 fragments of `var_list`, its variables
    made with the optimizer's `add_variable` (`slots`: the inner
    optimizer's slot variables; after every other variable of
    the optimizer: a checkpoint's variables are positional). `base`: the
    schedule `_overlap.build` chose, whose overlap variables it takes (and
    delays if it does); `payload(fragment)`: what an average of `fragment`
    sends, as `_averager.Averager.payload` returns it; `iterations`: the
    optimizer's step counter; `codec`: the optimizer's codec."""
    sizes = [int(np.prod(v.shape)) * tf.as_dtype(v.dtype).size for v in var_list]
    members = _fragments.partition(sizes, fragments)
    counter = keras.initializers.Zeros()
    ones = keras.initializers.Ones()
    shape = (fragments,)
    kind, delayed = Streaming, {}
    if base.delays:
        kind = StreamingDelayed
        delayed = dict(iterations=iterations, buffers=base.buffers, payload=payload)
    elif isinstance(base, _overlap.Overlapped):
        kind = StreamingOverlapped
        delayed = dict(
            carried_each=add_variable(
                shape, counter, dtype="int64", name="fragment_carried"
            ),
            iterations=iterations,
            codec=codec,
            payload=payload,
        )
    return kind(
        local_steps,
        interval,
        members=members,
        index_of=index_of,
        slots_of=_compat.slots_by_variable(inner, var_list, slots),
        gamma=gamma,
        slots_apart=slots_apart,
        local=add_variable(shape, counter, dtype="int64", name="fragment_local_steps"),
        gammas=add_variable(
            shape,
            counter,
            dtype=_updates.learning_rate_dtype(inner),
            name="fragment_gamma",
        ),
        fresh=add_variable(shape, ones, dtype="int64", name="fragment_fresh"),
        apart=add_variable(shape, counter, dtype="int64", name="fragment_slots_apart"),
        hold=add_variable((), counter, dtype="int64", name="fragment_hold"),
        outer_steps=add_variable(
            shape, counter, dtype="int64", name="fragment_outer_steps"
        ),
        carried=base.carried,
        full_at=base.full_at,
        **delayed,
    )
