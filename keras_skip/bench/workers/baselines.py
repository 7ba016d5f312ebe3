"""Baselines for choosing the interval, to compare with AdaptiveIntervalCallback.

- :class:`AdaCommCallback`: the loss is all-reduced at every average and the
  interval recomputed each time, as in AdaComm (Wang and Joshi, "Adaptive
  communication strategies to achieve the best error-runtime trade-off in
  local-update SGD", 2019) and PaddlePaddle Fleet's adaptive local SGD:
  ``H <- clip(ceil(sqrt(lr_0 F / (lr F_0)) * H_0), 1, H_max)`` where ``F`` is
  the worker-averaged training loss at this average and ``F_0`` at the first.
- :func:`grid_search_interval`: short trial runs, one per candidate interval,
  then the candidate whose training loss fell fastest per second.

Both count what choosing costs beyond training itself: wall time, collectives
and bytes per replica.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Sequence

import keras
import tensorflow as tf

from keras_skip.callbacks import SkipCorrectionCallback


class WorkerMean:
    """The mean of a per-worker Python float over all workers: one all-reduce
    of one float, compiled and traced on construction. Every worker must call
    it at the same point."""

    #: Bytes one replica contributes per call.
    bytes_per_call = 8

    def __init__(self, strategy: tf.distribute.Strategy):
        self._strategy = strategy

        def replica_mean(value):
            context = tf.distribute.get_replica_context()
            # identity places the value on this replica's device.
            return context.all_reduce("MEAN", tf.identity(value))

        @tf.function(autograph=False)
        def mean(value):
            result = strategy.run(replica_mean, args=(value,))
            return strategy.experimental_local_results(result)[0]

        self._function = mean
        with strategy.scope():
            mean.get_concrete_function(tf.TensorSpec((), tf.float64))

    def __call__(self, value: float) -> float:
        with self._strategy.scope():
            return float(self._function(tf.constant(value, tf.float64)).numpy())


class AdaCommCallback(SkipCorrectionCallback):
    """AdaComm-style interval: a loss all-reduce and a new interval at every average.

    Args:
        initial_interval: ``H_0``, the interval until the first average.
        max_interval: Upper bound of the interval.
    """

    def __init__(self, initial_interval: int = 8, max_interval: int = 64):
        super().__init__()
        self.initial_interval = initial_interval
        self.max_interval = max_interval
        self.overhead_seconds = 0.0
        #: Of `overhead_seconds`, tracing its all-reduce function.
        self.tracing_seconds = 0.0
        self.collectives = 0
        self.bytes_sent = 0
        self.intervals: list[int] = []

    def on_train_begin(self, logs=None):
        super().on_train_begin(logs)
        optimizer = self._optimizer
        optimizer.interval = self.initial_interval
        begin = time.perf_counter()
        self._mean = WorkerMean(optimizer.steering.strategy)
        self.tracing_seconds = time.perf_counter() - begin
        self.overhead_seconds += self.tracing_seconds

        self._since_average = 0
        self._first = 0
        self._loss_0 = None
        self._lr_0 = float(keras.ops.convert_to_numpy(optimizer.learning_rate))

    def on_train_batch_begin(self, batch, logs=None):
        self._first = batch

    def on_train_batch_end(self, batch, logs=None):
        optimizer = self._optimizer
        # Mirrors the optimizer's counter in Python, so that detecting an
        # average costs no read from the device.
        self._since_average += batch - self._first + 1
        if self._since_average >= optimizer.interval:
            self._since_average = 0
            begin = time.perf_counter()
            loss = self._mean(float(logs["loss"]))
            lr = float(keras.ops.convert_to_numpy(optimizer.learning_rate))
            if self._loss_0 is None:
                self._loss_0 = loss
            ratio = (
                (self._lr_0 * loss) / (lr * self._loss_0) if self._loss_0 > 0 else 1.0
            )
            interval = math.ceil(math.sqrt(max(ratio, 0.0)) * self.initial_interval)
            optimizer.interval = int(min(max(interval, 1), self.max_interval))
            self.overhead_seconds += time.perf_counter() - begin
            self.collectives += 1
            self.bytes_sent += self._mean.bytes_per_call
            self.intervals.append(optimizer.interval)
        super().on_train_batch_end(batch, logs)

    def on_epoch_end(self, epoch, logs=None):
        super().on_epoch_end(epoch, logs)
        self._since_average = 0  # the boundary average restarts the count


class _Losses(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.values: list[float] = []

    def on_train_batch_end(self, batch, logs=None):
        self.values.append(float(logs["loss"]))


@dataclasses.dataclass
class Trial:
    interval: int
    seconds: float
    first_loss: float
    last_loss: float
    communications: int

    @property
    def loss_drop_per_second(self) -> float:
        return (self.first_loss - self.last_loss) / self.seconds


@dataclasses.dataclass
class GridSearchResult:
    interval: int
    trials: list[Trial]
    seconds: float
    collectives: int
    bytes_sent: int


def grid_search_interval(
    make_model: Callable[[int], keras.Model],
    x,
    y,
    *,
    batch_size: int,
    candidates: Sequence[int] = (1, 2, 4, 8, 16, 32, 64),
    trial_steps: int = 30,
) -> GridSearchResult:
    """Chooses the interval by short trial runs.

    ``make_model(interval)`` returns a fresh model, compiled with a
    ``SkipCorrectionOptimizer`` of that interval under the strategy to use,
    starting from the same weights each time. Each candidate trains
    ``trial_steps`` steps; the one whose training loss fell fastest per second
    wins. All trial time, and every synchronization the trials make, is the
    cost of choosing.
    """
    trials = []
    collectives = 0
    bytes_sent = 0
    total = time.perf_counter()
    for interval in candidates:
        model = make_model(interval)
        losses = _Losses()
        start = time.perf_counter()
        model.fit(
            x,
            y,
            batch_size=batch_size,
            epochs=1,
            steps_per_epoch=trial_steps,
            verbose=0,
            callbacks=[losses, SkipCorrectionCallback()],
        )
        seconds = time.perf_counter() - start
        optimizer = model.optimizer
        steps = int(optimizer.iterations.numpy())
        communications = steps if interval == 1 else optimizer.averages_performed
        parameters = sum(int(v.numpy().size) for v in model.trainable_variables)
        collectives += communications
        bytes_sent += communications * parameters * 4
        trials.append(
            Trial(
                interval, seconds, losses.values[0], losses.values[-1], communications
            )
        )
    best = max(trials, key=lambda t: t.loss_drop_per_second)
    return GridSearchResult(
        best.interval, trials, time.perf_counter() - total, collectives, bytes_sent
    )
