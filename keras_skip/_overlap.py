"""When a local step's due average runs: after the step, alongside it, or
alongside the next steps.

`Sequential` averages after the step the average is due after. `Overlapped`
(``overlap=True`` on several replicas) starts the due interval average's
all-reduce before the step, on the values the step starts from, so that it
runs while the step computes; the mean lands after the step, and each
replica keeps its step's displacement on top (``maths.overlapped_average``).
Until the next average includes that step, the weights *carry* it.
`Delayed` (``overlap=k``, k >= 2) copies what the due average sends into
buffers and starts the next period; `_flight.Flight` all-reduces the copy
while the next steps compute and lands it later (``maths.overlapped_average``).
Chosen when the optimizer is built. Cross-replica context.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import keras
import tensorflow as tf

from keras_skip import _updates
from keras_skip.steering import read


class Cover(NamedTuple):
    """What one average covers, for the codec, the drift and the outer step.

    `moved`: whether the weights moved (a boolean tensor), or a list of one
    per weight; `keep`: None, or per weight whether the average leaves it
    as it is (sends nothing of it); `groups`, `selected`: None, or the
    weights' indices of each fragment and whether the average covers it (a
    boolean tensor per fragment), for a drift per fragment."""

    moved: object
    keep: list | None = None
    groups: list | None = None
    selected: object = None


class Sent(NamedTuple):
    """An overlapped average's state, taken before the local step."""

    due: tf.Tensor  # an average is due after the step
    overlapped: tf.Tensor  # ... and it is the overlapped one, started here
    moved: tf.Tensor  # the weights had moved since the last average
    gamma: tf.Tensor  # the learning rates' sum before the step
    snapshot: list  # per replica: the payload before it
    means: list  # the payload's means (empty when not overlapped)


def nothing():
    return tf.constant(False)


class Sequential:
    """A due average runs after the step. `local_steps` and `interval`: the
    optimizer's counter and interval variables.

    Every average covers the whole payload: the `fragment` its hooks take is
    always None (`_streaming.Streaming` averages fragments of it)."""

    #: With fragments: the variable that holds the fragments' averages while
    #: the interval is held (`_streaming.Streaming`); None here.
    hold = None
    #: With fragments: while a train function traces, whether every step it
    #: runs is held (`_streaming.Streaming.after_step`); None here.
    traced_hold = None
    #: Whether due averages may be copied and sent later (`_flight.Flight`).
    delays = False

    def __init__(self, local_steps, interval, carried=None, full_at=None):
        self._local_steps = local_steps
        self._interval = interval
        # With `overlap` (on one replica they stay at rest): the variables
        # `Overlapped` describes; else None.
        self.carried = carried
        self.full_at = full_at

    def carried_steps(self) -> int:
        """The local steps the weights hold that no average has included, on
        top of the counter (eagerly)."""
        return 0 if self.carried is None else int(self.carried.numpy())

    def parts(self) -> list:
        """The `fragment` values the per-fragment hooks take: None alone here
        (the whole payload), each fragment's index with fragments."""
        return [None]

    def moved(self, fragment=None):
        """Whether the weights moved since the last average (a boolean tensor)."""
        return self._local_steps.value > 0

    def steps_to_next_average(self) -> int:
        """Local steps until the next interval average is due (eagerly)."""
        return int(read(self._interval)) - int(read(self._local_steps))

    def may_hold(self, count: int) -> bool:
        """Whether the host may hold the interval for an execution of
        `count` steps that ends with a full average (eagerly)."""
        return True

    def weights(self, stepped: list, fragment=None) -> list:
        """The variables of `stepped` an average of `fragment` covers."""
        return stepped

    def cover(self, weights: list, include_slots: bool, fragment=None) -> Cover:
        """What an average of `fragment` (None: a full one) of `weights`
        covers, before it changes anything."""
        return Cover(self.moved())

    def record_starts(self, period, distribution, variables) -> None:
        """Records the period's start of `variables` where a period begins
        with the coming local step."""
        period.record_if_first(distribution, variables, self.first_of_period())

    def outer_step(self, outer, distribution, moved, stepped: list, fragment=None):
        """The outer step after an average of `fragment` (`moved`: its
        cover's; `stepped`: the variables the steps update)."""
        outer.after_average(distribution, moved, stepped)

    def slots(self, slots: list, fragment=None) -> list:
        """The slot variables of `slots` an average of `fragment` covers."""
        return slots

    def carries_state(self, fragment=None) -> bool:
        """Whether an average of `fragment` carries the model's state."""
        return True

    def gamma(self, fragment, weights: list):
        """The learning rates' sum that scales the corrections of `weights`
        (an average of `fragment`): one for all, a list of one per weight,
        or None for the optimizer's `gamma`."""
        return None

    def count_step(self, distribution, lr) -> None:
        """After the local step's counter rose (`lr`: its learning rate)."""

    def after_synchronous_step(self) -> None:
        pass

    def first_of_period(self):
        """Whether the coming local step is its period's first."""
        return self._local_steps.value == 0

    def before_step(self, distribution) -> Sent | None:
        return None

    def after_step(self, sent, local_steps, average, average_overlapped):
        """Runs `average()` if one is due after the step (`local_steps`: the
        counter after it). The conditions' names tell the averages apart in
        the graph: tests check that a local step communicates in them only."""
        return tf.cond(
            local_steps >= self._interval.value, average, nothing, name="average_due"
        )

    def after_average(self, overlapped: bool, fragment=None) -> None:
        pass


class Overlapped(Sequential):
    """A due interval average runs alongside the step, unless the host asked
    for a full one at this step (`full_at`: an epoch's last step, an
    overridden interval's average). `carried`: 1 while the weights hold the
    step an overlapped average ran alongside. `payload()` returns the
    optimizer's ``(weights, slots, payload)``; `codec` is its codec."""

    def __init__(
        self,
        local_steps,
        interval,
        *,
        carried,
        full_at,
        iterations,
        gamma,
        codec,
        payload: Callable[[], tuple[list, list, list]],
    ):
        super().__init__(local_steps, interval, carried, full_at)
        self._iterations = iterations
        self._gamma = gamma
        self._codec = codec
        self._payload = payload

    def moved(self, fragment=None):
        return tf.logical_or(super().moved(), self.carried.value > 0)

    def first_of_period(self):
        # After an overlapped average the weights hold a local step: the
        # period's start was recorded by that average.
        return tf.logical_and(super().first_of_period(), self.carried.value == 0)

    def before_step(self, distribution) -> Sent:
        """Reads what an average would send (the values before the step)
        and, if an overlapped average is due after the step, starts its
        all-reduce. Nothing here writes a variable the step touches, and the
        step writes nothing read here after these reads, so the runtime runs
        the all-reduce while the step's forward and backward pass compute."""
        due = self._local_steps.value + 1 >= self._interval.value
        overlapped = tf.logical_and(due, self._iterations.value != self.full_at.value)
        return start(
            distribution,
            self._codec,
            self._payload(),
            due,
            overlapped,
            self.moved(),
            tf.identity(self._gamma.value),
        )

    def after_step(self, sent, local_steps, average, average_overlapped):
        return tf.cond(
            sent.overlapped,
            lambda: average_overlapped(sent),
            lambda: tf.cond(sent.due, average, nothing, name="average_due"),
            name="average_overlapped",
        )

    def after_average(self, overlapped: bool, fragment=None) -> None:
        self.carried.value.assign(1 if overlapped else 0)


def start(distribution, codec, sent, due, overlapped, moved, gamma) -> Sent:
    """Reads the payload of `sent` (``(weights, slots, payload)``) and, if
    `overlapped` (a boolean tensor), starts its all-reduce through `codec`:
    the `Sent` of an overlapped average (`due`, `moved`, `gamma`: as it
    holds them)."""
    extended = distribution.extended
    weights, _, payload = sent
    # Read only when due: the step's update then copies what it writes.
    values = _updates.when(
        distribution,
        overlapped,
        lambda: extended.call_for_each_replica(
            lambda: [tf.identity(v) for v in payload]
        ),
        payload,
    )
    rest = payload[len(weights) :]

    def send():
        per_replica = codec.send(distribution, weights, rest, moved, values)
        return codec.reduce(distribution, weights, rest, per_replica)

    dtypes = codec.wire_types(weights)
    means = _updates.when(distribution, overlapped, send, payload, dtypes)
    return Sent(due, overlapped, moved, gamma, values, means)


#: Wire types whose means are held in a wider type: a variable made under
#: MultiWorkerMirroredStrategy is broadcast from the chief at creation, and
#: TensorFlow's collective broadcast has no bfloat16 kernel. float32 holds a
#: bfloat16 value exactly.
_HELD_AS = {tf.bfloat16: tf.float32}


class Buffers:
    """What a delayed average sends, per payload variable: each replica's
    copy (`snapshot_of`) and, once the all-reduce is done, the means
    (`means_of`, in the codec's wire type for the weights). Plain variables
    made between executions (`create`), not saved: a flight lands before
    any save."""

    def __init__(self, strategy):
        self.strategy = strategy
        self._snapshots: dict[int, tf.Variable] = {}
        self._means: dict[int, tf.Variable] = {}
        self._shapes: dict[int, tf.TensorShape] = {}

    @property
    def ready(self) -> bool:
        return bool(self._snapshots)

    def create(self, weights, rest, wire_types) -> None:
        """Buffers for `weights` (the variables the steps may update) and
        `rest` of the payload, where none exist yet (eagerly)."""
        types = list(wire_types) + [None] * (len(weights) + len(rest))
        with self.strategy.scope():
            for v, dtype in zip(weights + rest, types, strict=False):
                key = id(v)
                if key in self._snapshots:
                    continue
                dtype = _HELD_AS.get(dtype, dtype or v.dtype)
                self._snapshots[key] = _filled_here(v.shape, v.dtype, "snapshot")
                self._means[key] = _filled_here(v.shape, dtype, "mean")
                self._shapes[id(self._snapshots[key])] = v.shape
                self._shapes[id(self._means[key])] = v.shape

    def read(self, distribution, buffers) -> list:
        """Each replica's own value of `buffers` (distributed values)."""
        shapes = [self._shapes[id(b)] for b in buffers]

        def read():
            values = [b.read_value() for b in buffers]
            for value, shape in zip(values, shapes, strict=True):
                value.set_shape(shape)
            return values

        return distribution.extended.call_for_each_replica(read)

    def snapshot_of(self, payload) -> list:
        return [self._find(self._snapshots, v) for v in payload]

    def means_of(self, payload) -> list:
        return [self._find(self._means, v) for v in payload]

    @staticmethod
    def _find(buffers, v):
        try:
            return buffers[id(v)]
        except KeyError:
            raise RuntimeError(
                f"overlap: the variable {v.name!r} joined the averaged state "
                "after training began; build the model and its optimizer "
                "before the first `fit`."
            ) from None


def _filled_here(shape, dtype, name):
    """A buffer of `shape` whose zeros are written on each replica.

    Under MultiWorkerMirroredStrategy a variable's initial value is
    broadcast from worker 0; the buffers hold twice the model, which would
    cross the links once for nothing. So each is created empty, of no fixed
    shape, and then assigned its zeros everywhere at once, which sends
    nothing. `Buffers.read` gives the values their static shape back."""
    variable = tf.Variable(
        tf.zeros([0], dtype),
        shape=tf.TensorShape(None),
        trainable=False,
        name=f"delayed_{name}",
        synchronization=tf.VariableSynchronization.ON_WRITE,
        aggregation=tf.VariableAggregation.NONE,
    )
    variable.assign(tf.zeros(shape, dtype))
    return variable


def buffer(shape, dtype, name):
    """A variable of each replica's own, not saved (a delayed average's
    flags and counts)."""
    return tf.Variable(
        tf.zeros(shape, dtype),
        trainable=False,
        name=f"delayed_{name}",
        synchronization=tf.VariableSynchronization.ON_WRITE,
        aggregation=tf.VariableAggregation.NONE,
    )


class Delayed(Sequential):
    """A due interval average sent while the next local steps compute.

    At the due step the graph copies the payload into `buffers` and starts
    the next period (`local_steps` and the learning rates' sum `gamma` count
    from there); nothing is exchanged in the step. The host all-reduces the
    copies in a thread and lands the means between two executions of the
    train function (`_flight.Flight`). The graph takes a copy only while the
    host `armed` it (`model.fit` does, between executions); otherwise, in a
    custom training loop, and at a step the host made a full one
    (`full_at`), a due average runs after the step as `Sequential`'s does.
    `pending`: 1 from the copy until it lands; `snapshot_gamma`: the
    learning rates' sum of the period the copy ends.
    """

    def __init__(
        self,
        local_steps,
        interval,
        *,
        carried,
        full_at,
        iterations,
        gamma,
        buffers: Buffers,
        payload: Callable[[], tuple[list, list, list]],
    ):
        super().__init__(local_steps, interval, carried, full_at)
        self._iterations = iterations
        self._gamma = gamma
        self._payload = payload
        self.buffers = buffers
        with buffers.strategy.scope():
            self.armed = buffer((), tf.int64, "armed")
            self.pending = buffer((), tf.int64, "pending")
            self.snapshot_gamma = buffer((), gamma.dtype, "gamma")
            self.snapshot_steps = buffer((), tf.int64, "steps")

    delays = True

    def carried_steps(self) -> int:
        # While a copy is on its way, the steps of the period it ended are
        # in no average yet.
        if not int(self.pending.numpy()):
            return 0
        return int(self.snapshot_steps.numpy())

    def flying_fragment(self) -> int | None:
        """The fragment whose copy is on its way (None: the whole payload)."""
        return None

    def must_land(self, steps_per_execution: int, steps: int, held: bool) -> bool:
        """Whether the copy on its way must land before the coming execution
        of `steps_per_execution` steps (`steps`: the optimizer's `overlap`;
        `held`: the host holds the interval), eagerly: it has run beside
        `steps` local steps, or the next average could fall due in it."""
        local_steps = int(read(self._local_steps))
        return local_steps >= steps or local_steps + steps_per_execution >= read(
            self._interval
        )

    def first_of_period(self):
        # While a copy is on its way, the period it ended still owns the
        # period's start (compression and the outer step read it); the
        # landing records the next one.
        return tf.logical_and(super().first_of_period(), self.pending.value() == 0)

    def before_step(self, distribution):
        # Read before the step, as `Overlapped` does: the step counts.
        return distribution, self._iterations.value != self.full_at.value

    def after_step(self, sent, local_steps, average, average_overlapped):
        if not self.buffers.ready:
            return super().after_step(sent, local_steps, average, average_overlapped)
        distribution, not_full = sent

        def due():
            delayed = tf.logical_and(self.armed.value() > 0, not_full)
            return tf.cond(
                delayed,
                lambda: self._snapshot(distribution),
                average,
                name="average_delayed",
            )

        return tf.cond(
            local_steps >= self._interval.value, due, nothing, name="average_due"
        )

    def _snapshot(self, distribution):
        extended = distribution.extended
        _, _, payload = self._payload()
        values = extended.call_for_each_replica(
            lambda: [tf.identity(v) for v in payload]
        )
        for buffer, value in zip(
            self.buffers.snapshot_of(payload), values, strict=True
        ):
            extended.update(buffer, _updates.assign, args=(value,), group=False)
        self.snapshot_gamma.assign(self._gamma.value.read_value())
        self.snapshot_steps.assign(self._local_steps.value.read_value())
        self._gamma.value.assign(0.0)
        self._local_steps.value.assign(0)
        self.armed.assign(0)
        self.pending.assign(1)
        return tf.constant(False)


def build(add_variable, overlap: int, replicas: int, local_steps, interval, **parts):
    """`Sequential`, or with `overlap` `Overlapped` (1) or `Delayed` (2 or
    more) on several replicas (`parts`: their other arguments). The
    variables of overlap are made with the optimizer's `add_variable`
    whatever the number of replicas and steps (a checkpoint's variables do
    not depend on them); on one replica nothing overlaps and they stay at
    rest."""
    if not overlap:
        return Sequential(local_steps, interval)
    # 1 while the weights hold the local step an overlapped average ran
    # alongside, which no average has included yet.
    carried = add_variable((), dtype="int64", name="carried_step")
    # The step (iteration) whose due average must be a full one, as the host
    # arranged it (an epoch's last step, an overridden interval's average),
    # or -1.
    full_at = add_variable(
        (),
        initializer=keras.initializers.Constant(-1),
        dtype="int64",
        name="full_average_step",
    )
    if replicas == 1:
        return Sequential(local_steps, interval, carried, full_at)
    buffers = parts.pop("buffers")
    if overlap == 1:
        return Overlapped(
            local_steps, interval, carried=carried, full_at=full_at, **parts
        )
    return Delayed(
        local_steps,
        interval,
        carried=carried,
        full_at=full_at,
        iterations=parts["iterations"],
        gamma=parts["gamma"],
        buffers=buffers,
        payload=parts["payload"],
    )
