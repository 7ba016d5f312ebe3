"""`SkipCorrectionCallback`: connects `SkipCorrectionOptimizer` to `model.fit`."""

from __future__ import annotations

import keras
import numpy as np

from keras_skip import _checks, _compat, _version, multi_worker, tracing
from keras_skip._stop_agreement import StopAgreement
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

    With `SkipCorrectionOptimizer(boundary="latest")` an epoch whose
    averages covered every fragment ends with no communication instead:
    every replica's own weights are set aside and each fragment's latest
    average is shown to validation and to every callback's `on_epoch_end`;
    the own weights come back at the next epoch's start. Other epochs, and
    the end of training, take the full average as above.

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
        self._agreement: StopAgreement | None = None
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
                "fragments": optimizer.fragments,
                "boundary": optimizer.boundary,
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
            self._agreement = StopAgreement(optimizer)
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
        # With fragments, the first falls due after interval // fragments.
        first = interval // optimizer.fragments
        if optimizer.overlap and steps is not None and interval > 1 and steps <= first:
            at = f"interval={interval}"
            if optimizer.fragments > 1:
                at += f" and fragments={optimizer.fragments}"
            _checks.warn_at_caller(
                f"SkipCorrectionOptimizer(overlap={optimizer.overlap!r}) has no "
                f"effect at {at} with epochs of {steps} steps: every "
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
        pending afterwards is averaged in `on_train_batch_end` as before.
        With fragments the schedule declines (`Steering.may_hold`): a held
        execution there runs a train function of its own."""
        steps = self.params.get("steps") if self.params else None
        optimizer = self._optimizer
        if steps is None or not optimizer.built:
            return
        steering = optimizer.steering
        if steering.held or optimizer.boundary == "latest":
            return  # the adaptive probe's rounds; no full average to take
        count = min(self.model.steps_per_execution, steps - batch)
        if batch + count < steps:
            return
        due = steering.local_steps() + count
        # At 1 the step would be synchronous; if an interval average (with
        # fragments, any fragment's) falls due in this execution, the
        # schedule averages in it and the boundary average follows it.
        if (
            due > 1
            and count < steering.steps_to_next_average()
            and steering.may_hold(count)
        ):
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
            self._end_epoch()

    def _end_epoch(self) -> None:
        """The boundary: with ``boundary="latest"``, the latest averages are
        shown if every fragment's was taken during the epoch (at least
        `fragments` averages); else a full average."""
        optimizer = self._optimizer
        if optimizer.showing_latest_averages:
            return
        if optimizer.boundary == "latest":
            optimizer.steering.land()  # an average on its way counts
        averages = optimizer.averages_performed - self._counters[0]
        if optimizer.boundary == "latest" and averages >= optimizer.fragments:
            with tracing.span("show latest averages", "average"):
                optimizer.show_latest_averages()
            return
        with tracing.span("boundary average", "average") as args:
            args["averaged"] = optimizer.average()

    def on_test_begin(self, logs=None):
        # Also reached from a standalone `evaluate(callbacks=[this])`.
        optimizer = _skip_optimizer(getattr(self.model, "optimizer", None))
        if (
            isinstance(optimizer, SkipCorrectionOptimizer)
            and not optimizer.showing_latest_averages
        ):
            optimizer.average()

    def _read_counters(self) -> tuple[int, int, float]:
        optimizer = self._optimizer
        return (
            optimizer.averages_performed,
            optimizer.bytes_sent,
            optimizer.drift[0],
        )

    def on_epoch_begin(self, epoch, logs=None):
        self._optimizer.restore_own_weights()
        self._counters = self._read_counters()

    def on_epoch_end(self, epoch, logs=None):
        optimizer = self._optimizer
        self._end_epoch()
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
        # Weights another callback set while the averages were shown (the
        # best ones `EarlyStopping` restores) are kept, unaveraged.
        if self._optimizer.restore_own_weights():
            self._optimizer.average()
        if self._agreement is not None:
            self._agreement.finish()
            callbacks = self._callback_list.callbacks
            callbacks[:] = [c for c in callbacks if c is not self._agreement]
            self._agreement = self._callback_list = None
        self._optimizer = None
