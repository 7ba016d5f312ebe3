"""`TraceCallback`: where the time of `model.fit` goes, one trace per worker."""

from __future__ import annotations

import contextlib
import os
import pathlib

import keras

from keras_skip import multi_worker, tracing


class TraceCallback(keras.callbacks.Callback):
    """Writes a trace of training to `directory/worker-<i>.json`.

    One file per worker, in the Chrome trace-event format (open it in
    https://ui.perfetto.dev or `chrome://tracing`), on the wall clock: each
    execution of the train function (its local steps and the averages it
    took inside), each boundary average, validation, and, with
    `SkipCorrectionOptimizer(overlap=k)`, each delayed average's copy, its
    all-reduce (on a track of its own when it runs beside the steps), the
    training thread's wait for it and its landing. The file is written
    whole at every epoch's end and at the end of training.

    Tracing reads the optimizer's average counter after each execution,
    which waits for the execution to end (it has ended already under
    TensorFlow's default synchronous execution); otherwise it only reads
    the host's clock. `keras_skip.tracing.summary(keras_skip.tracing.read(
    path))` sums a trace up: time in executions and averages, and the share
    of the delayed averages' all-reduces hidden behind the steps.

    Args:
        directory: Where the trace files go (created if needed).

    Example:

    ```python
    import tempfile
    import keras
    import numpy as np
    import keras_skip
    from keras_skip import tracing

    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    model.compile(
        optimizer=keras_skip.SkipCorrectionOptimizer(keras.optimizers.SGD(0.05)),
        loss="mse",
    )
    x = np.random.rand(64, 4).astype("float32")
    directory = tempfile.mkdtemp()
    model.fit(x, x.sum(axis=1), epochs=2, verbose=0, callbacks=[
        keras_skip.SkipCorrectionCallback(), keras_skip.TraceCallback(directory)])
    print(tracing.summary(tracing.read(f"{directory}/worker-0.json")))
    ```
    """

    def __init__(self, directory: str | os.PathLike):
        super().__init__()
        if not isinstance(directory, str | os.PathLike) or not str(directory):
            raise ValueError(
                "`directory` must be a path (a string or os.PathLike). "
                f"Received: directory={directory!r}"
            )
        self.directory = pathlib.Path(directory)
        self.trace: tracing.Trace | None = None
        self._recording: contextlib.ExitStack | None = None
        self._execution: tuple[float, int, int] | None = None
        self._validation: float | None = None
        self._epoch: float | None = None

    @property
    def path(self) -> pathlib.Path | None:
        """This worker's trace file, once training began."""
        if self.trace is None:
            return None
        return self.directory / f"worker-{self.trace.worker}.json"

    def _averages(self) -> int:
        count = getattr(self.model.optimizer, "averages_performed", None)
        if count is None:  # under a LossScaleOptimizer
            inner = getattr(self.model.optimizer, "inner_optimizer", None)
            count = getattr(inner, "averages_performed", 0)
        return int(count)

    def on_train_begin(self, logs=None):
        if self._recording is not None:  # a fit that raised never ended it
            self._recording.close()
        strategy = self.model.distribute_strategy
        self.trace = tracing.Trace(multi_worker.worker_index(strategy))
        self._recording = contextlib.ExitStack()
        self._recording.enter_context(tracing.recording(self.trace))

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = self.trace.now()

    def on_train_batch_begin(self, batch, logs=None):
        self._execution = (self.trace.now(), batch, self._averages())

    def on_train_batch_end(self, batch, logs=None):
        if self._execution is None:
            return
        start, first, averages = self._execution
        self._execution = None
        self.trace.complete(
            "execution",
            "steps",
            start,
            self.trace.now(),
            steps=batch - first + 1,
            first_step=first,
            averages=self._averages() - averages,
        )

    def on_test_begin(self, logs=None):
        if self.trace is not None:
            self._validation = self.trace.now()

    def on_test_end(self, logs=None):
        if self.trace is not None and self._validation is not None:
            self.trace.complete(
                "validation", "validation", self._validation, self.trace.now()
            )
            self._validation = None

    def on_epoch_end(self, epoch, logs=None):
        if self._epoch is not None:
            self.trace.complete(
                "epoch",
                "epoch",
                self._epoch,
                self.trace.now(),
                track="epochs",
                epoch=epoch + 1,
            )
        self.trace.write(self.path)

    def on_train_end(self, logs=None):
        if self._recording is not None:
            self._recording.close()
            self._recording = None
        self.trace.write(self.path)
