"""The fixes set on the models compiled with a SkipCorrectionOptimizer, the
hook that sets them, the mixed-precision fix, and the explicit opt-in for
every model."""

from __future__ import annotations

import contextlib
import sys
import types

import keras
import tensorflow as tf

from keras_skip._compat import originals
from keras_skip._compat.epochs import read_epochs_locally
from keras_skip._compat.logs import (
    _get_metrics_result_or_logs,
    _make_function,
    _reset_metrics,
)
from keras_skip._compat.originals import (
    _KERAS,
    _keep_keras_originals,
    _trainer_class,
    _trainer_module,
    is_multi_worker,
    skip_optimizer,
)


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
        if originals._GLOBAL_FIXES:
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
    if originals._STOCK or getattr(model, "_keras_skip_prepared", False):
        return
    # Plain attributes: Keras' and TensorFlow's tracking is not for methods.
    for name, value in _model_fixes(model).items():
        object.__setattr__(model, name, value)
    if isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer):
        agree_on_finite_gradients(model.optimizer)
    _remake_functions(model)


def _model_fixes(model: keras.Model) -> dict[str, object]:
    """The attributes :func:`prepare_model` sets on `model`: the fixes of
    `MODEL_FIXES` bound to it, in that order, then the mark that it is
    prepared."""
    return {
        "_maybe_symbolic_build": types.MethodType(_maybe_symbolic_build, model),
        "_make_function": types.MethodType(_make_function, model),
        "_get_metrics_result_or_logs": types.MethodType(
            _get_metrics_result_or_logs, model
        ),
        "reset_metrics": types.MethodType(_reset_metrics, model),
        "_keras_skip_prepared": True,
    }


def _remake_functions(model: keras.Model) -> None:
    """Makes again the train and test functions that Keras' own
    ``_make_function`` made, so that they are the fixed ones."""
    if getattr(model, "train_function", None) is not None:
        model.make_train_function(force=True)
    if getattr(model, "test_function", None) is not None:
        model.make_test_function(force=True)


def _maybe_symbolic_build(self, iterator=None, data_batch=None):
    if (
        iterator is not None
        and self._distribute_strategy is not None
        and not is_multi_worker(self.distribute_strategy)
        and not _needs_data(self)
    ):
        # Keras (3.15) takes a batch for the build at every fit and every
        # evaluate, validation included, from a new distributed iterator
        # that it then drops: about 0.1 s of CPU on 4 devices, for nothing
        # once the model, metrics and loss are built.
        with self.distribute_strategy.scope():
            self._symbolic_build(data_batch=None)
        return None
    if iterator is None or not is_multi_worker(self.distribute_strategy):
        return _KERAS["_maybe_symbolic_build"](self, iterator, data_batch)
    from keras.src import tree

    strategy = self.distribute_strategy
    optimizer = skip_optimizer(getattr(self, "optimizer", None))
    read_locally = optimizer is not None and (
        getattr(iterator, "_keras_skip_read_locally", False)
        or read_epochs_locally(iterator, strategy)
    )
    if read_locally:
        # The shapes come from the data's element spec: a batch taken from
        # the iterator several devices share would be missing from the
        # epoch, and one taken from a distributed iterator would leave that
        # iterator alive, which slows every later step (measured: 4 workers,
        # the benchmark MLP, about 13 ms of CPU per step).
        spec = iterator._keras_skip_element_spec if _needs_data(self) else None
        with strategy.scope():
            self._symbolic_build(data_batch=spec)
        _note_reading(self, steps_exchange_nothing=True)
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
    _note_reading(self, steps_exchange_nothing=False)


def _note_reading(model, steps_exchange_nothing: bool) -> None:
    """Tells a delayed-average flight whether this `fit`'s steps exchange
    nothing (no per-step agreement on whether data remains)."""
    flight = getattr(skip_optimizer(getattr(model, "optimizer", None)), "_flight", None)
    if flight is not None:
        flight.steps_exchange_nothing = steps_exchange_nothing


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
    if originals._STOCK or skip_optimizer(loss_scale) is None:
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
    _keep_keras_originals()
    install_model_hook()
    _trainer_class()._make_function = _make_function
    originals._GLOBAL_FIXES = True
    return ["symbolic_build", "scalar_logs", "steps_per_execution"]


@contextlib.contextmanager
def keras_fixes_removed():
    """Keras' own trainer for the duration of the block: no keras-skip hook,
    no global fixes, and models and loss-scale optimizers prepared in it get
    no fix (tests pin upstream bugs with it)."""
    _keep_keras_originals()
    cls = _trainer_class()
    saved = (
        cls.__dict__["_maybe_symbolic_build"],
        cls.__dict__["_make_function"],
        originals._GLOBAL_FIXES,
    )
    cls._maybe_symbolic_build = _KERAS["_maybe_symbolic_build"]
    cls._make_function = _KERAS["_make_function"]
    originals._GLOBAL_FIXES, originals._STOCK = False, True
    try:
        yield
    finally:
        cls._maybe_symbolic_build, cls._make_function, originals._GLOBAL_FIXES = saved
        originals._STOCK = False


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
