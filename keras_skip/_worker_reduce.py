"""A delayed average's all-reduce across workers, made of steps that can
run beside the training steps, with one or several devices per worker and
with compression.

A delayed average runs its all-reduce in a thread while the next local
steps compute. Through ``MultiWorkerMirroredStrategy``'s own collectives,
which join every device of every worker, such an all-reduce was seen to wait
for good beside the steps (the same as between one worker's devices; with
one device per worker, once on 2 busy cores), while one collective per
worker, from one device each, in a group of its own and in a fixed order,
runs beside them; so do a compressed average's two all-reduces once they
are ordered, where through the strategy's collectives they too were seen to
wait for good.
This reduction has that shape: each worker sums its replicas' values on its
first device (copies, no collective), the workers all-reduce those sums
between their first devices (one collective per dtype, one after the other
in the same order on every worker), and each worker copies the result back
to its devices. It also sends each worker's values once rather than once
per device.
"""

from __future__ import annotations

import itertools

import tensorflow as tf

from keras_skip import multi_worker

#: A collective group key no ``MultiWorkerMirroredStrategy`` uses (they
#: number their groups from 1), for the group of every worker's first device.
GROUP_KEY = 1 << 30
#: Instance keys of that group. Every worker traces its delayed averages at
#: the same points, in the same order, so the keys agree across workers.
_instance_keys = itertools.count(1)


class ThroughOneDevicePerWorker(tf.distribute.CrossDeviceOps):
    """Reduces per-replica values of a ``MultiWorkerMirroredStrategy`` through
    each worker's first device, with one collective per worker.

    Example (inside a ``tf.function``, under the strategy's scope)::

        through = ThroughOneDevicePerWorker(strategy)
        means = through.batch_reduce(
            tf.distribute.ReduceOp.MEAN, [(per_replica, variable)]
        )
    """

    def __init__(self, strategy: tf.distribute.Strategy):
        super().__init__()
        extended = strategy.extended
        self._device = extended.worker_devices[0]
        self._workers = multi_worker.num_workers(strategy)
        self._replicas = int(strategy.num_replicas_in_sync)
        #: The last collective traced: the next one (also of a later batch,
        #: such as a compressed average's second) waits for it.
        self._last: tf.Tensor | None = None

    @property
    def _num_between_graph_workers(self) -> int:
        # The base class returns a replica's value unreduced when it is the
        # only one of its worker and believes there are no other workers.
        return self._workers

    def reduce_implementation(
        self, reduce_op, per_replica_value, destinations, options
    ):
        (reduced,) = self.batch_reduce_implementation(
            reduce_op, [(per_replica_value, destinations)], options
        )
        return reduced

    def batch_reduce_implementation(self, reduce_op, value_destination_pairs, options):
        del options  # the collectives' timeout is the coordination service's
        if reduce_op not in (tf.distribute.ReduceOp.SUM, tf.distribute.ReduceOp.MEAN):
            raise ValueError(f"reduce_op must be SUM or MEAN, not {reduce_op}")
        with tf.device(self._device):
            sums = [_local_sum(value) for value, _ in value_destination_pairs]
            totals = self._all_reduce(sums)
            if reduce_op == tf.distribute.ReduceOp.MEAN:
                totals = [total / self._replicas for total in totals]
        return [
            self.broadcast(total, destinations)
            for total, (_, destinations) in zip(
                totals, value_destination_pairs, strict=True
            )
        ]

    def _all_reduce(self, sums: list[tf.Tensor]) -> list[tf.Tensor]:
        """Sums between the workers: one flat collective per dtype, each
        after the one traced before it in the same function (the same order
        on every worker; a compressed average's two all-reduces, through the
        strategy's collectives, were seen to wait for good beside the
        steps)."""
        if self._workers == 1:
            return list(sums)
        totals: list[tf.Tensor | None] = [None] * len(sums)
        dtypes = list(dict.fromkeys(s.dtype for s in sums))
        for dtype in dtypes:
            chosen = [i for i, s in enumerate(sums) if s.dtype == dtype]
            previous = []
            if self._last is not None and self._last.graph is sums[0].graph:
                previous = [self._last]
            with tf.control_dependencies(previous):
                flat = tf.concat([tf.reshape(sums[i], [-1]) for i in chosen], 0)
            reduced = tf.raw_ops.CollectiveReduceV2(
                input=flat,
                group_size=self._workers,
                group_key=GROUP_KEY,
                instance_key=next(_instance_keys),
                ordering_token=[],
                merge_op="Add",
                final_op="Id",
            )
            self._last = reduced
            sizes = [sums[i].shape.num_elements() for i in chosen]
            for i, part in zip(chosen, tf.split(reduced, sizes), strict=True):
                totals[i] = tf.reshape(part, tf.shape(sums[i]))
        return totals


def _local_sum(value) -> tf.Tensor:
    parts = getattr(value, "values", (value,))
    if any(isinstance(p, tf.IndexedSlices) for p in parts):
        raise TypeError("a delayed average reduces dense tensors only")
    return tf.add_n([tf.identity(p) for p in parts])
