"""Callbacks that connect `SkipCorrectionOptimizer` to `model.fit`."""

from __future__ import annotations

import keras

from keras_skip import _compat
from keras_skip.optimizer import SkipCorrectionOptimizer


class SkipCorrectionCallback(keras.callbacks.Callback):
    """Keeps `fit` consistent with a `SkipCorrectionOptimizer`.

    Between two averages every replica holds its own weights; Keras reads
    replica 0's copy when it validates, saves or returns the model. This
    callback averages the replicas at each epoch boundary (after the epoch's
    last step, before validation and before any callback's `on_epoch_end`)
    and at the end of training, so that validation, `ModelCheckpoint`,
    `BackupAndRestore`, `EarlyStopping` and the model after `fit` all see the
    averaged model. It also includes the model's BatchNorm statistics in the
    averages, and runs `steps_per_execution > 1` under a strategy, which
    stock Keras 3.15 cannot.

    A checkpoint written at a batch inside an epoch (`save_freq=<int>`)
    holds replica 0's weights, not their average; use epoch-level saves.

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

    @property
    def optimizer(self) -> SkipCorrectionOptimizer:
        optimizer = getattr(self.model, "optimizer", None)
        if not isinstance(optimizer, SkipCorrectionOptimizer):
            raise ValueError(
                f"{type(self).__name__} needs a model compiled with a "
                "keras_skip.SkipCorrectionOptimizer. Received a model whose "
                f"optimizer is {type(optimizer).__name__}: compile with "
                "`optimizer=keras_skip.SkipCorrectionOptimizer(keras.optimizers.SGD(...))`."
            )
        return optimizer

    def on_train_begin(self, logs=None):
        self._optimizer = self.optimizer
        self._optimizer.attach(self.model)
        if _compat.needs_train_function(self.model) and not getattr(
            self.model.train_function, "keras_skip_train_function", False
        ):
            self.model.train_function = _compat.make_train_function(self.model)

    def on_train_batch_end(self, batch, logs=None):
        steps = self.params.get("steps") if self.params else None
        if steps is not None and batch + 1 >= steps:
            self._optimizer.average()

    def on_test_begin(self, logs=None):
        # Also reached from a standalone `evaluate(callbacks=[this])`.
        optimizer = getattr(self.model, "optimizer", None)
        if isinstance(optimizer, SkipCorrectionOptimizer):
            optimizer.average()

    def on_epoch_end(self, epoch, logs=None):
        self._optimizer.average()

    def on_train_end(self, logs=None):
        self._optimizer.average()
        self._optimizer = None
