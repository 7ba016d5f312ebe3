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

from keras_skip import _checks, maths
from keras_skip.optimizer import PROBE_FIELDS


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

    The probe runs two rounds. Each is one run of local steps whose last step
    averages the replicas, as any interval's last step does. The train step
    itself times that average (timestamps around it in the graph) and, only
    while probing, ends with one small all-reduce that gives every worker the
    longest round and the longest communication time over all replicas. The
    first round sets that collective up (its first run includes one-time
    work) and is not used; the second gives the decision (see :func:`decide`).

    The local steps and the averages are training. What only choosing costs
    is the timing all-reduce of each round (``16 n`` bytes per replica for
    ``n`` replicas), a few variable reads and writes, and tracing that
    all-reduce within the train function.

    Usage: for each round call :meth:`start` with the number of steps the
    round will run (all of them local), run them, then call :meth:`finish`.
    Every worker must do this at the same steps. After the second completed
    round, :attr:`decision` holds the result and the optimizer's interval is
    set. A round that ran fewer steps (an epoch ended first) took no average
    and does not count; start another.
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
        self._steps = 0

    def start(self, steps: int) -> None:
        begin = time.perf_counter()
        optimizer = self.optimizer
        if steps != self._steps:
            optimizer._probe_steps.assign(steps)
            self._steps = steps
        optimizer._probe.assign([time.time(), 0.0, 0.0, 0.0, 0.0])
        self.overhead_seconds += time.perf_counter() - begin

    def finish(self) -> IntervalDecision | None:
        if not self._steps:
            raise RuntimeError("IntervalProbe.finish() called before start().")
        optimizer = self.optimizer
        optimizer.iterations.numpy()  # waits for the round's steps (training)
        begin = time.perf_counter()
        probe = dict(zip(PROBE_FIELDS, optimizer._probe.numpy().tolist(), strict=True))
        if probe["completed"]:
            self.rounds += 1
            self.collectives += 1
            self.bytes_sent += (
                16 * optimizer._distribution_strategy.num_replicas_in_sync
            )
            self.overhead_seconds += probe["exchange"]
            if self.rounds >= 2:
                self.decision = decide_from_maxima(
                    probe["longest_round"],
                    probe["longest_finish"],
                    self._steps,
                    self.target_ratio,
                    self.max_interval,
                )
                optimizer._record_interval_decision(self.decision)
        self.overhead_seconds += time.perf_counter() - begin
        return self.decision


def decide(
    measured, steps: int, target_ratio: float, max_interval: int
) -> IntervalDecision:
    """The decision from every replica's ``(round_seconds, average_seconds)``.

    Both rounds start together (the previous average synchronized them), so a
    worker that finished its local steps early waited in the average for the
    slowest one: its own communication time is its average's time minus that
    wait, ``max(round) - round``. ``t_comp`` is the maximum over workers of the
    time per local step, ``t_comm`` the maximum of the communication times,
    which is ``max(round + average) - max(round)``. Those two maxima are what
    the train step all-reduces (:func:`decide_from_maxima`); every worker gets
    the same numbers, so all agree.
    """
    measured = np.asarray(measured, dtype=np.float64).reshape(-1, 2)
    rounds, averages = measured[:, 0], measured[:, 1]
    return decide_from_maxima(
        rounds.max(), (rounds + averages).max(), steps, target_ratio, max_interval
    )


def decide_from_maxima(
    longest_round: float,
    longest_finish: float,
    steps: int,
    target_ratio: float,
    max_interval: int,
) -> IntervalDecision:
    """The decision from ``max(round)`` and ``max(round + average)`` (see
    :func:`decide`)."""
    t_comp = float(longest_round / max(steps, 1))
    t_comm = float(max(longest_finish - longest_round, 0.0))
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
    run exactly ``steps`` training steps of your loop (it is called twice,
    for the two rounds of :class:`IntervalProbe`); the steps are real
    training. Fewer or more raise a ValueError and decide nothing. If the
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
    if int(optimizer.iterations.numpy()) < optimizer.warmup_steps:
        raise ValueError(
            "choose_interval() must be called after the warm-up: the optimizer "
            f"has taken {int(optimizer.iterations.numpy())} of its "
            f"warmup_steps={optimizer.warmup_steps} synchronous steps."
        )
    probe = IntervalProbe(optimizer, target_ratio, max_interval)
    for _ in range(2):
        probe.start(steps)
        averages = optimizer.averages_performed
        run_local_steps()
        taken = optimizer.averages_performed - averages
        if taken != 1 or optimizer.local_steps_since_average:
            # The round's timing is wrong or missing; nothing is decided.
            optimizer._probe_steps.assign(0)
            ran = "fewer" if taken == 0 else "more"
            raise ValueError(
                f"run_local_steps() must run exactly steps={steps} training "
                f"steps of this optimizer, but it ran {ran}: "
                + (
                    "the round ended without reaching its average."
                    if taken == 0
                    else "steps followed the round's average."
                )
                + " Pass the number of steps it runs."
            )
        probe.finish()
    return probe.decision
