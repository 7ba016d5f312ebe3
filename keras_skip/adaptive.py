"""Choosing the interval once, from the timing of the first steady-state steps.

:class:`IntervalProbe` measures ``t_comp`` (one local step, no communication)
and ``t_comm`` (one average of the exact payload an average sends), takes the
maximum of each over every worker, and sets the interval to
:func:`keras_skip.maths.adaptive_interval` of the two. The decision is stored
in the optimizer, so checkpoints keep it and a resumed run does not probe
again. :class:`keras_skip.AdaptiveIntervalCallback` runs the probe inside
``model.fit``.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

import numpy as np
import tensorflow as tf

from keras_skip import _checks, maths

#: The interval used while probing: every step of the probe is a local step.
PROBE_INTERVAL = 2**62


@dataclasses.dataclass(frozen=True)
class IntervalDecision:
    """The interval chosen by the adaptive rule, and the times it came from.

    Attributes:
        interval: The chosen interval ``H*``.
        t_comp: Seconds of one local step (maximum over workers).
        t_comm: Seconds of one average (maximum over workers).
    """

    interval: int
    t_comp: float
    t_comm: float


class IntervalProbe:
    """Times local steps and one average, agrees across workers, sets the interval.

    The probe runs two rounds. Each is one run of local steps (the interval
    is set so that none of them averages) followed by a *probe average*: a
    compiled function that averages the replicas, times that average inside
    the graph, and then all-reduces every replica's timings (its round's
    duration and its average's duration) so that all workers get the same
    numbers. The first round sets the function and its collectives up (their
    first run includes one-time work) and is not used; the second gives the
    decision (see :func:`decide`).

    The averages are training (they average the model the local steps
    moved). What only choosing costs is tracing the probe average, the
    timing all-reduce of each round (``16 n`` bytes per replica for ``n``
    replicas) and a little Python.


    Usage: for each round call :meth:`start` before the local steps and
    :meth:`finish` after them with their number. Every worker must call both
    at the same steps. After the second :meth:`finish`, :attr:`decision`
    holds the result and the optimizer's interval is set.
    """

    def __init__(self, optimizer, target_ratio: float = 1.0, max_interval: int = 64):
        self.optimizer = optimizer
        self.target_ratio = target_ratio
        self.max_interval = max_interval
        self.decision: IntervalDecision | None = None
        self.rounds = 0
        #: Seconds, collectives and bytes per replica spent only on choosing.
        self.overhead_seconds = 0.0
        self.collectives = 0
        self.bytes_sent = 0
        begin = time.perf_counter()
        self._function = _probe_average_function(optimizer)
        # Tracing the probe average is work only choosing does.
        self.overhead_seconds += time.perf_counter() - begin

        self._start: float | None = None

    def start(self) -> None:
        self.optimizer.interval = PROBE_INTERVAL
        self._start = time.perf_counter()

    def finish(self, steps: int) -> IntervalDecision | None:
        if self._start is None:
            raise RuntimeError("IntervalProbe.finish() called before start().")
        optimizer = self.optimizer
        optimizer.iterations.numpy()  # waits for the steps to complete
        round_seconds = time.perf_counter() - self._start
        self._start = None
        strategy = optimizer._distribution_strategy
        with strategy.scope():
            measured, exchange_seconds = self._function(
                tf.constant(round_seconds, tf.float64)
            )
        begin = time.perf_counter()
        measured = measured.numpy()
        self.rounds += 1
        self.collectives += 1
        self.bytes_sent += measured.size * 8
        if self.rounds == 1:
            self.overhead_seconds += (
                float(exchange_seconds) + time.perf_counter() - begin
            )
            return None
        self.decision = decide(measured, steps, self.target_ratio, self.max_interval)
        optimizer._record_interval_decision(self.decision)
        self.overhead_seconds += float(exchange_seconds) + time.perf_counter() - begin
        return self.decision


def _probe_average_function(optimizer):
    """The compiled probe average: average, time it, all-reduce the timings.

    Returns ``(measured, exchange_seconds)``: ``measured[r]`` is replica
    ``r``'s ``(round_seconds, average_seconds)``, and ``exchange_seconds`` how
    long the timing all-reduce took on this worker.
    """
    strategy = optimizer._distribution_strategy
    n = strategy.num_replicas_in_sync

    @tf.function(autograph=False)
    def probe_average(round_seconds):
        distribution = tf.distribute.get_strategy()
        extended = distribution.extended
        start = tf.timestamp()
        with tf.control_dependencies([start]):
            averaged = optimizer._average_if_pending(distribution)
        with tf.control_dependencies([averaged]):
            end = tf.timestamp()
        timings = tf.stack([round_seconds, end - start])

        def place_in_own_row():
            replica = tf.distribute.get_replica_context().replica_id_in_sync_group
            row = tf.one_hot(replica, n, dtype=tf.float64)
            return row[:, None] * timings[None, :]

        rows = extended.call_for_each_replica(place_in_own_row)
        if n > 1:
            rows = extended.batch_reduce_to(tf.distribute.ReduceOp.SUM, [(rows, rows)])[
                0
            ]
        measured = distribution.experimental_local_results(rows)[0]
        with tf.control_dependencies([measured]):
            exchanged = tf.timestamp()
        return measured, exchanged - end

    with strategy.scope():
        probe_average.get_concrete_function(tf.TensorSpec((), tf.float64))
    return probe_average


def decide(
    measured, steps: int, target_ratio: float, max_interval: int
) -> IntervalDecision:
    """The decision from every replica's ``(round_seconds, average_seconds)``.

    Both rounds start together (the previous average synchronized them), so a
    worker that finished its local steps early waited in the average for the
    slowest one: its own communication time is its average's time minus that
    wait, ``max(round) - round``. ``t_comp`` is the maximum over workers of the
    time per local step, ``t_comm`` the maximum of the communication times.
    Every worker computes this from the same gathered array, so all agree.
    """
    measured = np.asarray(measured, dtype=np.float64)
    rounds, averages = measured[:, 0], measured[:, 1]
    slowest = rounds.max()
    t_comp = float(slowest / max(steps, 1))
    t_comm = float(np.maximum(averages - (slowest - rounds), 0.0).max())
    interval = maths.adaptive_interval(t_comm, t_comp, target_ratio, max_interval)
    return IntervalDecision(interval, t_comp, t_comm)


def choose_interval(
    optimizer,
    run_local_steps: Callable[[], object],
    *,
    steps: int = 1,
    target_ratio: float = 1.0,
    max_interval: int = 64,
) -> IntervalDecision:
    """The adaptive interval in a custom training loop: probe once, then fixed.

    Call it once, after the first training step (which traces the step
    function), on every worker at the same point. ``run_local_steps()`` must
    run ``steps`` training steps of your loop (it is called twice, for the two
    rounds of :class:`IntervalProbe`); the steps are real training. If the
    optimizer already holds a decision (restored from a checkpoint), it is
    returned and nothing runs.

    Example:

    ```python
    decision = keras_skip.choose_interval(
        optimizer, lambda: distributed_step(next(iterator)), steps=1
    )
    print(decision.interval, decision.t_comp, decision.t_comm)
    ```
    """
    target_ratio = _checks.positive("target_ratio", target_ratio)
    max_interval = _checks.integer("max_interval", max_interval, minimum=1)
    steps = _checks.integer("steps", steps, minimum=1)
    if not optimizer.built:
        raise ValueError(
            "choose_interval() needs a built optimizer: run one training step "
            "first (it also traces your step function, which must not be timed)."
        )
    decision = optimizer.interval_decision
    if decision is not None:
        return decision
    probe = IntervalProbe(optimizer, target_ratio, max_interval)
    while probe.decision is None:
        probe.start()
        run_local_steps()
        probe.finish(steps)
    return probe.decision
