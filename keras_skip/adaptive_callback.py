"""`AdaptiveIntervalCallback`: the adaptive interval chosen inside `model.fit`."""

from __future__ import annotations

from keras_skip import _arguments, _checks, adaptive, maths
from keras_skip.callbacks import SkipCorrectionCallback


class AdaptiveIntervalCallback(SkipCorrectionCallback):
    """Chooses the interval once, from the timing of the first steady-state step.

    Training starts at interval 1 (synchronous). After the first execution of
    the train function (which traces it) and any warm-up, the callback sets
    the interval for three rounds of the same local steps, timed from the
    host: the first ends with an average and takes the one-time work of the
    first local steps and average; the second takes no average and gives
    `t_comp`, one local step with no communication; the third ends with an
    average, and what it takes beyond the second gives `t_comm`, one average
    of the exact payload an average sends. With several workers one small
    all-reduce gives every worker everyone's times; all take the maximum of
    each and set

        interval = clip(round(t_comm / (target_ratio * t_comp)), 1, max_interval)

    so that per epoch the time spent communicating is about `target_ratio`
    times the time spent computing. The interval then stays fixed: no more
    probes, statistics or tuning collectives. The train function holds no
    code for the probe. The decision is saved with the optimizer, so a run
    resumed from a checkpoint or `BackupAndRestore` keeps it instead of
    probing again. It is written into the logs of every epoch (`interval`,
    `t_comp`, `t_comm` in seconds, so `History` has it) and printed when
    `verbose`.

    A round is one execution of the train function, or two when
    `steps_per_execution` is 1 (an interval of one step is synchronous), so
    the decision comes after 3 executions, or 6. An epoch boundary inside a
    round, or an execution cut short by the end of an epoch, breaks it and it
    runs again; if epochs are too short for a round, the callback warns and
    keeps interval 1. The chosen interval need not be a multiple of
    `steps_per_execution`: averages happen inside the train function every
    `interval` local steps, wherever the execution boundaries fall.

    With `overlap` the rounds' averages are still full and blocking (a held
    interval overlaps nothing), so `t_comm` is the whole wire time, and the
    rule counts only what the steps beside an average would not hide: each
    of the interval's `fragments` averages runs beside up to `overlap`
    steps (at most the `interval // fragments` until the next one falls
    due), which hide `overlap_share` of the shorter of the two
    (`keras_skip.maths.adaptive_interval`). So with overlap the interval can
    be shorter than without, never longer. A delayed average
    (`overlap >= 2`) hides nothing at an interval no longer than
    `steps_per_execution`, nor across workers on data of unknown length;
    there nothing is counted as hidden.

    It includes everything `SkipCorrectionCallback` does; pass only this one.

    Args:
        target_ratio: Float > 0, default 1.0. Wanted ratio of communication
            time to computation time per epoch; smaller values choose larger
            intervals.
        max_interval: Integer >= 1, default 64. Upper bound of the interval.
            The efficiency map (docs: "Efficiency") shows accuracy on skewed
            shards kept up to interval 128 and lost beyond (10-20% below
            synchronous training at 512): a decision above 128 warns, and
            with shards that are not shuffled alike, 128 is the cap to pass.
        overlap_share: Float in [0, 1], default 0.5. With `overlap`, the
            share of an average's wire time that the local steps beside it
            hide, up to their own time. 0.5 was fitted on worker processes
            sharing 2 CPU cores, where the all-reduce competes with the
            steps for the cores; devices whose all-reduce does not slow
            their compute likely hide more (not measured here; up to 1).
            0 decides as without overlap.
        verbose: 0 or 1 (default): print the decision.

    Attributes:
        decision: The decision in force, an `IntervalDecision` (interval,
            `t_comp`, `t_comm`), once known; None before.
        probes: Probes this callback ran: 1, or 0 when a decision restored
            from a checkpoint was kept.
        restarts: Rounds the probe ran again because an epoch boundary
            broke them.
        overhead_seconds: Seconds spent choosing the interval beyond
            training itself.
        collectives: Collectives the choice added (one small all-reduce
            with several workers, none with one).
        bytes_sent: Bytes per replica the choice put into collectives.

    Example:

    ```python
    import keras
    import numpy as np
    import keras_skip

    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    model.compile(
        optimizer=keras_skip.SkipCorrectionOptimizer(keras.optimizers.SGD(0.05)),
        loss="mse",
    )
    x = np.random.rand(256, 4).astype("float32")
    history = model.fit(x, x.sum(axis=1), epochs=2, verbose=0,
                        callbacks=[keras_skip.AdaptiveIntervalCallback()])
    print(history.history["interval"])
    ```
    """

    def __init__(
        self,
        target_ratio: float = 1.0,
        max_interval: int = 64,
        verbose: int = 1,
        overlap_share: float = maths.OVERLAP_SHARE,
    ):
        super().__init__()
        self.target_ratio = _checks.positive("target_ratio", target_ratio)
        self.max_interval = _checks.integer("max_interval", max_interval, minimum=1)
        self.overlap_share = _checks.share("overlap_share", overlap_share)
        self.verbose = verbose
        self.decision: adaptive.IntervalDecision | None = None
        self.probes = 0
        self.restarts = 0
        self.overhead_seconds = 0.0
        self.collectives = 0
        self.bytes_sent = 0
        self._probe: adaptive.IntervalProbe | None = None
        self._probing = False
        self._gave_up = False
        self._executions = 0

    def on_train_begin(self, logs=None):
        super().on_train_begin(logs)
        optimizer = self._optimizer
        self._executions = 0
        self._probe = None
        self._probing = False
        self._gave_up = False
        self.decision = optimizer.interval_decision
        if self.decision is None:
            optimizer.interval = 1

    def on_train_batch_begin(self, batch, logs=None):
        self._start_probe_call()
        super().on_train_batch_begin(batch, logs)

    def _check_overlap(self) -> None:
        if self.decision is not None:  # else the interval is not chosen yet
            super()._check_overlap()

    def _start_probe_call(self):
        if self.decision is not None or self._executions == 0 or self._gave_up:
            return
        optimizer = self._optimizer
        if self._probe is None:
            # BackupAndRestore may have restored a decision after on_train_begin.
            self.decision = optimizer.interval_decision
            if self.decision is not None:
                return
            if int(optimizer.iterations.numpy()) < optimizer.warmup_steps:
                return
            # Created now: without a strategy, Keras builds the optimizer
            # during the first step.
            self._probe = adaptive.IntervalProbe(
                optimizer,
                self.model.steps_per_execution,
                self.target_ratio,
                self.max_interval,
                caller="AdaptiveIntervalCallback",
                overlap=self._overlap_window(),
                overlap_share=self.overlap_share,
            )
        self._probing = True
        self._probe.start()

    def _overlap_window(self) -> int:
        """The optimizer's overlap in steps; 0 for delayed averages that run
        after their step in this `fit` (across workers, on data of unknown
        length)."""
        optimizer = self._optimizer
        overlap = _arguments.check_overlap(optimizer.overlap)
        if overlap >= 2 and not optimizer.steering.delays_beside_steps():
            return 0
        return overlap

    def on_train_batch_end(self, batch, logs=None):
        self._executions += 1
        if self._probing:
            self._probing = False
            probe = self._probe
            self.decision = probe.finish()
            if self.decision is not None:
                self._finish_probe()
                self._check_overlap()
                if self.verbose:
                    self._print_decision()
            elif probe.restarts > self.MAX_RESTARTS:
                self._give_up()
        super().on_train_batch_end(batch, logs)

    #: Rounds the probe may run again (each epoch boundary inside one is a
    #: restart) before the callback gives up and keeps interval 1.
    MAX_RESTARTS = 8

    def _finish_probe(self):
        probe = self._probe
        self.probes += 1
        self.restarts += probe.restarts
        self.overhead_seconds += probe.overhead_seconds
        self.collectives += probe.collectives
        self.bytes_sent += probe.bytes_sent
        self._probe = None

    def _give_up(self):
        probe = self._probe
        probe.cancel()
        self._finish_probe()
        self._gave_up = True
        _checks.warn_at_caller(
            "AdaptiveIntervalCallback could not time three undisturbed rounds "
            f"of {probe.round_steps} local steps: epoch boundaries or short "
            f"executions broke {probe.restarts} of them. It keeps interval 1 "
            "for this run and decides nothing. Use epochs of more steps, or "
            "set the interval yourself."
        )

    def on_epoch_begin(self, epoch, logs=None):
        super().on_epoch_begin(epoch, logs)
        if self._probe is not None:
            self._probe.interrupt()  # the epoch boundary averaged
            if self._probe.restarts > self.MAX_RESTARTS:
                self._give_up()

    def on_train_end(self, logs=None):
        if self._probe is not None:
            self._probe.cancel()
            self._probe = None
        super().on_train_end(logs)

    def _print_decision(self):
        d = self.decision
        capped = " (max_interval)" if d.interval == self.max_interval else ""
        hidden = ""
        optimizer = self._optimizer
        window = maths.overlap_window(
            self._overlap_window() if self.overlap_share else 0,
            d.interval,
            optimizer.fragments,
            self.model.steps_per_execution,
        )
        if window:
            seconds = maths.hidden_communication(
                d.t_comm, d.t_comp, window, optimizer.fragments, self.overlap_share
            )
            hidden = f", {seconds * 1e3:.2f} ms of it hidden by overlap"
        print(
            f"AdaptiveIntervalCallback: t_comp {d.t_comp * 1e3:.2f} ms, "
            f"t_comm {d.t_comm * 1e3:.2f} ms (maximum over workers{hidden}), "
            f"target_ratio {self.target_ratio:g} -> interval {d.interval}{capped}"
        )

    def on_epoch_end(self, epoch, logs=None):
        super().on_epoch_end(epoch, logs)
        if logs is not None and self.decision is not None:
            logs["t_comp"] = self.decision.t_comp
            logs["t_comm"] = self.decision.t_comm
