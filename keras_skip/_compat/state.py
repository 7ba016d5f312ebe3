"""Private state of Keras and TensorFlow objects, reached by name: the
model state averages include, optimizers' and strategies' private
attributes, and a wrapped optimizer's own hooks run from cross-replica
context."""

from __future__ import annotations

import contextlib

import keras
import tensorflow as tf

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
            if id(variable) in seen or not is_float(variable):
                continue
            seen.add(id(variable))
            state.append(variable)
    return state


def is_float(variable) -> bool:
    """Whether the variable holds floating-point values."""
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
    # TensorFlow's `Trackable`, below Keras' optimizer: overridden to land a
    # delayed average before `tf.train.Checkpoint` reads the state.
    "_trackable_children",
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


#: Where Keras' optimizers (3.15) keep the slots that estimate the squared
#: gradient and scale each step (the preconditioner), by class name (a class
#: missing from an older Keras is skipped); a subclass keeps its base's.
SECOND_MOMENT_ATTRIBUTES = {
    "Adam": ("_velocities", "_velocity_hats"),  # also AdamW; AMSGrad's hats
    "Nadam": ("_velocities",),
    "Lamb": ("_velocities",),
    "RMSprop": ("_velocities",),
    "Adagrad": ("_accumulators",),
    "Ftrl": ("_accumulators",),
    "Adamax": ("_u",),
    "Adadelta": ("_accumulated_grads", "_accumulated_delta_vars"),
    "Adafactor": ("_r", "_c", "_v"),
    "Muon": ("adam_velocities",),  # of the variables it steps with Adam
}


def second_moments(optimizer) -> list:
    """The built `optimizer`'s variables that estimate the squared gradient
    (`SECOND_MOMENT_ATTRIBUTES`); empty for SGD, Lion and optimizers of
    other classes."""
    found = []
    for name, attributes in SECOND_MOMENT_ATTRIBUTES.items():
        cls = getattr(keras.optimizers, name, None)
        if cls is None or not isinstance(optimizer, cls):
            continue
        for attribute in attributes:
            slots = getattr(optimizer, attribute, None) or ()
            if isinstance(slots, dict):  # by variable path (Muon, keras 3.12)
                slots = slots.values()
            found.extend(v for v in slots if v is not None)
    return found


def slots_by_variable(optimizer, var_list, slots) -> list[list]:
    """Per variable of `var_list` (the built `optimizer`'s trainable
    variables, in its order): those of `slots` (its slot variables) that
    belong to it. Keras' optimizers (3.15) keep each kind of slot in a list
    attribute in the variables' order (Adam's ``_momentums``, Muon's
    ``momentums``, None or a placeholder where a variable has none), or
    (Muon in keras 3.12) in a dict by variable path; a slot in neither
    (Nadam's ``_u_product``) belongs to no variable."""
    known = {id(s) for s in slots}
    per_variable: list[list] = [[] for _ in var_list]
    index_of_path = {getattr(v, "path", None): k for k, v in enumerate(var_list)}
    for value in vars(optimizer).values():
        if isinstance(value, dict):  # by variable path (Muon, keras 3.12)
            pairs = [(index_of_path.get(key), s) for key, s in value.items()]
        elif isinstance(value, list | tuple) and len(value) == len(var_list):
            pairs = list(enumerate(value))
        else:
            continue
        for k, s in pairs:
            s = _tf_variable(s)
            if k is not None and id(s) in known:
                per_variable[k].append(s)
    return per_variable


def _tf_variable(v):
    return v.value if isinstance(v, keras.Variable) else v


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
