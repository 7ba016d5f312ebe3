"""Workarounds for Keras and TensorFlow behaviour that keras-skip depends on.

Every use of a private Keras or TensorFlow API lives in this package (the
one exception: the protected members of Keras' optimizer base class that
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

Its modules: `versions` (the range checked, and the warning outside it),
`state` (private state of optimizers, variables and strategies, and a
wrapped optimizer's own hooks), `originals` (Keras' functions before any
patch), `epochs` (reading epochs without per-step agreement), `logs` (the
train function and its logs), `fixes` (what is set on a model, and the
explicit opt-in), `collectives` (keys, variables created without a
broadcast, and failure detection).
"""

from keras_skip._compat.collectives import (
    configure_peer_timeout,
    created_alike,
    isolate_collective_keys,
)
from keras_skip._compat.epochs import (
    read_epochs_locally,
)
from keras_skip._compat.fixes import (
    MODEL_FIXES,
    agree_on_finite_gradients,
    apply_keras_fixes,
    calling_callback_list,
    install_model_hook,
    keras_fixes_removed,
    keras_functions,
    prepare_model,
)
from keras_skip._compat.logs import (
    global_metrics_result,
)
from keras_skip._compat.originals import (
    is_multi_worker,
    skip_optimizer,
)
from keras_skip._compat.state import (
    OPTIMIZER_SUBCLASS_PROTOCOL,
    REPLACED_METHODS,
    Trackable,
    add_checkpoint_dependency,
    apply_weight_decay,
    averaged_model_state,
    build_tracked,
    clip_gradients,
    creation_strategy,
    is_float,
    iterations_variable,
    learning_rate_variable,
    local_copies,
    optimizer_step,
    per_replica,
    replaced_overrides,
    second_moments,
    set_initial_epoch,
    slots_by_variable,
    untracked,
    untracked_method,
)
from keras_skip._compat.versions import (
    CHECKED_KERAS,
    CHECKED_TENSORFLOW,
    OLDEST_KERAS,
    OLDEST_TENSORFLOW,
    check_versions,
    untested_versions,
)

__all__ = [
    "CHECKED_KERAS",
    "CHECKED_TENSORFLOW",
    "MODEL_FIXES",
    "OLDEST_KERAS",
    "OLDEST_TENSORFLOW",
    "OPTIMIZER_SUBCLASS_PROTOCOL",
    "REPLACED_METHODS",
    "Trackable",
    "add_checkpoint_dependency",
    "agree_on_finite_gradients",
    "apply_keras_fixes",
    "apply_weight_decay",
    "averaged_model_state",
    "build_tracked",
    "calling_callback_list",
    "check_versions",
    "clip_gradients",
    "configure_peer_timeout",
    "created_alike",
    "creation_strategy",
    "global_metrics_result",
    "install_model_hook",
    "is_float",
    "is_multi_worker",
    "isolate_collective_keys",
    "iterations_variable",
    "keras_fixes_removed",
    "keras_functions",
    "learning_rate_variable",
    "local_copies",
    "optimizer_step",
    "per_replica",
    "prepare_model",
    "read_epochs_locally",
    "replaced_overrides",
    "second_moments",
    "set_initial_epoch",
    "skip_optimizer",
    "slots_by_variable",
    "untested_versions",
    "untracked",
    "untracked_method",
]
