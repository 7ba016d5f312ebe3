"""Collectives: keys no other strategy uses, variables created without a
broadcast, and how fast surviving workers notice a dead peer."""

from __future__ import annotations

import contextlib
import functools

import tensorflow as tf

_next_group_key = 10_000


def isolate_collective_keys(strategy) -> None:
    """Gives a ``MirroredStrategy`` collective keys no other strategy uses.

    Every ``MirroredStrategy`` in a process numbers its collectives from the
    same group and instance keys, and the runtime remembers each key's shape:
    a second strategy in the same process whose collectives differ in shape
    fails with "Shape mismatch in the collective instance"
    (tensorflow/tensorflow#62790). keras-skip adds collectives (averages)
    that stock training lacks, so it meets this whenever a notebook trains a
    second model. Moving the strategy to a group key of its own avoids it;
    functions traced before keep their keys. ``MultiWorkerMirroredStrategy``
    is left alone: its keys must agree across worker processes.
    """
    global _next_group_key
    if not isinstance(strategy, tf.distribute.MirroredStrategy):
        return
    if getattr(strategy, "_keras_skip_isolated", False):
        return
    from tensorflow.python.distribute import cross_device_ops

    collective = getattr(strategy.extended, "_collective_ops", None)
    if not isinstance(collective, cross_device_ops.CollectiveAllReduce):
        return
    keys = collective._collective_keys
    with keys._lock:
        keys._group_key = _next_group_key
        group_key = keys._get_new_group_key(collective._devices)
        keys._known_groups[",".join(collective._devices)] = group_key
        _next_group_key = keys._group_key
    for launcher in collective._launchers:
        launcher._group_key = group_key
    strategy._keras_skip_isolated = True


@contextlib.contextmanager
def created_alike(strategy):
    """Variables created inside take their initial value on every worker as
    it is, instead of receiving worker 0's.

    ``MultiWorkerMirroredStrategy`` broadcasts every new variable's initial
    value from worker 0, so that random initial weights agree. An
    optimizer's variables start from zeros or constants, the same on every
    worker by construction; broadcasting them puts a copy of the model on
    the wire for each kind (corrections, slots, period starts, compression
    errors) while the first step waits. Inside, the strategy creates
    variables as ``MirroredStrategy`` does (the first device's initial value,
    copied to the worker's other devices). Every worker must create the same
    variables inside, as they do when the optimizer is built: the collective
    keys the skipped broadcasts would have taken are then skipped alike.
    An optimizer whose variables started from unseeded random values would
    start apart across workers here; no Keras optimizer does. Uses
    ``MirroredExtended._get_variable_creator_initial_value`` (tensorflow
    2.19-2.21).
    """
    extended = strategy.extended
    if not isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy) or (
        getattr(extended, "_num_workers", 1) <= 1
    ):
        yield
        return
    from tensorflow.python.distribute import mirrored_strategy

    name = "_get_variable_creator_initial_value"
    before = extended.__dict__.get(name)
    setattr(
        extended,
        name,
        functools.partial(getattr(mirrored_strategy.MirroredExtended, name), extended),
    )
    try:
        yield
    finally:
        if before is None:
            delattr(extended, name)
        else:
            setattr(extended, name, before)


# ---------------------------------------------------------------------------
# Failure detection between workers.
# ---------------------------------------------------------------------------


def configure_peer_timeout(seconds: float) -> None:
    """Makes surviving workers notice a dead peer within about ``seconds``.

    Sets the heartbeat timeout of TensorFlow's coordination service, which
    aborts every collective once a worker stops sending heartbeats (default
    about 10 s). Must run before ``MultiWorkerMirroredStrategy`` is created,
    which then keeps this configuration. Uses
    ``context.configure_coordination_service`` (tensorflow 2.21).
    """
    from tensorflow.compiler.xla.tsl.protobuf import coordination_config_pb2
    from tensorflow.python.distribute import multi_worker_util
    from tensorflow.python.eager import context

    resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
    cluster = resolver.cluster_spec()
    jobs = [
        coordination_config_pb2.CoordinatedJob(
            name=job, num_tasks=cluster.num_tasks(job)
        )
        for job in ("chief", "worker")
        if job in cluster.jobs
    ]
    # The same service MultiWorkerMirroredStrategy would configure, with a
    # shorter heartbeat timeout.
    context.context().configure_coordination_service(
        service_type="standalone",
        service_leader=multi_worker_util.coordination_leader(cluster),
        coordinated_jobs=jobs,
        heartbeat_timeout_in_ms=int(seconds * 1000),
    )
