"""One run of the efficiency map: a model trained with ``model.fit`` and
``keras_skip.SkipCorrectionOptimizer`` on ``MirroredStrategy`` replicas of
one process, each replica on its own shard, evaluated on the steps of a
grid without disturbing training."""

from __future__ import annotations

import math
import time

import numpy as np

from keras_skip.bench.efficiency import data, models
from keras_skip.bench.efficiency.cells import (
    METHODS,
    OUTER_LEARNING_RATE,
    OUTER_MOMENTUM,
    Run,
    Workload,
    grid,
)
from keras_skip.bench.workers import workloads

#: Shards are drawn once per cell with this seed: the seeds of a cell vary
#: the initial weights and the order of the batches, not the skew.
SHARD_SEED = 0
#: Validation windows of the language model: count and seed.
VALIDATION_WINDOWS = 512
VALIDATION_SEED = 12345
#: Steps per call of the train function. More than 1 made the language
#: model's train function take minutes longer to compile on 8 replicas.
STEPS_PER_EXECUTION = 1


class Dataset:
    """A workload's training data, its shards per replica count, and its
    validation set, loaded once per process."""

    def __init__(self, spec: Workload):
        self.spec = spec
        if spec.name == "lm":
            self.corpus = data.load_corpus()
            length = spec.size["length"]
            rows = data.windows(
                self.corpus.validation, length, VALIDATION_WINDOWS, VALIDATION_SEED
            )
            self.validation = (
                rows[:, :-1].astype("int32"),
                rows[:, 1:].astype("int32"),
            )
        else:
            (self.x, self.y), (x_val, y_val) = workloads.load_mnist_subset(0)
            self.validation = (x_val, y_val)
        self._shards: dict = {}

    def shards(self, kind: str, replicas: int) -> list[np.ndarray]:
        """Index arrays (images) or token arrays (text), one per replica."""
        key = (kind, replicas)
        if key not in self._shards:
            if self.spec.name == "lm":
                made = data.text_shards(self.corpus, replicas, kind, SHARD_SEED)
            else:
                made = data.label_shards(
                    self.y, replicas, kind, SHARD_SEED, min_size=self.spec.batch
                )
            self._shards[key] = made
        return self._shards[key]

    def describe(self, kind: str, replicas: int) -> dict:
        """Sizes (and, for labels, the skew) of the shards, for the results."""
        shards = self.shards(kind, replicas)
        described = {"sizes": [len(s) for s in shards]}
        if self.spec.name != "lm":
            described["skew"] = round(data.skew(self.y, shards), 4)
        return described

    def distributed(self, strategy, kind: str, seed: int):
        """The training data of ``strategy``'s replicas: replica ``i`` reads
        shard ``i`` only. ``InputReplicationMode.PER_REPLICA`` calls the
        function once per replica, with ``input_pipeline_id`` its index."""
        import tensorflow as tf

        replicas = strategy.num_replicas_in_sync
        shards = self.shards(kind, replicas)
        spec = self.spec

        def per_replica(context):
            i = context.input_pipeline_id
            shard = shards[i]
            order = seed * 1009 + i
            if spec.name == "lm":
                length = spec.size["length"]
                rows = data.windows(shard, length, spec.steps * spec.batch, order)
                return (
                    tf.data.Dataset.from_tensor_slices(rows)
                    .batch(spec.batch, drop_remainder=True)
                    .map(
                        lambda r: (
                            tf.cast(r[:, :-1], "int32"),
                            tf.cast(r[:, 1:], "int32"),
                        )
                    )
                    .repeat()
                )
            return (
                tf.data.Dataset.from_tensor_slices((self.x[shard], self.y[shard]))
                .shuffle(len(shard), seed=order, reshuffle_each_iteration=True)
                .repeat()
                .batch(spec.batch, drop_remainder=True)
            )

        options = tf.distribute.InputOptions(
            experimental_replication_mode=tf.distribute.InputReplicationMode.PER_REPLICA
        )
        return strategy.distribute_datasets_from_function(per_replica, options)


def build_model(spec: Workload):
    return models.BUILDERS[spec.name](**spec.size)


def inner_optimizer(spec: Workload, inner: str):
    """SGD with momentum 0.9 at a constant rate, or AdamW with a linear
    warm-up to the peak rate and a cosine decay to 0 at the last step."""
    import keras

    rate = spec.learning_rates[inner]
    if inner == "sgdm":
        return keras.optimizers.SGD(rate, momentum=0.9)
    if inner == "adamw":
        warmup = min(spec.warmup, spec.steps // 8)
        schedule = keras.optimizers.schedules.CosineDecay(
            0.0,
            decay_steps=spec.steps - warmup,
            warmup_target=rate,
            warmup_steps=warmup,
        )
        return keras.optimizers.AdamW(schedule, weight_decay=spec.weight_decay)
    raise ValueError(f"inner optimizer {inner!r} is not 'sgdm' or 'adamw'")


def optimizer(spec: Workload, run: Run):
    """The real ``SkipCorrectionOptimizer`` of ``run``'s method."""
    import keras

    import keras_skip

    method = METHODS[run.method]
    outer = None
    if method.outer:
        momentum = OUTER_MOMENTUM
        if method.outer_momentum is not None:
            momentum = method.outer_momentum
        outer = keras.optimizers.SGD(
            OUTER_LEARNING_RATE, momentum=momentum, nesterov=True
        )
    return keras_skip.SkipCorrectionOptimizer(
        inner_optimizer(spec, run.cell.inner),
        interval=1 if method.synchronous else run.cell.interval,
        correction=method.correction,
        optimizer_state=method.optimizer_state,
        outer_optimizer=outer,
    )


def _loss(logits: np.ndarray, labels: np.ndarray) -> tuple[float, float]:
    """Mean cross-entropy and accuracy of ``logits`` against ``labels``."""
    logits = logits.reshape(-1, logits.shape[-1]).astype("float64")
    labels = labels.reshape(-1)
    shifted = logits - logits.max(axis=1, keepdims=True)
    log_z = np.log(np.exp(shifted).sum(axis=1))
    loss = float(np.mean(log_z - shifted[np.arange(len(labels)), labels]))
    accuracy = float(np.mean(shifted.argmax(axis=1) == labels))
    return loss, accuracy


def evaluate(model, validation, batch: int = 256) -> tuple[float, float]:
    x, y = validation
    logits = np.concatenate(
        [
            np.asarray(model(x[i : i + batch], training=False))
            for i in range(0, len(x), batch)
        ]
    )
    return _loss(logits, y)


def replica_weights(model, strategy) -> tuple[list[np.ndarray], float]:
    """The mean over replicas of every weight, and the largest difference
    between a replica's copy and replica 0's (0 right after an average)."""
    means, spread = [], 0.0
    for variable in model.weights:
        copies = [
            np.asarray(c) for c in strategy.experimental_local_results(variable.value)
        ]
        means.append(np.mean(copies, axis=0))
        for c in copies[1:]:
            spread = max(spread, float(np.abs(c - copies[0]).max()))
    return means, spread


def train(spec: Workload, run: Run, dataset: Dataset, strategy) -> dict:
    """Trains ``run`` on ``strategy`` (whose replicas are the cell's) and
    returns its curve: ``[step, validation loss, validation accuracy]`` at
    every step of the grid, and at the last step after the final average."""
    import keras

    import keras_skip

    if strategy.num_replicas_in_sync != run.cell.replicas:
        raise ValueError(
            f"{run.key} needs {run.cell.replicas} replicas, the strategy has "
            f"{strategy.num_replicas_in_sync}"
        )
    every = spec.every if METHODS[run.method].synchronous else grid(run.cell, spec)
    keras.utils.set_random_seed(run.seed)
    with strategy.scope():
        model = build_model(spec)
        model.compile(
            optimizer=optimizer(spec, run),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            steps_per_execution=STEPS_PER_EXECUTION,
        )
    probe = build_model(spec)
    curve: list[list[float]] = []
    spreads: list[float] = []
    clock: list[float] = []

    def record(step: int, weights: list[np.ndarray]) -> None:
        probe.set_weights(weights)
        loss, accuracy = evaluate(probe, dataset.validation)
        curve.append([step, round(loss, 5), round(accuracy, 5)])

    class Evaluate(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            step = batch + 1
            if step % every == 0 and step < spec.steps:
                clock.append(round(time.perf_counter() - start, 2))
                weights, spread = replica_weights(model, strategy)
                spreads.append(spread)
                record(step, weights)

    record(0, model.get_weights())
    start = time.perf_counter()
    model.fit(
        dataset.distributed(strategy, run.cell.shards, run.seed),
        epochs=1,
        steps_per_epoch=spec.steps,
        verbose=0,
        callbacks=[keras_skip.SkipCorrectionCallback(), Evaluate()],
    )
    seconds = time.perf_counter() - start
    clock.append(round(seconds, 2))
    record(spec.steps, model.get_weights())
    optimizer_ = model.optimizer
    final_loss = curve[-1][1]
    return {
        "key": run.key,
        "workload": spec.name,
        "inner": run.cell.inner,
        "shards": run.cell.shards,
        "interval": 1 if METHODS[run.method].synchronous else run.cell.interval,
        "replicas": run.cell.replicas,
        "method": run.method,
        "seed": run.seed,
        "steps": spec.steps,
        "every": every,
        "curve": curve,
        "final_loss": final_loss,
        "final_accuracy": curve[-1][2],
        "final_perplexity": round(math.exp(final_loss), 4) if final_loss < 50 else None,
        "averages": int(optimizer_.averages_performed),
        "max_spread_at_evaluations": max(spreads, default=0.0),
        "parameters": int(model.count_params()),
        "seconds": round(seconds, 2),
        "clock": clock,
    }
