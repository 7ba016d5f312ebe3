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

from keras_skip import _checks, _interval_limit, maths, multi_worker


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
    """Times rounds of local steps, agrees across workers, sets the interval.

    The probe lives on the host: it sets the interval so that training runs
    three rounds of the same number of local steps, and times each round
    with the host's clock. Round 1 ends with an average: the first run of
    the train function's local step and average includes one-time work, and
    this round takes it. Round 2 has no average; its time per step is
    ``t_comp``. Round 3 ends with an average; what it takes beyond round 2 is
    ``t_comm``. With several workers, one small all-reduce after round 3
    gives every worker everyone's times, so all take the same decision (see
    :func:`decide`). The train function holds no code for the probe.

    The rounds are training: their local steps and averages are the same as
    at any interval's end. What only choosing costs is a few reads and writes
    of small variables between calls and, with several workers, one
    all-reduce of ``8 * n * keras_skip.multi_worker.GATHER_WIDTH`` bytes per
    replica for ``n`` replicas (it reuses the function that checks the
    workers' configurations, so nothing is traced).

    Usage: call :meth:`start` before and :meth:`finish` after each call of
    the training function, which must run ``steps`` steps, all after the
    warm-up. A round is one call, or two when ``steps`` is 1 (an interval of
    one step would be synchronous). A round cut by an epoch boundary (an
    average it did not expect, see :meth:`interrupt`) or an execution cut
    short is noticed from the optimizer's counters and run again. Every
    worker runs the same steps, so they all notice it alike. After round 3,
    :attr:`decision` holds the result and the optimizer's interval is set.
    A decision longer than the efficiency map's longest kept interval (128)
    warns (see ``keras_skip._interval_limit``). ``overlap`` (the local steps
    an interval average runs beside, 0 when it hides nothing) and
    ``overlap_share`` let the decision count only the wire time the steps
    do not hide (:func:`decide`).
    """

    #: An interval that no round reaches: round 2 takes no average.
    NEVER = 2**62

    def __init__(
        self,
        optimizer,
        steps: int = 1,
        target_ratio: float = 1.0,
        max_interval: int = 64,
        caller: str = "choose_interval()",
        overlap: int = 0,
        overlap_share: float = maths.OVERLAP_SHARE,
    ):
        self.optimizer = optimizer
        #: Steps an overlapped average can run beside (0: it hides nothing)
        #: and the share of its wire time they hide, for the decision.
        self.overlap = overlap
        self.overlap_share = overlap_share
        self._steps = steps
        #: Who chose, as the warning of a long interval names it.
        self.caller = caller
        self.target_ratio = target_ratio
        self.max_interval = max_interval
        self.decision: IntervalDecision | None = None
        #: Rounds started again because an epoch boundary or a shorter call
        #: broke one, and how the last one was broken: "fewer" steps than a
        #: round has, or "more".
        self.restarts = 0
        self.mismatch: str | None = None
        #: Seconds, collectives and bytes per replica spent only on choosing.
        self.overhead_seconds = 0.0
        self.collectives = 0
        self.bytes_sent = 0
        self._calls_per_round = 1 if steps >= 2 else 2
        #: Local steps per round.
        self.round_steps = steps * self._calls_per_round
        strategy = optimizer.steering.strategy
        self._workers = multi_worker.num_workers(strategy)
        self._gather_bytes = (
            8 * strategy.num_replicas_in_sync * multi_worker.GATHER_WIDTH
        )
        self._round = 0
        self._calls = 0
        self._counters: tuple[int, int] | None = None
        self._started = 0.0
        self._seconds = [0.0, 0.0, 0.0]
        self._active = False

    @property
    def probing(self) -> bool:
        """True between the first :meth:`start` and the decision (or
        :meth:`cancel`): the probe holds the optimizer's interval."""
        return self._active

    def start(self) -> None:
        if self.decision is not None:
            raise RuntimeError("IntervalProbe.start() after the decision.")
        if self._calls:
            return  # the second call of a round
        begin = time.perf_counter()
        optimizer = self.optimizer
        if self._counters is None:
            self._counters = self._read_counters()
        local_steps, _ = self._counters
        self._active = True
        optimizer.steering.hold(
            self.NEVER if self._round == 1 else local_steps + self.round_steps
        )
        self._started = time.perf_counter()
        self.overhead_seconds += self._started - begin

    def finish(self) -> IntervalDecision | None:
        if self._counters is None:
            raise RuntimeError("IntervalProbe.finish() called without start().")
        self._calls += 1
        if self._calls < self._calls_per_round:
            return None
        self._calls = 0
        # Reading the counters also waits for the round's steps to end.
        counters = self._read_counters()
        end = time.perf_counter()
        local_steps, averages = self._counters
        if self._round == 1:
            expected = (local_steps + self.round_steps, averages)
        else:
            expected = (0, averages + 1)
        self._counters = counters
        if counters != expected:
            # Compared as (averages, local steps): fewer steps than the round
            # has, or more (or an average it did not take itself). The round
            # is run again.
            self.mismatch = "fewer" if counters[::-1] < expected[::-1] else "more"
            self.restarts += 1
        elif self._round < 2:
            self._seconds[self._round] = end - self._started
            self._round += 1
        else:
            self._seconds[2] = end - self._started
            self._decide()
        self.overhead_seconds += time.perf_counter() - end
        return self.decision

    def _read_counters(self) -> tuple[int, int]:
        counters = self.optimizer.steering.counters()
        return counters.local_steps, counters.averages

    def interrupt(self) -> None:
        """Tells the probe that an epoch boundary took an average: a round in
        progress is run again, and the next round reads the counters anew."""
        if self._calls:
            self._calls = 0
            self.mismatch = "more"
            self.restarts += 1
        self._counters = None

    def _decide(self) -> None:
        without, with_average = self._seconds[1], self._seconds[2]
        measured = np.array([[without, with_average]])
        if self._workers > 1:
            measured = multi_worker.gather(
                self.optimizer.steering.strategy, measured[0]
            )
            self.collectives += 1
            self.bytes_sent += self._gather_bytes
        fragments = self.optimizer.fragments
        decision = decide(
            measured,
            self.round_steps,
            self.target_ratio,
            self.max_interval,
            overlap=self.overlap,
            fragments=fragments,
            steps_per_execution=self._steps,
            overlap_share=self.overlap_share,
        )
        # With fragments, an interval must average each of them once.
        if 1 < decision.interval < fragments:
            decision = dataclasses.replace(decision, interval=fragments)
        self.decision = decision
        self._active = False
        self.optimizer.steering.record(self.decision)
        _interval_limit.warn_if_longer(
            self.decision.interval, self.max_interval, self.caller
        )

    def cancel(self) -> None:
        """Gives up a probe before its decision and gives the optimizer back
        the interval it had before, so that no probe interval is left."""
        if self._active:
            self._active = False
            self.optimizer.steering.release()
        self._counters = None
        self._round = self._calls = 0


def decide(
    measured,
    steps: int,
    target_ratio: float,
    max_interval: int,
    *,
    overlap: int = 0,
    fragments: int = 1,
    steps_per_execution: int = 1,
    overlap_share: float = 0.0,
) -> IntervalDecision:
    """The decision from every worker's ``(without_average, with_average)``:
    the seconds of a round of ``steps`` local steps, and of the next such
    round, which ends with an average.

    The round without an average starts together on every worker (the
    previous average synchronized them) and the round with one ends together
    (in the average, where every worker waits for the slowest). So
    ``without + with`` is the same on all, and the slowest worker, the one
    with the longest round without an average, waits for no one: its
    communication time is ``with - without``, which is
    ``max(without + with) - 2 max(without)``. ``t_comp`` is
    ``max(without) / steps``. Every worker gets the same numbers, so all
    agree. A negative estimate (timing noise when the average is cheap) is
    taken as 0. ``overlap``, ``fragments``, ``steps_per_execution`` and
    ``overlap_share``: what :func:`keras_skip.maths.adaptive_interval` needs
    to count only the wire time overlap does not hide (the rounds' averages
    are full and blocking, so ``t_comm`` is the whole wire time).
    """
    measured = np.asarray(measured, dtype=np.float64).reshape(-1, 2)
    without, with_average = measured[:, 0], measured[:, 1]
    longest = without.max()
    t_comp = float(longest / max(steps, 1))
    t_comm = float(max((without + with_average).max() - 2 * longest, 0.0))
    interval = maths.adaptive_interval(
        t_comm,
        t_comp,
        target_ratio,
        max_interval,
        overlap=overlap,
        fragments=fragments,
        steps_per_execution=steps_per_execution,
        overlap_share=overlap_share,
    )
    return IntervalDecision(interval, t_comp, t_comm)


def choose_interval(
    optimizer,
    run_local_steps: Callable[[], object],
    *,
    steps: int = 1,
    target_ratio: float = 1.0,
    max_interval: int = 64,
    overlap_share: float = maths.OVERLAP_SHARE,
) -> IntervalDecision:
    """The adaptive interval in a custom training loop: probe once, then fixed.

    Call it once, after the first training step (which traces the step
    function), on every worker at the same point. ``run_local_steps()`` must
    run exactly ``steps`` training steps of your loop (it is called three
    times, once per round of :class:`IntervalProbe`, or six times when
    ``steps`` is 1); the steps are real training. Fewer or more raise a
    ValueError, decide nothing and give the optimizer back the interval it
    had before the call (any exception in ``run_local_steps`` does the
    same). If the optimizer already holds a decision (restored from a
    checkpoint), it is returned and nothing runs. As with
    :class:`keras_skip.AdaptiveIntervalCallback`, a decision above 128 warns
    (the longest interval the efficiency map shows keeping accuracy on
    skewed shards). With `overlap=True` the average runs beside the step it
    is due after, and `overlap_share` of that step's time counts as hidden,
    as in the callback; a delayed average (`overlap >= 2`) runs after its
    execution in a custom loop and hides nothing.

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
    overlap_share = _checks.share("overlap_share", overlap_share)
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
    probe = IntervalProbe(
        optimizer,
        steps,
        target_ratio,
        max_interval,
        overlap=1 if optimizer.overlap == 1 else 0,
        overlap_share=overlap_share,
    )
    return _run_probe(probe, run_local_steps, steps)


def _run_probe(
    probe: IntervalProbe, run_local_steps: Callable[[], object], steps: int
) -> IntervalDecision:
    """Runs `probe`'s rounds with `run_local_steps` until it decides. A round
    that did not end as set up raises a ValueError; on any exception the
    probe gives the optimizer back its interval."""
    try:
        while probe.decision is None:
            probe.start()
            run_local_steps()
            probe.finish()
            if probe.restarts:
                raise ValueError(
                    f"run_local_steps() must run exactly steps={steps} training "
                    f"steps of this optimizer, but it ran {probe.mismatch}: a "
                    f"round of {probe.round_steps} local steps did not end as "
                    "set up. Pass the number of steps it runs."
                )
    except BaseException:
        probe.cancel()
        raise
    return probe.decision
