"""Workarounds for Keras and TensorFlow behaviour that keras-skip depends on.

Every use of a private Keras or TensorFlow API lives here (the one exception:
the protected members of Keras' optimizer base class that
`SkipCorrectionOptimizer` uses as its subclass, listed in
`OPTIMIZER_SUBCLASS_PROTOCOL`; tests/test_compat.py checks both). Each names the
releases it was checked against and has a test in ``tests/test_compat.py``
that fails when an upstream release changes the behaviour it relies on or
patches, so that it can be removed or updated.

Nothing here changes Keras for a model that does not use
`SkipCorrectionOptimizer`: the trainer fixes are set on the model instances
compiled with it (:func:`prepare_model`), reached through one pass-through
hook installed when the first `SkipCorrectionOptimizer` is created
(:func:`install_model_hook`). :func:`apply_keras_fixes` is the explicit
opt-in that extends the trainer fixes to every model.

Checked with keras 3.15.1 and tensorflow 2.21.0.
"""

from __future__ import annotations

import contextlib
import re
import sys
import types

import keras
import numpy as np
import tensorflow as tf

CHECKED_KERAS = "3.15.1"
CHECKED_TENSORFLOW = "2.21.0"
#: The oldest releases the workarounds were tested with
#: (tests/test_oldest_versions.py runs the core of the suite with them).
OLDEST_KERAS = "3.12.0"
OLDEST_TENSORFLOW = "2.19.0"


# ---------------------------------------------------------------------------
# Versions.
# ---------------------------------------------------------------------------


def _minor(version: str) -> tuple[int, int]:
    """``(major, minor)`` of a version string such as ``"3.15.1"`` or
    ``"2.22.0rc1"``."""
    match = re.match(r"(\d+)\.(\d+)", version)
    if match is None:
        raise ValueError(f"Not a version number: {version!r}")
    return int(match.group(1)), int(match.group(2))


def untested_versions(
    keras_version: str | None = None, tensorflow_version: str | None = None
) -> list[str]:
    """The installed Keras and TensorFlow releases outside the tested range
    (compared by minor release), described for a warning; empty if none."""
    found = []
    for name, version, oldest, newest in (
        ("Keras", keras_version or keras.__version__, OLDEST_KERAS, CHECKED_KERAS),
        (
            "TensorFlow",
            tensorflow_version or tf.__version__,
            OLDEST_TENSORFLOW,
            CHECKED_TENSORFLOW,
        ),
    ):
        if not _minor(oldest) <= _minor(version) <= _minor(newest):
            low, high = (".".join(map(str, _minor(v))) for v in (oldest, newest))
            found.append(f"{name} {version} (tested: {low} to {high})")
    return found


def check_versions() -> None:
    """Warns once, naming the versions, when Keras or TensorFlow is outside
    the range keras-skip's workarounds were tested with."""
    untested = untested_versions()
    if untested:
        from keras_skip import _checks

        _checks.warn_at_caller(
            "keras-skip relies on Keras and TensorFlow internals that were "
            f"tested only within its supported range; found {', '.join(untested)}. "
            "Training may fail or give wrong results. Install versions in the "
            "supported range (see the installation docs) or run keras-skip's "
            "test suite against these versions first.",
            RuntimeWarning,
        )


# ---------------------------------------------------------------------------
# Model state that averages include.
# ---------------------------------------------------------------------------


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
# Private state of optimizers, variables and strategies.
# ---------------------------------------------------------------------------


#: The protected members of Keras' optimizer base class that
#: `SkipCorrectionOptimizer`, as a subclass, uses or overrides on itself, as
#: Keras' own wrapper (`LossScaleOptimizer`) does (keras 3.15). Any other
#: private member of a Keras or TensorFlow object is reached through a
#: function of this module.
OPTIMIZER_SUBCLASS_PROTOCOL = (
    "_backend_apply_gradients",  # overridden: the step under a strategy
    "_get_variable_index",  # a trainable variable's index into own state
    "_iterations",  # shared with the inner optimizer
    "_learning_rate",  # the base class's, set aside
    "_trainable_variables",  # the variables `build` was given
    "_var_key",  # a variable's key
    "_variables",  # the optimizer's own variables
)


def creation_strategy(optimizer) -> tf.distribute.Strategy:
    """The strategy a Keras optimizer was created under: Keras' TensorFlow
    optimizer stores ``tf.distribute.get_strategy()`` at construction as
    ``_distribution_strategy`` (keras 3.15) and builds its variables for it."""
    return optimizer._distribution_strategy


def iterations_variable(optimizer) -> keras.Variable:
    """The variable behind ``optimizer.iterations`` (``_iterations``,
    keras 3.15), which a wrapper shares to step the inner optimizer's
    counter."""
    return optimizer._iterations


def learning_rate_variable(optimizer):
    """The variable holding a float learning rate (``_learning_rate``,
    keras 3.15): a learning-rate schedule is kept there instead, as is."""
    return optimizer._learning_rate


def untracked():
    """A context in which attributes set on a Keras object are not tracked
    (``keras.src.utils.tracking.DotNotTrackScope``, keras 3.15): a shared
    variable assigned there does not become the object's own."""
    from keras.src.utils import tracking

    return tracking.DotNotTrackScope()


def untracked_method(method):
    """Runs `method` with Keras' attribute tracking off
    (``tracking.no_automatic_dependency_tracking``, keras 3.15), as Keras'
    own optimizers' ``build`` does."""
    from keras.src.utils import tracking

    return tracking.no_automatic_dependency_tracking(method)


def per_replica(values) -> tf.distribute.DistributedValues:
    """Distributed values with one component per local replica
    (``tensorflow.python.distribute.values.PerReplica``, tensorflow 2.21): what
    ``strategy.run`` returns, built from tensors computed in cross-replica
    context."""
    from tensorflow.python.distribute import values as tf_values

    return tf_values.PerReplica(tuple(values))


def local_copies(variable) -> list:
    """This worker's copies of a (mirrored or per-replica) TensorFlow
    variable: ``DistributedValues._values`` (tensorflow 2.21), the variable
    itself when it is not distributed."""
    values = getattr(variable, "_values", None)
    return list(values) if values is not None else [variable]


#: The base class of an object that `tf.train.Checkpoint` saves through its
#: own ``_serialize_to_tensors`` and ``_restore_from_tensors`` (tensorflow 2.21).
Trackable = tf.__internal__.tracking.Trackable


def add_checkpoint_dependency(parent, child, name: str) -> None:
    """Makes `child` a checkpoint dependency of `parent` under `name`
    (``Trackable._track_trackable``, tensorflow 2.21): restored after it."""
    parent._track_trackable(child, name=name)


def set_initial_epoch(model: keras.Model, epoch: int) -> None:
    """Makes ``fit`` start at `epoch`, as Keras' own ``BackupAndRestore``
    does from ``on_train_begin`` (``Model._initial_epoch``, keras 3.15)."""
    model._initial_epoch = epoch


# ---------------------------------------------------------------------------
# A wrapped optimizer's own hooks, run from cross-replica context.
# ---------------------------------------------------------------------------


def _base_optimizer_class():
    from keras.src.backend.tensorflow.optimizer import TFOptimizer

    return TFOptimizer


#: Methods through which Keras' `Optimizer.apply` reaches the update, in the
#: order it calls them. A wrapped optimizer may override the ones keras-skip
#: calls itself (`_clip_gradients`, `_apply_weight_decay`,
#: `_backend_update_step`, `update_step`), not the others: keras-skip
#: replaces them.
REPLACED_METHODS = ("apply", "apply_gradients", "_backend_apply_gradients")


def replaced_overrides(optimizer) -> list[str]:
    """The methods of `REPLACED_METHODS` that the optimizer's class overrides
    (keras-skip would silently bypass them)."""
    base = keras.optimizers.Optimizer
    return [
        name
        for name in REPLACED_METHODS
        if getattr(type(optimizer), name) is not getattr(base, name)
    ]


def build_tracked(optimizer, var_list) -> None:
    """Builds a wrapped optimizer with Keras' attribute tracking on.

    An optimizer's state created as a plain attribute (Nadam's momentum
    schedule `_u_product`) joins its `variables`, and so its checkpoints,
    only through tracking, which the wrapper's own build (like Keras'
    LossScaleOptimizer's, which may call it) turns off. Uses the global
    attribute ``tracking_on`` of ``keras.src.utils.tracking`` (keras 3.15).
    """
    from keras.src.backend.common import global_state

    saved = global_state.get_global_attribute("tracking_on", True)
    global_state.set_global_attribute("tracking_on", True)
    try:
        optimizer.build(var_list)
    finally:
        global_state.set_global_attribute("tracking_on", saved)


def clip_gradients(optimizer, grads: list) -> list:
    """The optimizer's own gradient clipping (`clipnorm`, `global_clipnorm`,
    `clipvalue`), ``BaseOptimizer._clip_gradients`` (keras 3.15)."""
    return optimizer._clip_gradients(grads)


def _no_merge_call() -> bool:
    return False


@contextlib.contextmanager
def _merge_calls_run_directly(strategy):
    """Keras' TensorFlow optimizer reaches cross-replica context through
    ``maybe_merge_call``, which calls ``get_replica_context().merge_call``:
    None, and an AttributeError, when the caller is in cross-replica context
    already. While the strategy reports that it needs no merge call,
    ``maybe_merge_call`` calls the function itself with the strategy, which
    is what cross-replica context needs (``_use_merge_call``, tensorflow
    2.21)."""
    extended = strategy.extended
    extended._use_merge_call = _no_merge_call
    try:
        yield
    finally:
        del extended._use_merge_call


def optimizer_step(optimizer, distribution, grads, variables, learning_rate) -> None:
    """One step of a Keras optimizer, taken from cross-replica context.

    Runs what ``Optimizer.apply`` runs after clipping, with the optimizer's
    own hooks: its weight decay (``_apply_weight_decay``) and its update
    (``_backend_update_step``, which calls ``update_step`` on each variable
    through ``extended.update``; Nadam's, for one, also advances a
    momentum schedule there). `grads` are per-replica values: a different
    gradient per replica is a local step, an all-reduced one a synchronous
    step. Keras' gradient all-reduce is skipped because there is no replica
    context. `variables` are the Keras variables.
    """
    with _merge_calls_run_directly(distribution):
        apply_weight_decay(optimizer, distribution, variables)
        optimizer._backend_update_step(grads, list(variables), learning_rate)


def apply_weight_decay(optimizer, distribution, variables) -> None:
    """The optimizer's weight decay on each replica's own copy.

    Keras' TensorFlow optimizer decays each copy through ``extended.update``
    and is called from cross-replica context as it is. An override (Muon's
    separate decay of its Adam-handled variables, or a user's) assigns the
    variable directly, which in cross-replica context would write replica
    0's decayed copy into every replica; it runs inside ``extended.update``
    instead, where reading and assigning the variable reach one replica's
    copy.
    """
    if not _overrides(optimizer, "_apply_weight_decay"):
        optimizer._apply_weight_decay(list(variables))
        return
    for variable in variables:
        distribution.extended.update(
            variable.value,
            lambda _copy, variable=variable: optimizer._apply_weight_decay([variable]),
            group=False,
        )


def _overrides(optimizer, name: str) -> bool:
    return getattr(type(optimizer), name) is not getattr(_base_optimizer_class(), name)


# ---------------------------------------------------------------------------
# Keras' TensorFlow trainer, for models compiled with SkipCorrectionOptimizer.
# ---------------------------------------------------------------------------


def _trainer_class():
    from keras.src.backend.tensorflow import trainer

    return trainer.TensorFlowTrainer


def _trainer_module():
    from keras.src.backend.tensorflow import trainer

    return trainer


#: Keras' own methods and functions, as they were before any patch.
_KERAS: dict[str, object] = {}
#: Whether `apply_keras_fixes` extended the trainer fixes to every model.
_GLOBAL_FIXES = False
#: Inside `keras_fixes_removed`: no model or optimizer gets a fix.
_STOCK = False


def _keep_keras_originals() -> None:
    if not _KERAS:
        trainer = _trainer_module()
        _KERAS["_maybe_symbolic_build"] = trainer.TensorFlowTrainer.__dict__[
            "_maybe_symbolic_build"
        ]
        _KERAS["_make_function"] = trainer.TensorFlowTrainer.__dict__["_make_function"]
        _KERAS["reduce_per_replica"] = trainer.reduce_per_replica
        _KERAS["check_finite"] = keras.optimizers.LossScaleOptimizer.__dict__[
            "check_finite"
        ]


def skip_optimizer(optimizer):
    """The SkipCorrectionOptimizer that `optimizer` is or wraps (in the
    LossScaleOptimizer Keras adds under ``mixed_float16``), or None."""
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        optimizer = optimizer.inner_optimizer
    return optimizer if getattr(optimizer, "takes_local_steps", False) else None


def install_model_hook() -> None:
    """Lets the models compiled with a SkipCorrectionOptimizer get their fixes.

    Wraps ``TensorFlowTrainer._maybe_symbolic_build``, the first thing
    ``fit``, ``evaluate``, ``train_on_batch`` and ``test_on_batch`` do, so
    that it calls :func:`prepare_model` on a model compiled with a
    SkipCorrectionOptimizer and goes straight to Keras' own method for every
    other model (unless :func:`apply_keras_fixes` was called). Called when
    the first SkipCorrectionOptimizer is created; idempotent.
    """
    _keep_keras_originals()
    cls = _trainer_class()
    if getattr(cls.__dict__["_maybe_symbolic_build"], "_keras_skip_hook", False):
        return

    def _maybe_symbolic_build_hook(self, iterator=None, data_batch=None):
        if skip_optimizer(getattr(self, "optimizer", None)) is not None:
            prepare_model(self)
            return self._maybe_symbolic_build(iterator, data_batch)
        if _GLOBAL_FIXES:
            return _maybe_symbolic_build(self, iterator, data_batch)
        return _KERAS["_maybe_symbolic_build"](self, iterator, data_batch)

    _maybe_symbolic_build_hook._keras_skip_hook = True
    cls._maybe_symbolic_build = _maybe_symbolic_build_hook


#: The instance attributes prepare_model sets, in the order it sets them.
MODEL_FIXES = (
    "_maybe_symbolic_build",
    "_make_function",
    "_get_metrics_result_or_logs",
    "reset_metrics",
)


def prepare_model(model: keras.Model) -> None:
    """Fixes, on this model only, what keras-skip needs of Keras' trainer.

    Set as instance attributes, so other models keep Keras' methods:

    - ``_maybe_symbolic_build``: under ``MultiWorkerMirroredStrategy``,
      ``fit`` and ``evaluate`` reduce the first batch with
      ``strategy.reduce("MEAN", ...)`` just to learn its shapes, which fails
      ("Attempt to convert a value (PerReplica...) with an unsupported
      type"). This takes the local replica's batch instead.
    - ``_make_function``: the train and test functions. Under
      ``MultiWorkerMirroredStrategy`` Keras reduces every step's scalar logs
      with ``axis=0``, which fails ("Invalid reduction dimension 0 for input
      with 0 dimensions", tensorflow#72388); these are reduced with
      ``axis=None``. With ``steps_per_execution > 1`` on more than one
      replica, Keras calls the step inside a ``tf.cond`` in its
      ``tf.while_loop``, which fails at run time ("You must feed a value for
      placeholder tensor .../while/cond/Placeholder", keras-team/keras#19246);
      the same loop runs without that redundant ``tf.cond``
      (``unrolled_steps_per_execution`` is not used on this path).
    - ``_get_metrics_result_or_logs``: ``fit`` calls it right after an
      epoch's last batch, before validation and before any callback's
      ``on_epoch_end``, whatever ended the epoch (its last step, the input
      running out, ``stop_training``). The replicas are averaged there, so
      that every callback sees the averaged model whatever the order of the
      callbacks list. ``evaluate`` calls it at its end, where nothing is
      pending and the average costs one read.
    - ``reset_metrics``: ``fit`` calls it at every epoch's start and
      ``evaluate`` at its own. Under ``MultiWorkerMirroredStrategy`` Keras
      assigns every metric variable in cross-replica context, and
      TensorFlow reads a variable of ``synchronization="on_read"`` back
      after such an assignment: one all-reduce across workers per metric
      variable (``SyncOnReadVariable.assign``, tensorflow 2.21), a round of
      messages each on a link with latency. The model's own
      ``reset_metrics`` runs in replica context instead, where the
      assignments are local.
    - A ``LossScaleOptimizer`` around the SkipCorrectionOptimizer gets
      :func:`agree_on_finite_gradients`.

    Idempotent. A train or test function made before by Keras' own method
    is made again.
    """
    _keep_keras_originals()
    if _STOCK or getattr(model, "_keras_skip_prepared", False):
        return
    fixes = {
        "_maybe_symbolic_build": types.MethodType(_maybe_symbolic_build, model),
        "_make_function": types.MethodType(_make_function, model),
        "_get_metrics_result_or_logs": types.MethodType(
            _get_metrics_result_or_logs, model
        ),
        "reset_metrics": types.MethodType(_reset_metrics, model),
        "_keras_skip_prepared": True,
    }
    # Plain attributes: Keras' and TensorFlow's tracking is not for methods.
    for name, value in fixes.items():
        object.__setattr__(model, name, value)
    if isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer):
        agree_on_finite_gradients(model.optimizer)
    if getattr(model, "train_function", None) is not None:
        model.make_train_function(force=True)
    if getattr(model, "test_function", None) is not None:
        model.make_test_function(force=True)


def _maybe_symbolic_build(self, iterator=None, data_batch=None):
    if iterator is None or not is_multi_worker(self.distribute_strategy):
        return _KERAS["_maybe_symbolic_build"](self, iterator, data_batch)
    from keras.src import tree

    strategy = self.distribute_strategy
    if skip_optimizer(getattr(self, "optimizer", None)) is not None and (
        getattr(iterator, "_keras_skip_read_locally", False)
        or read_epochs_locally(iterator, strategy)
    ):
        # The shapes come from the data's element spec: a batch taken from
        # the iterator several devices share would be missing from the
        # epoch, and one taken from a distributed iterator would leave that
        # iterator alive, which slows every later step (measured: 4 workers,
        # the benchmark MLP, about 13 ms of CPU per step).
        spec = iterator._keras_skip_element_spec if _needs_data(self) else None
        with strategy.scope():
            self._symbolic_build(data_batch=spec)
        return
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


def _needs_data(model) -> bool:
    """Whether ``Trainer._symbolic_build`` (keras 3.15) needs a batch: the
    model, its compiled metrics or its compiled loss are not built yet."""
    unbuilt = [
        not all(layer.built for layer in model._flatten_layers()),
        getattr(model, "_compile_metrics", None) is not None
        and not model._compile_metrics.built,
        getattr(model, "_compile_loss", None) is not None
        and not model._compile_loss.built,
    ]
    return any(unbuilt)


def read_epochs_locally(epoch_iterator, strategy) -> bool:
    """Spares the workers their agreement at every step on whether data
    remains and, with one device per worker, the distributed iterator's
    own cost, for data whose epochs are a known number of steps.

    A finite distributed dataset under ``MultiWorkerMirroredStrategy`` makes
    every step's ``get_next`` an all-reduce of "has data" across workers
    (``input_lib._enable_get_next_as_optional``, tensorflow 2.21), so every
    local step would wait for the slowest worker. A repeated dataset needs
    none. Applies to data that is endless already (``steps_per_epoch``
    given), and to data whose examples fill every batch (arrays whose
    ``has_partial_batch`` is False, or a dataset whose batch dimension is
    static, as with ``drop_remainder=True``) and whose batches fill every
    execution of ``steps_per_execution`` steps (else an epoch's last
    execution would take batches of the next), so that every worker takes
    the same number of steps.

    With one CPU device per worker, each worker reads its own part of the
    data as TensorFlow cuts it (rebatched and auto-sharded:
    ``DistributedDataset._cloned_datasets``, tensorflow 2.21) through a
    plain ``tf.data`` iterator, which ``strategy.run`` passes to the one
    replica as they are: a plain iterator agrees with nobody, and the
    distributed iterator around it costs about as much CPU as the step of a
    1.86 M-parameter MLP (measured: 4 workers, 31 steps, 0.97 s of CPU
    against 0.56 s). Keras makes a new one per epoch
    (``EpochIterator._enumerate_iterator``, keras 3.15), so every epoch reads
    the data exactly as without keras-skip: a resumed job sees the batches
    of an uninterrupted one.

    With several devices per worker, a finite dataset is repeated and one
    distributed iterator serves every epoch, ``steps_per_epoch`` being the
    number of batches: it is never replaced while it prefetches (dropping an
    iterator over an endless dataset can crash TensorFlow, "pure virtual
    method called"). Each epoch is then one pass of the data, but random
    operations in its pipeline go on from one epoch to the next instead of
    starting again (Keras' own shuffle of arrays draws a new order every
    epoch instead of the same one). Returns whether it applied.
    """
    adapter = getattr(epoch_iterator, "data_adapter", None)
    if adapter is None or not hasattr(epoch_iterator, "_get_iterator"):
        return False
    dataset = adapter.get_tf_dataset()
    if not isinstance(dataset, tf.data.Dataset):
        return False  # already distributed by the user
    endless = int(dataset.cardinality()) == int(tf.data.INFINITE_CARDINALITY)
    batches = getattr(epoch_iterator, "_num_batches", None)
    if endless:
        if not epoch_iterator.steps_per_epoch:
            return False
    elif (
        not batches
        or epoch_iterator.steps_per_epoch
        or not _full_batches(adapter, dataset)
        or batches % (epoch_iterator.steps_per_execution or 1)
    ):
        return False
    distributed = strategy.experimental_distribute_dataset(dataset)
    cloned = getattr(distributed, "_cloned_datasets", None)
    devices = strategy.extended.worker_devices if cloned else ()
    if len(devices) == 1 and "CPU" in devices[0].upper():
        # A plain iterator needs no agreement, finite or not: a new one per
        # epoch, as Keras makes them.
        epoch_iterator._get_iterator = lambda: iter(cloned[0])
        _mark_read_locally(epoch_iterator, endless, batches, cloned[0].element_spec)
        return True
    if not endless:
        distributed = strategy.experimental_distribute_dataset(dataset.repeat())
    shared = []

    def get_iterator():
        if not shared:
            shared.append(iter(distributed))
        return shared[0]

    epoch_iterator._get_iterator = get_iterator
    _mark_read_locally(epoch_iterator, endless, batches, dataset.element_spec)
    return True


def _mark_read_locally(epoch_iterator, endless, batches, element_spec) -> None:
    if not endless:
        epoch_iterator.steps_per_epoch = batches
    epoch_iterator._keras_skip_read_locally = True
    # A replica's batch as the model's symbolic build needs it: shapes and
    # dtypes, any batch size.
    epoch_iterator._keras_skip_element_spec = tf.nest.map_structure(
        _any_batch_size, element_spec
    )


def _any_batch_size(spec):
    if isinstance(spec, tf.TensorSpec) and spec.shape.rank:
        return tf.TensorSpec([None, *spec.shape[1:]], spec.dtype)
    return spec


def _full_batches(adapter, dataset) -> bool:
    """Whether every batch of the data holds the full batch size."""
    if adapter.has_partial_batch is not None:
        return adapter.has_partial_batch is False
    shapes = [spec.shape for spec in tf.nest.flatten(dataset.element_spec)]
    return bool(shapes) and all(
        shape.rank and shape[0] is not None and shape[0] == shapes[0][0]
        for shape in shapes
    )


def _get_metrics_result_or_logs(self, logs):
    optimizer = skip_optimizer(getattr(self, "optimizer", None))
    if optimizer is None:
        return type(self)._get_metrics_result_or_logs(self, logs)
    optimizer.average()
    strategy = self.distribute_strategy
    if not is_multi_worker(strategy):
        return type(self)._get_metrics_result_or_logs(self, logs)
    # As Keras does, with the metrics' global values gathered in one
    # all-reduce instead of one per metric variable.
    metric_logs = global_metrics_result(self, strategy)
    if isinstance(logs, dict) and set(logs) == set(metric_logs):
        return metric_logs
    return logs


def _reset_metrics(self):
    reset = type(self).reset_metrics  # the model class's own, or Keras'
    strategy = self.distribute_strategy
    context = tf.distribute.get_replica_context()
    if not is_multi_worker(strategy) or (
        context is not None and context.strategy is strategy
    ):
        return reset(self)
    strategy.run(lambda: reset(self))


def global_metrics_result(model: keras.Model, strategy) -> dict:
    """``model.get_metrics_result()`` over every replica of every worker,
    from one all-reduce of the metric variables' per-worker values.

    Keras reads each metric variable (``synchronization="on_read"``) in
    cross-replica context, one all-reduce per variable. Here each worker
    combines its own replicas' copies as the variable's aggregation says,
    the workers' values travel together, and the results come from
    ``Metric.stateless_result`` (keras 3.15).
    """
    from keras_skip import multi_worker

    metrics = model.metrics
    variables = [v for metric in metrics for v in metric.variables]
    workers = multi_worker.num_workers(strategy)
    first = multi_worker.worker_index(strategy) == 0
    parts, shapes = [], []
    for v in variables:
        copies = [c.numpy() for c in strategy.experimental_local_results(v.value)]
        aggregation = str(v.aggregation).lower()
        if "mean" in aggregation:
            value = np.mean(copies, axis=0) / workers
        elif "first" in aggregation:
            value = copies[0] if first else np.zeros_like(copies[0])
        else:  # sum
            value = np.sum(copies, axis=0)
        shapes.append(np.shape(copies[0]))
        parts.append(np.asarray(value, np.float64).ravel())
    total = multi_worker.sum_over_workers(
        strategy, np.concatenate(parts) if parts else np.zeros(0)
    )
    values, offset = [], 0
    for v, shape in zip(variables, shapes, strict=True):
        size = int(np.prod(shape, dtype=np.int64))
        value = total[offset : offset + size].reshape(shape)
        values.append(tf.constant(value, dtype=v.dtype))
        offset += size
    results, offset = {}, 0
    for metric in metrics:
        count = len(metric.variables)
        result = metric.stateless_result(values[offset : offset + count])
        offset += count
        if isinstance(result, dict):
            results.update(result)
        else:
            results[metric.name] = result
    return results


def is_multi_worker(strategy) -> bool:
    return _trainer_module()._collective_all_reduce_multi_worker(strategy)


def _reduce_per_replica(values, strategy, reduction):
    if reduction not in ("auto", "mean") or not is_multi_worker(strategy):
        return _KERAS["reduce_per_replica"](values, strategy, reduction)
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


def _local_logs(values, strategy):
    """Each log averaged over this worker's replicas only: no collective."""
    from keras.src import tree

    def reduce(value):
        if not isinstance(value, tf.distribute.DistributedValues):
            return value
        copies = strategy.experimental_local_results(value)
        return tf.reduce_mean(tf.stack(copies), axis=0)

    return tree.map_structure(reduce, values)


def _make_function(self, step_function):
    strategy = self.distribute_strategy
    steps_per_execution = self.steps_per_execution
    if strategy.num_replicas_in_sync == 1 or (
        steps_per_execution == 1 and not is_multi_worker(strategy)
    ):
        return _KERAS["_make_function"](self, step_function)
    # A model compiled with SkipCorrectionOptimizer keeps each step's logs on
    # the worker: reducing them across workers would make every local step
    # wait for the slowest worker. The epoch's logs are global (see
    # `global_metrics_result`).
    local = skip_optimizer(getattr(self, "optimizer", None)) is not None
    reduce_logs = (
        _local_logs
        if local
        else lambda values, strategy: _reduce_per_replica(values, strategy, "auto")
    )
    graphs = []

    @tf.autograph.experimental.do_not_convert
    def one_step_on_data(data):
        graphs.append(tf.compat.v1.get_default_graph())
        outputs = strategy.run(step_function, args=(data,))
        return reduce_logs(outputs, strategy)

    if not self.run_eagerly:
        one_step_on_data = tf.function(
            one_step_on_data, reduce_retracing=True, jit_compile=self.jit_compile
        )
    one_step_on_data = self._autoconvert_optionals(one_step_on_data)

    @tf.autograph.experimental.do_not_convert
    def multi_step_on_iterator(iterator):
        graphs.append(tf.compat.v1.get_default_graph())
        if steps_per_execution == 1:
            return tf.experimental.Optional.from_value(
                one_step_on_data(iterator.get_next())
            )
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

    #: The graphs of one step and of one execution, as traced (tests inspect
    #: their collectives).
    function.traced_graphs = graphs
    return function


def calling_callback_list(callback):
    """The ``keras.callbacks.CallbackList`` whose ``on_train_begin`` is
    calling `callback` now, or None.

    Found on the call stack: Keras' ``CallbackList.on_train_begin`` calls each
    of its callbacks from a loop over ``self.callbacks`` (keras 3.15). A
    callback appended to that list then runs after every other one, at every
    later event.
    """
    frame = sys._getframe(1)
    while frame is not None:
        candidate = frame.f_locals.get("self")
        if isinstance(candidate, keras.callbacks.CallbackList) and any(
            c is callback for c in candidate.callbacks
        ):
            return candidate
        frame = frame.f_back
    return None


# ---------------------------------------------------------------------------
# Mixed precision: one verdict on finite gradients for every replica.
# ---------------------------------------------------------------------------


def agree_on_finite_gradients(loss_scale) -> None:
    """Makes a ``LossScaleOptimizer`` around a SkipCorrectionOptimizer skip a
    step on every replica when any replica's gradients overflowed.

    Keras decides from replica 0's gradients alone, "since grads is
    all-reduced" (``LossScaleOptimizer._tf_apply``, keras 3.15). Local steps
    are not all-reduced: a replica with an overflow would apply it, and
    workers could disagree on whether to step, so one would wait in an
    average the others skip. The verdict is all-reduced (one float per
    step). Set on this instance only; idempotent.
    """
    _keep_keras_originals()
    if _STOCK or skip_optimizer(loss_scale) is None:
        return
    object.__setattr__(
        loss_scale, "check_finite", types.MethodType(_check_finite, loss_scale)
    )


def _check_finite(self, grads):
    finite = _KERAS["check_finite"](self, grads)
    context = tf.distribute.get_replica_context()
    if context is None or context.num_replicas_in_sync == 1:
        return finite
    overflowed = context.all_reduce(
        tf.distribute.ReduceOp.SUM, tf.cast(tf.logical_not(finite), tf.float32)
    )
    return tf.equal(overflowed, 0.0)


# ---------------------------------------------------------------------------
# The explicit opt-in for every model.
# ---------------------------------------------------------------------------


def apply_keras_fixes() -> list[str]:
    """Extends the trainer fixes to every model of the process.

    Models compiled with a `SkipCorrectionOptimizer` get the fixes on their
    own (see :func:`prepare_model`); nothing else changes unless this is
    called. Call it to train a plain Keras optimizer under
    ``MultiWorkerMirroredStrategy`` (the synchronous baseline of the
    benchmark), or with ``steps_per_execution > 1`` on several replicas,
    where stock Keras 3.15 fails:

    - ``symbolic_build``: ``fit`` and ``evaluate`` under
      ``MultiWorkerMirroredStrategy`` learn the first batch's shapes from
      the local replica's batch instead of a cross-worker reduction that
      fails.
    - ``scalar_logs``: under ``MultiWorkerMirroredStrategy`` scalar logs
      are reduced without an axis (tensorflow#72388).
    - ``steps_per_execution``: the loop of ``steps_per_execution > 1``
      runs without the redundant ``tf.cond`` that fails on several
      replicas (keras-team/keras#19246).

    Each changes behaviour only where stock Keras raises. Idempotent.
    Returns the names of the fixes in force.
    """
    global _GLOBAL_FIXES
    _keep_keras_originals()
    install_model_hook()
    _trainer_class()._make_function = _make_function
    _GLOBAL_FIXES = True
    return ["symbolic_build", "scalar_logs", "steps_per_execution"]


@contextlib.contextmanager
def keras_fixes_removed():
    """Keras' own trainer for the duration of the block: no keras-skip hook,
    no global fixes, and models and loss-scale optimizers prepared in it get
    no fix (tests pin upstream bugs with it)."""
    global _GLOBAL_FIXES, _STOCK
    _keep_keras_originals()
    cls = _trainer_class()
    saved = (
        cls.__dict__["_maybe_symbolic_build"],
        cls.__dict__["_make_function"],
        _GLOBAL_FIXES,
    )
    cls._maybe_symbolic_build = _KERAS["_maybe_symbolic_build"]
    cls._make_function = _KERAS["_make_function"]
    _GLOBAL_FIXES, _STOCK = False, True
    try:
        yield
    finally:
        cls._maybe_symbolic_build, cls._make_function, _GLOBAL_FIXES = saved
        _STOCK = False


def keras_functions() -> dict[str, object]:
    """Keras' trainer functions as they are now (tests compare them with
    Keras' own)."""
    trainer = _trainer_module()
    return {
        "TensorFlowTrainer._maybe_symbolic_build": trainer.TensorFlowTrainer.__dict__[
            "_maybe_symbolic_build"
        ],
        "TensorFlowTrainer._make_function": trainer.TensorFlowTrainer.__dict__[
            "_make_function"
        ],
        "reduce_per_replica": trainer.reduce_per_replica,
        "LossScaleOptimizer.check_finite": keras.optimizers.LossScaleOptimizer.__dict__[
            "check_finite"
        ],
    }


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
