"""Workarounds for Keras and TensorFlow behaviour that keras-skip depends on.

Each workaround names the releases it was checked against and has a test in
``tests/test_compat.py`` that fails when an upstream release changes the
behaviour it patches, so that it can be removed or updated.

Checked with keras 3.15.1 and tensorflow 2.21.0.
"""

from __future__ import annotations

import contextlib

import keras
import tensorflow as tf

CHECKED_KERAS = "3.15.1"
CHECKED_TENSORFLOW = "2.21.0"


def averaged_model_state(model: keras.Model) -> list[keras.Variable]:
    """The model's non-trainable floating-point variables that training updates.

    These are the variables a layer creates with ``trainable=False`` (the
    moving statistics of ``BatchNormalization``) in layers that are trainable.
    Frozen layers (``layer.trainable = False``) are left out: training does not
    change them, so averaging them would only cost bandwidth. Integer state
    (seed generators, counters) is never averaged.

    Uses ``Layer._flatten_layers`` and ``Layer._non_trainable_variables``
    (keras 3.15): the public ``non_trainable_weights`` cannot tell a moving
    statistic from the weights of a frozen layer.
    """
    seen: set[int] = set()
    state = []
    for layer in model._flatten_layers(include_self=True, recursive=True):
        if not layer.trainable:
            continue
        for variable in layer._non_trainable_variables:
            if id(variable) in seen or not _is_float(variable):
                continue
            seen.add(id(variable))
            state.append(variable)
    return state


def _is_float(variable) -> bool:
    return tf.as_dtype(variable.dtype).is_floating


# ---------------------------------------------------------------------------
# Keras' TensorFlow trainer under tf.distribute.
# ---------------------------------------------------------------------------

_ORIGINALS: dict[str, object] = {}


def apply_keras_fixes() -> list[str]:
    """Patches Keras' TensorFlow trainer where it fails under tf.distribute.

    Each patch changes behaviour only in a case where stock Keras 3.15 raises,
    and delegates to Keras everywhere else:

    - ``symbolic_build``: under ``MultiWorkerMirroredStrategy``, ``fit`` and
      ``evaluate`` reduce the first batch with ``strategy.reduce("MEAN", ...)``
      just to learn its shapes, which fails ("Attempt to convert a value
      (PerReplica...) with an unsupported type"). The patch takes the local
      replica's batch instead.
    - ``scalar_logs``: under ``MultiWorkerMirroredStrategy`` the logs of every
      step are reduced with ``axis=0``, which fails on scalars ("Invalid
      reduction dimension 0 for input with 0 dimensions", tensorflow#72388).
      The patch reduces scalars with ``axis=None``.
    - ``steps_per_execution``: with ``steps_per_execution > 1`` on more than
      one replica (``MirroredStrategy`` or multi-worker), Keras calls the step
      inside a ``tf.cond`` in its ``tf.while_loop``, which fails at run time
      ("You must feed a value for placeholder tensor .../while/cond/
      Placeholder", keras-team/keras#19246). The patch runs the same loop
      without that redundant ``tf.cond`` (``unrolled_steps_per_execution`` is
      not used on this path).
    - ``loss_scale_agreement``: ``LossScaleOptimizer`` (what Keras wraps every
      optimizer in under the ``mixed_float16`` policy) decides whether a step's
      gradients are finite from replica 0's alone, "since grads is
      all-reduced". Local steps are not all-reduced: a replica with an
      overflow would apply it, and workers could disagree on whether to step,
      so one would wait in an average the others skip. When the
      ``LossScaleOptimizer`` wraps a ``SkipCorrectionOptimizer`` the patch
      all-reduces the verdict (one float per step) so that every replica
      skips the step if any overflowed; otherwise it is Keras' check.

    Idempotent; ``import keras_skip.optimizer`` applies it. Returns the names of
    the patches in force.
    """
    from keras.src.backend.tensorflow import trainer

    if not _ORIGINALS:
        _ORIGINALS["_maybe_symbolic_build"] = (
            trainer.TensorFlowTrainer._maybe_symbolic_build
        )
        _ORIGINALS["reduce_per_replica"] = trainer.reduce_per_replica
        _ORIGINALS["_make_function"] = trainer.TensorFlowTrainer._make_function
        _ORIGINALS["check_finite"] = keras.optimizers.LossScaleOptimizer.check_finite
        trainer.TensorFlowTrainer._maybe_symbolic_build = _maybe_symbolic_build
        trainer.reduce_per_replica = _reduce_per_replica
        trainer.TensorFlowTrainer._make_function = _make_function
        keras.optimizers.LossScaleOptimizer.check_finite = _check_finite
    return [
        "symbolic_build",
        "scalar_logs",
        "steps_per_execution",
        "loss_scale_agreement",
    ]


@contextlib.contextmanager
def keras_fixes_removed():
    """Stock Keras for the duration of the block (tests pin upstream bugs)."""
    from keras.src.backend.tensorflow import trainer

    applied = bool(_ORIGINALS)
    if applied:
        trainer.TensorFlowTrainer._maybe_symbolic_build = _ORIGINALS[
            "_maybe_symbolic_build"
        ]
        trainer.reduce_per_replica = _ORIGINALS["reduce_per_replica"]
        trainer.TensorFlowTrainer._make_function = _ORIGINALS["_make_function"]
        keras.optimizers.LossScaleOptimizer.check_finite = _ORIGINALS["check_finite"]
    try:
        yield
    finally:
        if applied:
            trainer.TensorFlowTrainer._maybe_symbolic_build = _maybe_symbolic_build
            trainer.reduce_per_replica = _reduce_per_replica
            trainer.TensorFlowTrainer._make_function = _make_function
            keras.optimizers.LossScaleOptimizer.check_finite = _check_finite


def _check_finite(self, grads):
    finite = _ORIGINALS["check_finite"](self, grads)
    if not getattr(self.inner_optimizer, "takes_local_steps", False):
        return finite
    context = tf.distribute.get_replica_context()
    if context is None or context.num_replicas_in_sync == 1:
        return finite
    overflowed = context.all_reduce(
        tf.distribute.ReduceOp.SUM, tf.cast(tf.logical_not(finite), tf.float32)
    )
    return tf.equal(overflowed, 0.0)


def is_multi_worker(strategy) -> bool:
    from keras.src.backend.tensorflow import trainer

    return trainer._collective_all_reduce_multi_worker(strategy)


def _maybe_symbolic_build(self, iterator=None, data_batch=None):
    if iterator is None or not is_multi_worker(self.distribute_strategy):
        return _ORIGINALS["_maybe_symbolic_build"](self, iterator, data_batch)
    from keras.src import tree

    strategy = self.distribute_strategy
    for _, _, it in iterator:
        batch = next(it)
        data_batch = tree.map_structure(
            lambda v: (
                strategy.experimental_local_results(v)[0]
                if isinstance(v, tf.distribute.DistributedValues)
                else v
            ),
            batch,
        )
        break
    with strategy.scope():
        self._symbolic_build(data_batch=data_batch)


def _reduce_per_replica(values, strategy, reduction):
    if reduction not in ("auto", "mean") or not is_multi_worker(strategy):
        return _ORIGINALS["reduce_per_replica"](values, strategy, reduction)
    from keras.src import tree

    def reduce(value):
        component = (
            value.values[0]
            if isinstance(value, tf.distribute.DistributedValues)
            else value
        )
        axis = None if component.shape.rank == 0 else 0
        return strategy.reduce("MEAN", value, axis=axis)

    return tree.map_structure(reduce, values)


def _make_function(self, step_function):
    if (
        self.steps_per_execution == 1
        or self.distribute_strategy.num_replicas_in_sync == 1
    ):
        return _ORIGINALS["_make_function"](self, step_function)
    from keras.src.backend.tensorflow import trainer

    strategy = self.distribute_strategy
    steps_per_execution = self.steps_per_execution

    @tf.autograph.experimental.do_not_convert
    def one_step_on_data(data):
        outputs = strategy.run(step_function, args=(data,))
        return trainer.reduce_per_replica(outputs, strategy, reduction="auto")

    if not self.run_eagerly:
        one_step_on_data = tf.function(
            one_step_on_data, reduce_retracing=True, jit_compile=self.jit_compile
        )
    one_step_on_data = self._autoconvert_optionals(one_step_on_data)

    @tf.autograph.experimental.do_not_convert
    def multi_step_on_iterator(iterator):
        empty_outputs = tf.experimental.Optional.empty(None)

        def condition(step, outputs, next_inputs):
            return tf.logical_and(
                tf.less(step, steps_per_execution), next_inputs.has_value()
            )

        def body(step, outputs, next_inputs):
            outputs = tf.experimental.Optional.from_value(
                one_step_on_data(next_inputs.get_value())
            )
            empty_outputs._element_spec = outputs.element_spec
            next_inputs = tf.cond(
                tf.less(step + 1, steps_per_execution),
                iterator.get_next_as_optional,
                lambda: next_inputs,
            )
            return step + 1, outputs, next_inputs

        _, outputs, _ = tf.while_loop(
            condition,
            body,
            [tf.constant(0), empty_outputs, iterator.get_next_as_optional()],
        )
        outputs._element_spec = empty_outputs.element_spec
        return outputs

    if not self.run_eagerly:
        multi_step_on_iterator = tf.function(
            multi_step_on_iterator, reduce_retracing=True
        )

    def function(iterator):
        if isinstance(iterator, (tf.data.Iterator, tf.distribute.DistributedIterator)):
            outputs = multi_step_on_iterator(iterator)
            if not outputs.has_value():
                raise StopIteration
            return outputs.get_value()
        outputs = None
        for _, data in zip(range(steps_per_execution), iterator, strict=False):
            outputs = one_step_on_data(data)
        return outputs

    return function


# ---------------------------------------------------------------------------
# Collective keys.
# ---------------------------------------------------------------------------

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
