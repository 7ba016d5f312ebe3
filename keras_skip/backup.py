"""`BackupAndRestore`: Keras' backup callback made safe for several workers."""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import shutil
import tempfile

import keras

from keras_skip import _compat, multi_worker


class BackupAndRestore(keras.callbacks.BackupAndRestore):
    """`keras.callbacks.BackupAndRestore` made safe for several workers.

    Backs the training state up at the end of every epoch and restores it
    when a restarted job calls `fit` again, like the Keras callback, with
    three differences that matter under `MultiWorkerMirroredStrategy`:

    - every worker writes its own subdirectory, `<backup_dir>/worker-<i>`,
      with `i` its index among the workers, a chief task being worker 0
      (the Keras callback has no notion of a chief, so workers sharing one
      directory overwrite each other's files);
    - every backup is written to a temporary directory and renamed into
      place, so a worker killed while writing never leaves a half-written
      backup, and the two most recent backups are kept;
    - at restart the workers agree, in one collective, on the latest epoch
      that *every* worker has a backup of, and all restore that one. Without
      this, a worker killed between two workers' saves makes them resume from
      different epochs and diverge silently.

    The weights file holds the optimizer's whole state, every replica's
    correction and slots included, so a restarted run continues exactly.
    Backups are taken at epoch ends only: stock Keras restarts an epoch from
    its first batch anyway.

    Args:
        backup_dir: Directory for the backups, the same path on every worker
            (a shared or a local disk). Not to be used for anything else.
        delete_checkpoint: Remove this worker's backups when training ends
            normally. Default True.

    Example:

    ```python
    import tempfile

    import keras
    import numpy as np
    import keras_skip

    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    model.compile(
        optimizer=keras_skip.SkipCorrectionOptimizer(keras.optimizers.SGD(0.05)),
        loss="mse",
    )
    x = np.random.rand(64, 4).astype("float32")
    backup = keras_skip.BackupAndRestore(tempfile.mkdtemp())
    model.fit(x, x.sum(axis=1), epochs=2, verbose=0,
              callbacks=[backup, keras_skip.SkipCorrectionCallback()])
    ```
    """

    _KEEP = 2

    def __init__(self, backup_dir: str, delete_checkpoint: bool = True):
        super().__init__(
            backup_dir, save_freq="epoch", delete_checkpoint=delete_checkpoint
        )
        self._directory: pathlib.Path | None = None

    @property
    def worker_directory(self) -> pathlib.Path | None:
        """This worker's own backup directory (`backup_dir`, or its
        `worker-<i>` subdirectory under several workers), known once
        training has begun; None before."""
        return self._directory

    def _worker_directory(self) -> pathlib.Path:
        strategy = self.model.distribute_strategy
        root = pathlib.Path(self.backup_dir)
        if multi_worker.num_workers(strategy) == 1:
            return root
        return root / f"worker-{multi_worker.worker_index(strategy)}"

    def _epochs(self) -> list[int]:
        if not self._directory.is_dir():
            return []
        found = []
        for entry in self._directory.iterdir():
            name = entry.name
            if name.startswith("epoch-") and (entry / "complete").exists():
                found.append(int(name.removeprefix("epoch-")))
        return sorted(found)

    def on_train_begin(self, logs=None):
        self._directory = self._worker_directory()
        strategy = self.model.distribute_strategy
        mine = self._epochs()[-self._KEEP :]
        held = multi_worker.gather(strategy, ([-1] * self._KEEP + mine)[-self._KEEP :])
        per_replica = [set(row.astype(int).tolist()) - {-1} for row in held]
        if not any(per_replica):
            return
        common = set.intersection(*per_replica)
        if not common:
            raise ValueError(
                "Cannot resume: the workers' backups have no epoch in common "
                f"(epochs held per replica: {[sorted(e) for e in per_replica]}, in "
                f"{self.backup_dir!r}). Delete the backup directory to start "
                "training again from the beginning."
            )
        epoch = max(common)
        if not self.model.built:
            raise ValueError(
                "To restore a backup the model must be built before fit(). "
                "Give it an Input layer or call it on a batch first."
            )
        optimizer = self.model.optimizer
        if optimizer is not None and not optimizer.built:
            with strategy.scope():
                optimizer.build(self.model.trainable_variables)
        self.model.load_weights(
            self._directory / f"epoch-{epoch}" / "backup.weights.h5"
        )
        _compat.set_initial_epoch(self.model, epoch)

    def on_epoch_end(self, epoch, logs=None):
        self._save(epoch + 1)

    def on_train_batch_end(self, batch, logs=None):
        pass

    def _save(self, epoch: int) -> None:
        self._directory.mkdir(parents=True, exist_ok=True)
        final = self._directory / f"epoch-{epoch}"
        temporary = pathlib.Path(
            tempfile.mkdtemp(prefix=".writing-", dir=self._directory)
        )
        try:
            self.model.save_weights(temporary / "backup.weights.h5")
            (temporary / "complete").write_text(json.dumps({"epoch": epoch}))
            if final.exists():
                shutil.rmtree(final)
            os.replace(temporary, final)
        finally:
            shutil.rmtree(temporary, ignore_errors=True)
        for old in self._epochs()[: -self._KEEP]:
            shutil.rmtree(self._directory / f"epoch-{old}", ignore_errors=True)

    def on_train_end(self, logs=None):
        if self.delete_checkpoint and self._directory is not None:
            shutil.rmtree(self._directory, ignore_errors=True)
            with contextlib.suppress(OSError):
                pathlib.Path(self.backup_dir).rmdir()  # if no other worker's is left
