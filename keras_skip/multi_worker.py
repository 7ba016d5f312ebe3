"""Training on several workers with `tf.distribute.MultiWorkerMirroredStrategy`.

Each worker is a process (usually one per machine) that reads its role from
the ``TF_CONFIG`` environment variable. This module creates the strategy with
bounded failure detection, tells a worker who it is, and lets workers agree
on values before training (a mismatch would deadlock a collective later).
"""

from __future__ import annotations

import zlib
from collections.abc import Mapping

import numpy as np
import tensorflow as tf

from keras_skip import _checks
from keras_skip._compat import collectives, originals


def multi_worker_strategy(
    peer_timeout: float = 10.0,
    communication_options: tf.distribute.experimental.CommunicationOptions
    | None = None,
) -> tf.distribute.MultiWorkerMirroredStrategy:
    """A `MultiWorkerMirroredStrategy` whose workers notice a dead peer in time.

    If a worker dies (killed, out of memory, machine lost), the others would
    otherwise block in their next collective until TensorFlow's default
    heartbeat timeout. With this strategy every surviving worker stops with
    `tf.errors.UnavailableError` ("The following tasks are unhealthy (stopped
    sending heartbeats)") within about `peer_timeout` seconds; restart the job
    to resume from the last backup (see `keras_skip.BackupAndRestore`).

    Call it once per process, before any other TensorFlow work, with
    ``TF_CONFIG`` set.

    Args:
        peer_timeout: Seconds without a heartbeat after which a worker is
            declared dead, default 10. Lower values detect failures sooner;
            keep it above the longest pause of a worker's process (a few
            seconds is safe: heartbeats are sent from a background thread).
        communication_options: Passed to the strategy.

    Example:

    ```python
    import keras
    import keras_skip

    strategy = keras_skip.multi_worker_strategy(peer_timeout=5)
    with strategy.scope():
        model = keras.Sequential([keras.Input((784,)), keras.layers.Dense(10)])
        model.compile(
            optimizer=keras_skip.SkipCorrectionOptimizer(keras.optimizers.SGD(0.05)),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
    ```
    """
    peer_timeout = _checks.positive("peer_timeout", peer_timeout)
    collectives.configure_peer_timeout(peer_timeout)
    return tf.distribute.MultiWorkerMirroredStrategy(
        communication_options=communication_options
    )


def num_workers(strategy: tf.distribute.Strategy) -> int:
    """Number of worker processes taking part in `strategy`."""
    if not originals.is_multi_worker(strategy):
        return 1
    return strategy.num_replicas_in_sync // len(strategy.extended.worker_devices)


def worker_index(strategy: tf.distribute.Strategy) -> int:
    """This process's index among the workers, from 0 to `num_workers` - 1.

    Distinct on every process that trains: without a ``chief`` job it is the
    task's index in the ``worker`` job; with one the chief is 0 and
    ``worker`` task ``i`` is ``i + 1``. This is TensorFlow's own numbering
    (``id_in_cluster``), the order of the workers' replicas in a collective.
    0 with a single worker. An ``evaluator`` task does not train with the
    workers; TensorFlow numbers it in its own partition, by its task index.
    """
    if num_workers(strategy) == 1:
        return 0
    return _index_in_cluster(strategy.cluster_resolver)


def _index_in_cluster(
    resolver: tf.distribute.cluster_resolver.ClusterResolver,
) -> int:
    # The rule of tensorflow.python.distribute.multi_worker_util.id_in_cluster
    # (tensorflow 2.21), on public APIs: the task ids of the "chief" and the
    # "worker" job both start at 0.
    task_type, task_id = resolver.task_type, int(resolver.task_id or 0)
    if task_type == "chief":
        return 0
    if task_type == "worker":
        cluster = resolver.cluster_spec()
        chiefs = cluster.num_tasks("chief") if "chief" in cluster.jobs else 0
        return chiefs + task_id
    if task_type == "evaluator":
        return task_id
    raise ValueError(
        "Only 'chief', 'worker' and 'evaluator' tasks have a worker index. "
        f"Received: task_type={task_type!r}"
    )


#: Values per all-reduce of `gather`: every call reuses one traced function.
GATHER_WIDTH = 16


def gather(strategy: tf.distribute.Strategy, values) -> np.ndarray:
    """Every replica's copy of a small float vector, on every worker.

    A collective: every worker must call it at the same point, with vectors of
    the same length. Returns an array of shape ``(replicas, len(values))``,
    replica order, identical on all workers. Vectors travel in chunks of
    `GATHER_WIDTH` values, one all-reduce of ``8 * replicas * GATHER_WIDTH``
    bytes per replica each, so that one function, traced on the first call,
    serves every later one.
    """
    values = np.asarray(values, dtype=np.float64).reshape(-1)
    chunks = max(1, -(-values.size // GATHER_WIDTH))
    padded = np.zeros(chunks * GATHER_WIDTH)
    padded[: values.size] = values
    function = _gather_function(strategy)
    with strategy.scope():
        rows = [
            function(tf.constant(chunk)).numpy()
            for chunk in padded.reshape(chunks, GATHER_WIDTH)
        ]
    return np.concatenate(rows, axis=1)[:, : values.size]


def _gather_function(strategy: tf.distribute.Strategy):
    # Kept on the strategy: a cache keyed by id() could hand a later strategy
    # a function bound to a dead one.
    function = getattr(strategy, "_keras_skip_gather", None)
    if function is None:
        n = strategy.num_replicas_in_sync

        @tf.function(autograph=False)
        def function(vector):
            def own_row():
                replica = tf.distribute.get_replica_context().replica_id_in_sync_group
                return (
                    tf.one_hot(replica, n, dtype=tf.float64)[:, None] * vector[None, :]
                )

            extended = strategy.extended
            rows = extended.call_for_each_replica(own_row)
            if n > 1:
                rows = extended.batch_reduce_to(
                    tf.distribute.ReduceOp.SUM, [(rows, rows)]
                )[0]
            return strategy.experimental_local_results(rows)[0]

        strategy._keras_skip_gather = function
    return function


def sum_over_workers(strategy: tf.distribute.Strategy, vector) -> np.ndarray:
    """The sum over workers of a float vector each worker passes its own of.

    A collective: every worker must call it at the same point, with vectors
    of the same length. One all-reduce of ``8 * len(vector)`` bytes per
    replica; the function is traced once per length.
    """
    vector = np.asarray(vector, dtype=np.float64).reshape(-1)
    functions = getattr(strategy, "_keras_skip_sums", None)
    if functions is None:
        functions = {}
        strategy._keras_skip_sums = functions
    function = functions.get(vector.size)
    if function is None:
        local = len(strategy.extended.worker_devices)

        @tf.function(autograph=False)
        def function(vector):
            def own_share():
                replica = tf.distribute.get_replica_context().replica_id_in_sync_group
                # The worker's first replica brings the vector, the others 0.
                return vector * tf.cast(tf.equal(replica % local, 0), tf.float64)

            extended = strategy.extended
            shares = extended.call_for_each_replica(own_share)
            total = extended.batch_reduce_to(
                tf.distribute.ReduceOp.SUM, [(shares, shares)]
            )[0]
            return strategy.experimental_local_results(total)[0]

        functions[vector.size] = function
    with strategy.scope():
        return function(tf.constant(vector)).numpy()


def check_same_configuration(
    strategy: tf.distribute.Strategy, configuration: Mapping[str, object]
) -> None:
    """Raises the same ValueError on every worker if their configurations differ.

    ``configuration`` maps names to numbers or strings (strings are compared
    through a checksum). A collective: every worker must call it with the
    same names in the same order. With a single worker it does nothing.
    """
    if num_workers(strategy) == 1:
        return
    names = list(configuration)
    encoded = [_encode(configuration[name]) for name in names]
    rows = gather(strategy, encoded)
    per_worker = rows[:: strategy.num_replicas_in_sync // num_workers(strategy)]
    differing = [
        name for i, name in enumerate(names) if len(set(per_worker[:, i].tolist())) > 1
    ]
    if not differing:
        return
    described = []
    for name in differing:
        column = per_worker[:, names.index(name)]
        values = ", ".join(
            f"worker {w} {_describe(configuration[name], value)}"
            for w, value in enumerate(column)
        )
        described.append(f"{name}: {values}")
    raise ValueError(
        "The workers are not configured alike, so their collectives would not "
        f"match and training would deadlock. Differing: {'; '.join(described)}. "
        "Start every worker with the same keras-skip version and arguments."
    )


def _encode(value) -> float:
    if value is None:
        value = "None"
    if isinstance(value, str):
        return float(zlib.crc32(value.encode()))
    return float(value)


def _describe(local_value, encoded: float) -> str:
    """A worker's value as this worker can tell it (strings travel as checksums)."""
    if local_value is None:
        local_value = "None"
    if isinstance(local_value, str):
        return (
            repr(local_value)
            if encoded == _encode(local_value)
            else "a different value"
        )
    return f"{encoded:g}"
