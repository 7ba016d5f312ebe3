"""Callbacks that connect `SkipCorrectionOptimizer` to `model.fit`."""

from __future__ import annotations

import keras
import numpy as np

from keras_skip import _checks, _compat, _version, adaptive, multi_worker
from keras_skip.optimizer import SkipCorrectionOptimizer


def _skip_optimizer(optimizer):
    """The SkipCorrectionOptimizer, also inside the LossScaleOptimizer Keras
    wraps it in under the mixed_float16 policy."""
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        return optimizer.inner_optimizer
    return optimizer


class SkipCorrectionCallback(keras.callbacks.Callback):
    """Keeps `fit` consistent with a `SkipCorrectionOptimizer`.

    Between two averages every replica holds its own weights; Keras reads
    replica 0's copy when it validates, saves or returns the model. This
    callback averages the replicas at each epoch boundary (after the epoch's
    last step, before validation and before any callback's `on_epoch_end`,
    wherever this callback is in the list, and also when the input ran out
    or `stop_training` ended the epoch early) and at the end of training, so
    that validation, `ModelCheckpoint`, `BackupAndRestore`, `EarlyStopping`
    and the model after `fit` all see the averaged model. It also includes
    the model's BatchNorm statistics in the averages. With several workers
    it checks, before the first step, that every worker runs the same
    keras-skip configuration (a mismatch would deadlock a collective) and
    raises the same clear error on each if not.

    A checkpoint written at a batch inside an epoch (`save_freq=<int>`)
    holds replica 0's weights, not their average; use epoch-level saves.

    With `SkipCorrectionOptimizer(overlap=True)`, an interval average due at
    an epoch's last step is taken as the full boundary average, and the
    callback warns if the interval is no shorter than the epoch (nothing
    could overlap).

    Every epoch's logs (so `History`, `CSVLogger` and `TensorBoard`, which
    writes them as `epoch_*` scalars) get the epoch's telemetry: `interval`,
    `averages` (averages performed), `bytes_sent` (bytes each replica put
    into all-reduces, see `SkipCorrectionOptimizer.bytes_sent`) and, with
    `measure_drift=True`, `drift` (the mean over the epoch's averages of
    `mean_i ||x_i - x_bar||`; 0 when none took place). The telemetry is
    added in this callback's `on_epoch_end`: list it before `TensorBoard`
    and `CSVLogger`, which see the logs in order.

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
    x = np.random.rand(64, 4).astype("float32")
    model.fit(x, x.sum(axis=1), epochs=2, verbose=0,
              callbacks=[keras_skip.SkipCorrectionCallback()])
    ```
    """

    def __init__(self):
        super().__init__()
        self._optimizer: SkipCorrectionOptimizer | None = None
        self._counters = (0, 0, 0.0)
        self._overridden = False
        self._agreement: _StopAgreement | None = None
        self._callback_list = None

    @property
    def optimizer(self) -> SkipCorrectionOptimizer:
        optimizer = _skip_optimizer(getattr(self.model, "optimizer", None))
        if not isinstance(optimizer, SkipCorrectionOptimizer):
            raise ValueError(
                f"{type(self).__name__} needs a model compiled with a "
                "keras_skip.SkipCorrectionOptimizer. Received a model whose "
                f"optimizer is {type(optimizer).__name__}: compile with "
                "`optimizer=keras_skip.SkipCorrectionOptimizer(keras.optimizers.SGD(...))`."
            )
        return optimizer

    def on_train_begin(self, logs=None):
        self._optimizer = optimizer = self.optimizer
        _compat.prepare_model(self.model)
        optimizer.attach(self.model)
        multi_worker.check_same_configuration(
            optimizer.steering.strategy,
            {
                "keras-skip version": _version.__version__,
                "callback": type(self).__name__,
                "inner optimizer": type(optimizer.inner_optimizer).__name__,
                "interval": optimizer.interval,
                "correction": optimizer.correction,
                "optimizer_state": optimizer.optimizer_state,
                "warmup_steps": optimizer.warmup_steps,
                "measure_drift": optimizer.measure_drift,
                "compression": optimizer.compression,
                "group_size": optimizer.group_size,
                "overlap": optimizer.overlap,
                "outer optimizer": type(optimizer.outer_optimizer).__name__,
                "steps_per_execution": self.model.steps_per_execution,
                "trainable parameters": sum(
                    int(np.prod(v.shape)) for v in self.model.trainable_variables
                ),
            },
        )
        self._check_overlap()
        if multi_worker.num_workers(optimizer.steering.strategy) > 1:
            # Runs after every other callback, so that it sees the
            # `stop_training` any of them set.
            callbacks = _compat.calling_callback_list(self)
            if callbacks is None:
                raise RuntimeError(
                    f"{type(self).__name__} must be called by the callbacks "
                    "list of `model.fit` (pass it in `fit(callbacks=[...])`): "
                    "with several workers it makes them agree on stopping."
                )
            self._agreement = _StopAgreement(optimizer)
            self._agreement.set_model(self.model)
            callbacks.callbacks.append(self._agreement)
            self._callback_list = callbacks

    def _check_overlap(self) -> None:
        """Warns when `overlap=True` has nothing to overlap: with an interval
        no shorter than the epoch every average is the epoch-boundary one,
        which is always full, and overlap only adds tracing time."""
        optimizer = self._optimizer
        steps = self.params.get("steps") if self.params else None
        interval = optimizer.interval
        if (
            optimizer.overlap
            and steps is not None
            and interval > 1
            and steps <= interval
        ):
            _checks.warn_at_caller(
                f"SkipCorrectionOptimizer(overlap=True) has no effect at "
                f"interval={interval} with epochs of {steps} steps: every "
                "average is the epoch-boundary average, which is never "
                "overlapped, and the overlapped average's code only lengthens "
                "the first epoch's tracing. Use an interval shorter than the "
                "epoch, or overlap=False."
            )

    def on_train_batch_begin(self, batch, logs=None):
        self._average_in_last_step(batch)

    def _average_in_last_step(self, batch):
        """Before the epoch's last execution, lets its last step take the
        boundary average inside the train function, where that is exactly
        the average `on_train_batch_end` would take after it: all its steps
        are local and no interval average falls inside it. This spares
        tracing and calling a separate average function. Anything still
        pending afterwards is averaged in `on_train_batch_end` as before."""
        steps = self.params.get("steps") if self.params else None
        optimizer = self._optimizer
        if steps is None or not optimizer.built:
            return
        steering = optimizer.steering
        if steering.held:
            return  # the adaptive probe's rounds
        count = min(self.model.steps_per_execution, steps - batch)
        if batch + count < steps:
            return
        due = steering.local_steps() + count
        # At 1 the step would be synchronous; at or beyond the interval the
        # schedule averages in this execution anyway.
        if 1 < due < steering.interval_now():
            steering.hold(due)
            self._overridden = True
        elif optimizer.overlap:
            # An average due at the last step is the boundary average: full,
            # where an overlapped one would need another after it.
            steering.full_average_at(steering.counters().iterations + count - 1)
            self._overridden = True

    def on_train_batch_end(self, batch, logs=None):
        if self._overridden:
            self._overridden = False
            self._optimizer.steering.release()
        steps = self.params.get("steps") if self.params else None
        if steps is not None and batch + 1 >= steps:
            self._optimizer.average()

    def on_test_begin(self, logs=None):
        # Also reached from a standalone `evaluate(callbacks=[this])`.
        optimizer = _skip_optimizer(getattr(self.model, "optimizer", None))
        if isinstance(optimizer, SkipCorrectionOptimizer):
            optimizer.average()

    def _read_counters(self) -> tuple[int, int, float]:
        optimizer = self._optimizer
        return (
            optimizer.averages_performed,
            optimizer.bytes_sent,
            optimizer.drift[0],
        )

    def on_epoch_begin(self, epoch, logs=None):
        self._counters = self._read_counters()

    def on_epoch_end(self, epoch, logs=None):
        optimizer = self._optimizer
        optimizer.average()
        if logs is None:
            return
        averages, bytes_sent, drift = self._read_counters()
        start = self._counters
        logs["interval"] = optimizer.interval
        logs["averages"] = averages - start[0]
        logs["bytes_sent"] = bytes_sent - start[1]
        if optimizer.measure_drift:
            logs["drift"] = (drift - start[2]) / max(averages - start[0], 1)

    def on_train_end(self, logs=None):
        self._optimizer.average()
        if self._agreement is not None:
            self._agreement.finish()
            callbacks = self._callback_list.callbacks
            callbacks[:] = [c for c in callbacks if c is not self._agreement]
            self._agreement = self._callback_list = None
        self._optimizer = None


class _StopAgreement(keras.callbacks.Callback):
    """With several workers, makes every worker stop training at the same step.

    Each worker's callbacks see that worker's own batch logs, so a callback
    may set `model.stop_training` on one worker only (`TerminateOnNaN`
    seeing a NaN there); a worker leaving the loop alone would leave the
    others waiting in their next average. This callback runs last: it takes
    the request back and casts this worker's vote, which the next
    synchronization (an average, or a synchronous step) carries to every
    worker with no extra message. Every worker then sees the same votes after
    the same execution of the train function and stops there. At an epoch's
    end, where callbacks such as `EarlyStopping` decide, one all-reduce of a
    few bytes settles the votes at once.
    """

    def __init__(self, optimizer):
        super().__init__()
        self._optimizer = optimizer
        self._voted_at: int | None = None
        self._agreed = False

    def on_train_batch_end(self, batch, logs=None):
        steering = self._optimizer.steering
        if self._agreed:
            self.model.stop_training = True
            return
        if self.model.stop_training:
            self.model.stop_training = False
            if self._voted_at is None:
                steering.vote_stop()
                self._voted_at = steering.counters().synchronizations
        if steering.stop_votes() > 0 and (
            self._voted_at is None
            or steering.counters().synchronizations > self._voted_at
        ):
            self._agreed = self.model.stop_training = True

    def on_epoch_end(self, epoch, logs=None):
        if self._agreed:
            self.model.stop_training = True
            return
        wants = self.model.stop_training or self._voted_at is not None
        votes = multi_worker.sum_over_workers(
            self._optimizer.steering.strategy, [1.0 if wants else 0.0]
        )
        self._agreed = self.model.stop_training = bool(votes[0] > 0)

    def finish(self) -> None:
        """Clears this worker's vote, for a later `fit`."""
        self._optimizer.steering.vote_stop(False)
        self._voted_at = None
        self._agreed = False


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

    It includes everything `SkipCorrectionCallback` does; pass only this one.

    Args:
        target_ratio: Float > 0, default 1.0. Wanted ratio of communication
            time to computation time per epoch; smaller values choose larger
            intervals.
        max_interval: Integer >= 1, default 64. Upper bound of the interval.
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
        self, target_ratio: float = 1.0, max_interval: int = 64, verbose: int = 1
    ):
        super().__init__()
        self.target_ratio = _checks.positive("target_ratio", target_ratio)
        self.max_interval = _checks.integer("max_interval", max_interval, minimum=1)
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
            )
        self._probing = True
        self._probe.start()

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
        print(
            f"AdaptiveIntervalCallback: t_comp {d.t_comp * 1e3:.2f} ms, "
            f"t_comm {d.t_comm * 1e3:.2f} ms (maximum over workers), "
            f"target_ratio {self.target_ratio:g} -> interval {d.interval}{capped}"
        )

    def on_epoch_end(self, epoch, logs=None):
        super().on_epoch_end(epoch, logs)
        if logs is not None and self.decision is not None:
            logs["t_comp"] = self.decision.t_comp
            logs["t_comm"] = self.decision.t_comm
