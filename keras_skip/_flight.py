"""Delayed averages on the host: a due average's all-reduce runs in a thread
while the next local steps compute, and lands between two executions.

With ``overlap=k`` (k >= 2) on several replicas, `model.fit` arms the graph
before an execution; at the due step the graph copies what the average
sends and starts the next period (`_overlap.Delayed`). After that execution
a thread all-reduces the copy, with no variable the steps touch, and the
train function goes on. Before each later execution the host decides, from
the counters every worker shares, whether the mean must land now: once the
weights hold at least `steps` local steps past the copy, before an
execution that could reach the next due average, and before anything else
that reads or averages the weights (`land`): a boundary average, a save, a
stop vote. Landing waits for the thread, then applies
``maths.overlapped_average`` on every replica; it exchanges nothing, so each
worker lands on its own. One flight at a time: the graph is armed only when
no copy is on its way and the interval is longer than an execution, so two
averages can never fall due in one execution.
"""

from __future__ import annotations

import threading

import tensorflow as tf

from keras_skip import _checks, _compat, _overlap, _updates, _worker_reduce, tracing
from keras_skip.steering import read, write


class Flight:
    """The host side of `_overlap.Delayed` for one optimizer.

    `schedule`: the `Delayed` schedule; `averager`: the `_averager.Averager`;
    `codec`: its codec; `steps`: the local steps an all-reduce may run
    beside; `interval`, `local_steps`: the optimizer's variables; `held()`:
    whether the interval variable holds a due count that is not the
    interval (`Steering.hold`).
    """

    def __init__(
        self,
        *,
        strategy,
        steps: int,
        schedule,
        averager,
        codec,
        interval,
        local_steps,
        held=lambda: False,
    ):
        self._strategy = strategy
        self._steps = steps
        self._schedule = schedule
        self._averager = averager
        self._codec = codec
        self._interval = interval
        self._local_steps = local_steps
        self._held = held
        self._armed = False
        self._flying = False  # a copy's all-reduce started, its mean not landed
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        # The traced all-reduce and landing, per fragment in flight (None:
        # the whole payload), each traced at its first use.
        self._reduce: dict = {}
        self._land: dict = {}
        self._fragment: int | None = None
        self._warned = False
        #: Whether the train function's steps exchange nothing, so that an
        #: all-reduce may run beside them: False under several workers that
        #: agree at every step on whether data remains (`fit` sets it).
        self.steps_exchange_nothing = not _compat.is_multi_worker(strategy)
        #: Whether the all-reduce runs in a thread beside the steps: across
        #: workers, and on one worker with several devices. Collectives that
        #: join several devices of one worker, run beside its steps, were
        #: seen to wait for good (3 runs in 13 with 4 logical CPU devices on
        #: 2 cores), and so were the strategy's own collectives across
        #: workers: a compressed average's two all-reduces (the 16-bit
        #: weights, then the rest in its own types), and once a plain
        #: average with one device per worker on 2 busy cores. So a worker
        #: with several devices reduces through its first, on one worker
        #: with `tf.distribute.ReductionToOneDevice` (none in 40); across
        #: workers every delayed average goes through one collective per
        #: worker and dtype, in its own group and order (`_worker_reduce`).
        devices = len(strategy.extended.worker_devices)
        across_workers = _compat.is_multi_worker(strategy)
        self.threaded = across_workers or devices > 1
        #: How the thread reduces; None on one device, where nothing runs
        #: in a thread and the strategy reduces.
        self._through = None
        if across_workers:
            self._through = _worker_reduce.ThroughOneDevicePerWorker(strategy)
        elif devices > 1:
            self._through = tf.distribute.ReductionToOneDevice(
                reduce_to_device=strategy.extended.worker_devices[0]
            )

    @property
    def in_flight(self) -> bool:
        """Whether an all-reduce started and its mean has not landed."""
        return self._flying

    def before_execution(self, steps_per_execution: int) -> None:
        """Lands the mean if the coming execution needs it, then arms the
        graph for the next copy if none is on its way."""
        if self._flying and self._schedule.must_land(
            steps_per_execution, self._steps, self._held()
        ):
            self.land()
        if not self._flying and not self._armed:
            self._arm(steps_per_execution)

    def after_execution(self) -> None:
        """Starts the all-reduce of a copy the execution took."""
        if self._armed and read(self._schedule.pending):
            self._armed = False
            self._start()

    def land(self) -> bool:
        """Waits for the all-reduce on its way, if any, and applies its mean
        on every replica (eagerly). Returns whether one landed. Raises if
        the all-reduce failed: the replicas then stay apart until the next
        average."""
        self.disarm()
        if not self._flying:
            return False
        if self._thread is not None:
            with tracing.span("wait", "average"):
                self._thread.join()
            self._thread = None
        self._flying = False
        error, self._error = self._error, None
        if error is not None:
            write(self._schedule.pending, 0)
            raise _failure(error) from error
        with self._strategy.scope(), tracing.span("land", "average"):
            fragment = self._fragment
            if fragment not in self._land:
                self._land[fragment] = _updates.function(self._land_body, fragment)
            self._land[fragment]()
        return True

    def disarm(self) -> None:
        """Takes back the graph's permission to copy an average (between
        executions: a `fit` ended, or something outside `fit` may step)."""
        if self._armed:
            write(self._schedule.armed, 0)
            self._armed = False

    def _arm(self, steps_per_execution: int) -> None:
        if not self.steps_exchange_nothing:
            # Two collectives at once, from two threads, can wait on each
            # other for good; the averages run after their step instead.
            self._warn(
                "the workers agree at every step on whether data remains (a "
                "dataset of unknown length, or batches that do not fill "
                "every execution); give `steps_per_epoch`, or data of known "
                "length in full batches"
            )
            return
        # Before any train function traces, even one that cannot delay now:
        # a function traced without the buffers never copies an average (the
        # adaptive probe's held rounds, an interval raised later).
        self._create_buffers()
        interval = int(read(self._interval))
        if interval > steps_per_execution:
            # The graph copies an average only if none of the next
            # `steps_per_execution` steps could need it landed.
            write(self._schedule.armed, steps_per_execution)
            self._armed = True
        elif interval > 1 and not self._held():
            # Held, the variable counts the steps to the boundary average
            # that ends the epoch's last execution: nothing to delay there.
            self._warn(
                f"the interval ({interval}) is not longer than "
                f"steps_per_execution ({steps_per_execution})"
            )

    def _warn(self, reason: str) -> None:
        if not self._warned:
            self._warned = True
            _checks.warn_at_caller(
                f"overlap={self._steps}: {reason}. Averages run after their "
                "step instead of beside the next ones."
            )

    def _create_buffers(self) -> None:
        """The payload's buffers, once (eagerly). A train function traced
        before they existed takes no copies (it averages after the step)."""
        buffers: _overlap.Buffers = self._schedule.buffers
        if buffers.ready:
            return
        weights, _, payload = self._averager.payload(include_slots=False)
        with tracing.span("create buffers", "average"):
            buffers.create(
                weights, payload[len(weights) :], self._codec.wire_types(weights)
            )

    def _start(self) -> None:
        self._fragment = fragment = self._schedule.flying_fragment()
        with self._strategy.scope():
            if fragment not in self._reduce:
                # Traced here, at the same point on every worker (they copy
                # the same fragments in the same order): the collective's
                # keys then agree.
                self._reduce[fragment] = _updates.function(self._reduce_body, fragment)
                self._reduce[fragment].get_concrete_function()
        reduce = self._reduce[fragment]
        strategy = self._strategy
        track = tracing.ALL_REDUCE if self.threaded else tracing.STEPS
        tracing.instant("copy", "average")

        def run():
            try:
                with (
                    strategy.scope(),
                    tracing.span("all-reduce", "average", track, beside=self.threaded),
                ):
                    reduce()
            except BaseException as error:  # re-raised by `land`
                self._error = error

        self._flying = True
        if not self.threaded:
            run()
            return
        self._thread = threading.Thread(
            target=run, name="keras-skip-delayed-average", daemon=True
        )
        self._thread.start()

    def _reduce_body(self, fragment):
        distribution = tf.distribute.get_strategy()
        extended = distribution.extended
        weights, _, payload = self._averager.payload(False, fragment)
        buffers = self._schedule.buffers
        values = buffers.read(distribution, buffers.snapshot_of(payload))
        rest = payload[len(weights) :]
        per_replica = self._codec.send(
            distribution, weights, rest, tf.constant(True), values
        )
        means = self._codec.reduce(
            distribution, weights, rest, per_replica, through=self._through
        )
        for buffer, mean in zip(buffers.means_of(payload), means, strict=True):
            extended.update(buffer, _updates.assign, args=(mean,), group=False)

    def _land_body(self, fragment):
        distribution = tf.distribute.get_strategy()
        _, _, payload = self._averager.payload(False, fragment)
        buffers = self._schedule.buffers
        snapshot = buffers.read(distribution, buffers.snapshot_of(payload))
        means = buffers.read(distribution, buffers.means_of(payload))
        sent = _overlap.Sent(
            due=tf.constant(True),
            overlapped=tf.constant(True),
            moved=tf.constant(True),
            gamma=self._schedule.snapshot_gamma.read_value(),
            snapshot=snapshot,
            means=means,
        )
        self._averager.average_delayed(distribution, sent, fragment)
        self._schedule.pending.assign(0)


def build(strategy, schedule, averager, steps: int, optimizer) -> Flight | None:
    """The host side of `schedule` if it is `_overlap.Delayed` (`steps`: the
    optimizer's ``overlap``), else None; `optimizer`: the one built."""
    if not schedule.delays:
        return None
    flight = Flight(
        strategy=strategy,
        steps=steps,
        schedule=schedule,
        averager=averager,
        codec=optimizer._codec,
        interval=optimizer._interval_variable,
        local_steps=optimizer._local_steps,
        held=lambda: optimizer.steering.held,
    )
    optimizer.steering.delays_beside_steps = lambda: flight.steps_exchange_nothing
    return flight


def land_before_checkpoint(flight: Flight | None, save_type: str) -> None:
    """Lands a mean on its way before `tf.train.Checkpoint` reads the
    optimizer's state: it walks the objects to save (`_trackable_children`)
    before it reads any value, so the file holds no half-finished average.
    A restore walks them too, and its values then overwrite the landed ones."""
    if flight is not None and save_type == "checkpoint" and tf.executing_eagerly():
        flight.land()


#: What a collective raises when a peer worker stopped or cannot be reached
#: (heartbeats missed, a socket closed, the collective aborted).
_PEER_LOST = (
    tf.errors.UnavailableError,
    tf.errors.DeadlineExceededError,
    tf.errors.CancelledError,
    tf.errors.AbortedError,
)


def _failure(error: BaseException) -> RuntimeError:
    """The error `land` raises for an all-reduce that failed with `error`."""
    if isinstance(error, _PEER_LOST):
        return RuntimeError(
            "A peer worker stopped or became unreachable while a delayed "
            "average (overlap) was on its way: its all-reduce failed, and "
            "this worker cannot train on without that peer. Restart every "
            "worker with the same command; with keras_skip.BackupAndRestore "
            "among the callbacks they resume from the last epoch every worker "
            f"backed up, exactly. The cause: {_describe(error)}"
        )
    return RuntimeError(
        "A delayed average (overlap) failed in its all-reduce: its mean did "
        "not land, and the replicas differ until the next average. The "
        f"cause: {_describe(error)}"
    )


def _describe(error: BaseException) -> str:
    # A TensorFlow error's repr holds no message ("UnavailableError()").
    return f"{type(error).__name__}: {error}"
