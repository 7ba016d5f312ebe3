"""Pins the upstream behaviour that keras_skip._compat works around.

If one of the `*_still_*` tests fails after a Keras or TensorFlow upgrade,
the upstream behaviour changed: re-check the workaround it guards and update
keras_skip/_compat/ (and its CHECKED_* versions in versions.py).
"""

import ast
import pathlib
import subprocess
import sys
import textwrap
import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf
from conftest import keras_fixes_for_every_model, mirrored
from workers.fit_worker import counting_reductions

import keras_skip
from keras_skip import _compat


def test_installed_versions_are_in_the_tested_range():
    def parse(version):
        return tuple(int(p) for p in version.split(".")[:3] if p.isdigit())

    assert parse(keras.__version__) >= parse(_compat.OLDEST_KERAS)
    assert parse(tf.__version__) >= parse(_compat.OLDEST_TENSORFLOW)
    assert _compat.untested_versions() == []


def _stock_model(strategy, steps_per_execution):
    with strategy.scope():
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
        model.compile(
            optimizer=keras.optimizers.SGD(0.1),
            loss="mse",
            steps_per_execution=steps_per_execution,
        )
    return model


def _skip_model(strategy, **compile_options):
    """The model of `_stock_model`, its SGD wrapped at interval 2."""
    with strategy.scope():
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
        model.compile(
            optimizer=keras_skip.SkipCorrectionOptimizer(
                keras.optimizers.SGD(0.1), interval=2
            ),
            loss="mse",
            **compile_options,
        )
    return model


def test_stock_keras_still_fails_steps_per_execution_under_mirrored_strategy():
    x = np.random.default_rng(0).random((64, 3)).astype("float32")
    with _compat.keras_fixes_removed():
        model = _stock_model(mirrored(2), steps_per_execution=2)
        with pytest.raises(tf.errors.InvalidArgumentError, match=r"(?i)placeholder"):
            model.fit(x, x.sum(1), batch_size=8, epochs=1, verbose=0)


@pytest.fixture
def global_fixes():
    with keras_fixes_for_every_model() as names:
        yield names


def test_fixed_keras_runs_steps_per_execution_with_stock_optimizers(global_fixes):
    assert global_fixes == ["symbolic_build", "scalar_logs", "steps_per_execution"]
    x = np.random.default_rng(0).random((70, 3)).astype("float32")
    model = _stock_model(mirrored(2), steps_per_execution=3)
    history = model.fit(
        x, x.sum(1), batch_size=8, epochs=2, verbose=0, validation_data=(x, x.sum(1))
    )
    assert int(model.optimizer.iterations.numpy()) == 2 * 9  # 70 / 8 -> 9 steps
    assert history.history["loss"][1] < history.history["loss"][0]
    assert np.isfinite(model.evaluate(x, x.sum(1), verbose=0))


def test_skip_models_get_the_fixes_on_their_own_instance():
    x = np.random.default_rng(0).random((70, 3)).astype("float32")
    strategy = mirrored(2)
    model = _skip_model(strategy, steps_per_execution=3)
    history = model.fit(
        x,
        x.sum(1),
        batch_size=8,
        epochs=2,
        verbose=0,
        callbacks=[keras_skip.SkipCorrectionCallback()],
    )
    assert history.history["loss"][1] < history.history["loss"][0]
    assert set(_compat.MODEL_FIXES) <= set(vars(model))
    # A stock model trained next in the same process keeps Keras' methods and
    # Keras' failure: the fixes are not global.
    stock = _stock_model(strategy, steps_per_execution=3)
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"(?i)placeholder"):
        stock.fit(x, x.sum(1), batch_size=8, epochs=1, verbose=0)
    assert not set(_compat.MODEL_FIXES) & set(vars(stock))


def test_single_replica_skip_models_train_with_keras_own_functions():
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    model.compile(
        optimizer=keras_skip.SkipCorrectionOptimizer(keras.optimizers.SGD(0.1)),
        loss="mse",
        steps_per_execution=4,
    )
    x = np.random.default_rng(0).random((64, 3)).astype("float32")
    model.fit(x, x.sum(1), batch_size=8, epochs=1, verbose=0)
    assert int(model.optimizer.iterations.numpy()) == 8
    assert not _compat.is_multi_worker(tf.distribute.get_strategy())


_UNCHANGED_SCRIPT = """
import os
os.environ["KERAS_BACKEND"] = "tensorflow"
import keras
import numpy as np
from keras.src.backend.tensorflow import trainer

def functions():
    cls = trainer.TensorFlowTrainer
    optimizer = keras.optimizers.Optimizer
    return {
        "_maybe_symbolic_build": cls.__dict__["_maybe_symbolic_build"],
        "_make_function": cls.__dict__["_make_function"],
        "reduce_per_replica": trainer.reduce_per_replica,
        "check_finite": keras.optimizers.LossScaleOptimizer.__dict__["check_finite"],
        "_get_metrics_result_or_logs": keras.Model._get_metrics_result_or_logs,
        "_backend_update_step": optimizer._backend_update_step,
        "_apply_weight_decay": optimizer._apply_weight_decay,
    }

before = functions()
import keras_skip
import keras_skip.adaptive, keras_skip.callbacks, keras_skip.optimizer
keras_skip.SkipCorrectionCallback, keras_skip.AdaptiveIntervalCallback
assert functions() == before, "changed by import"
keras.mixed_precision.set_global_policy("mixed_float16")
model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
model.compile(optimizer="sgd", loss="mse", steps_per_execution=2)
x = np.random.default_rng(0).random((32, 3)).astype("float32")
model.fit(x, x.sum(1), epochs=1, verbose=0)
model.evaluate(x, x.sum(1), verbose=0)
assert functions() == before, "changed by stock training"
assert "check_finite" not in vars(model.optimizer)
print("unchanged")
"""


def test_import_and_stock_training_leave_keras_unchanged():
    """`import keras_skip` (and loading all its classes) changes no Keras
    function, nor does training a stock model afterwards."""
    result = subprocess.run(
        [sys.executable, "-c", _UNCHANGED_SCRIPT],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split()[-1] == "unchanged"


def test_untested_versions_are_named():
    checked = (_compat.CHECKED_KERAS, _compat.CHECKED_TENSORFLOW)
    assert _compat.untested_versions(*checked) == []
    oldest = (_compat.OLDEST_KERAS, _compat.OLDEST_TENSORFLOW)
    assert _compat.untested_versions(*oldest) == []
    major, minor = _compat.versions._minor(_compat.CHECKED_KERAS)
    # A patch release of a tested minor release is in the range.
    patch = f"{major}.{minor}.99"
    assert _compat.untested_versions(patch, _compat.CHECKED_TENSORFLOW) == []
    newer = f"{major}.{minor + 1}.0"
    [message] = _compat.untested_versions(newer, _compat.CHECKED_TENSORFLOW)
    assert message.startswith(f"Keras {newer} (tested: ")
    major, minor = _compat.versions._minor(_compat.OLDEST_TENSORFLOW)
    older = f"{major}.{minor - 1}.0"
    [message] = _compat.untested_versions(_compat.CHECKED_KERAS, older)
    assert message.startswith(f"TensorFlow {older} (tested: ")


def test_an_untested_version_warns_at_the_caller(monkeypatch):
    monkeypatch.setattr(keras, "__version__", "3.99.0")
    with pytest.warns(RuntimeWarning, match=r"Keras 3\.99\.0 \(tested: ") as caught:
        _compat.check_versions()
    assert caught[0].filename == __file__
    monkeypatch.setattr(keras, "__version__", _compat.CHECKED_KERAS)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _compat.check_versions()


def test_separate_strategies_still_collide_without_isolated_keys():
    script = textwrap.dedent(
        """
        import tensorflow as tf
        from keras_skip import _compat
        cpu = tf.config.list_physical_devices("CPU")[0]
        devices = [tf.config.LogicalDeviceConfiguration()] * 2
        tf.config.set_logical_device_configuration(cpu, devices)
        def reduce_in_new_strategy(size, isolate):
            s = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
            if isolate:
                _compat.isolate_collective_keys(s)
            @tf.function
            def reduce():
                value = s.run(lambda: tf.distribute.get_replica_context().all_reduce(
                    "SUM", tf.ones([size])))
                return s.experimental_local_results(value)[0]
            return float(tf.reduce_sum(reduce()))
        import sys
        isolate = sys.argv[1] == "isolate"
        print(reduce_in_new_strategy(3, isolate), reduce_in_new_strategy(5, isolate))
        """
    )
    isolated = subprocess.run(
        [sys.executable, "-c", script, "isolate"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert isolated.returncode == 0, isolated.stderr[-2000:]
    assert isolated.stdout.split() == ["6.0", "10.0"]
    stock = subprocess.run(
        [sys.executable, "-c", script, "stock"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert stock.returncode != 0
    assert "Shape mismatch in the collective instance" in stock.stderr


def test_isolation_is_idempotent_and_ignores_other_strategies():
    strategy = mirrored(2)
    keys = strategy.extended._collective_ops._collective_keys
    before = dict(keys._known_groups)
    _compat.isolate_collective_keys(strategy)
    assert keys._known_groups == before
    _compat.isolate_collective_keys(tf.distribute.get_strategy())


def test_averaged_model_state_uses_layer_internals_that_still_exist():
    layer = keras.layers.BatchNormalization()
    layer.build((None, 3))
    assert {v.name for v in layer._non_trainable_variables} == {
        "moving_mean",
        "moving_variance",
    }
    model = keras.Sequential(
        [keras.Input((3,)), layer, keras.layers.Dropout(0.5, seed=1)]
    )
    state = _compat.averaged_model_state(model)
    assert [v.name for v in state] == ["moving_mean", "moving_variance"]
    assert keras_skip.SkipCorrectionOptimizer  # the public class imports the module


def _epochs_of_batches(epoch_iterator, epochs):
    seen = []
    for _ in range(epochs):
        batches = []
        for begin, end, iterator in epoch_iterator.enumerate_epoch():
            # As the train function does: one batch per step of the execution.
            for _ in range(end - begin + 1):
                x, _ = next(iterator)
                batches.append(x.numpy()[:, 0].tolist())
        seen.append(batches)
        epoch_iterator.reset()
    return seen


def _epoch_iterator(data, steps_per_execution=1, steps_per_epoch=None, **kwargs):
    from keras.src.backend.tensorflow.trainer import TFEpochIterator

    return TFEpochIterator(
        steps_per_execution=steps_per_execution,
        steps_per_epoch=steps_per_epoch,
        distribute_strategy=tf.distribute.get_strategy(),
        **data,
        **kwargs,
    )


def _rows(n):
    return np.arange(2 * n, dtype="float32").reshape(n, 2), np.zeros((n, 1), "float32")


def _arrays(n=24):
    x, y = _rows(n)
    return dict(x=x, y=y, batch_size=4, shuffle=False)


def _shuffled_arrays():
    keras.utils.set_random_seed(0)  # the same shuffle ops for both iterators
    return {**_arrays(), "shuffle": True}


def _full_dataset(n=24):
    return dict(x=tf.data.Dataset.from_tensor_slices(_rows(n)).batch(4, True))


KNOWN_EPOCHS = {
    "arrays": (_arrays, {}),
    # Keras draws the same order in every epoch (a new iterator restarts its
    # shuffle op); a resumed job must see it too.
    "shuffled-arrays": (_shuffled_arrays, {}),
    "dataset-drop-remainder": (_full_dataset, {}),
    "endless-dataset": (
        lambda: dict(x=_full_dataset()["x"].repeat()),
        {"steps_per_epoch": 6},
    ),
}


@pytest.mark.parametrize("steps_per_execution", [1, 2])
@pytest.mark.parametrize("data", list(KNOWN_EPOCHS))
@pytest.mark.parametrize("devices", [1, 0])
def test_known_epochs_read_locally_give_keras_batches(
    data, steps_per_execution, devices
):
    """`read_epochs_locally` relies on Keras' TF epoch iterator (its data
    adapter, `_num_batches`, `steps_per_epoch` and `_get_iterator`): epochs
    read through plain iterators over the worker's own dataset (one device)
    are Keras' own, shuffled or not; through one iterator over the repeated
    dataset (``devices=0``: no per-device datasets, as with several
    devices), each epoch is one pass of the data."""
    strategy = mirrored(1) if devices else tf.distribute.get_strategy()
    make, options = KNOWN_EPOCHS[data]

    def epoch_iterator():
        return _epoch_iterator(make(), steps_per_execution, **options)

    stock = _epochs_of_batches(epoch_iterator(), 3)
    local = epoch_iterator()
    assert _compat.read_epochs_locally(local, strategy)
    assert local.steps_per_epoch == 6
    seen = _epochs_of_batches(local, 3)
    if devices or data != "shuffled-arrays":
        assert seen == stock
    else:  # the shuffle goes on from one epoch to the next

        def examples(epoch):
            return sorted(x for batch in epoch for x in batch)

        assert [examples(e) for e in seen] == [examples(e) for e in stock]
        assert seen[0] == stock[0] and seen[1] != stock[1]
    assert len(stock[0]) == 6


LEFT_TO_KERAS = {
    "partial-batch": (lambda: _arrays(25), 1),
    "partial-execution": (_arrays, 4),
    "dataset-partial-batch": (
        lambda: dict(x=tf.data.Dataset.from_tensor_slices(_rows(24)).batch(5)),
        1,
    ),
    "dataset-unknown-length": (
        lambda: dict(x=_full_dataset()["x"].filter(lambda x, y: True)),
        1,
    ),
}


@pytest.mark.parametrize("data", list(LEFT_TO_KERAS))
def test_epochs_with_partial_batches_or_executions_are_left_to_keras(data):
    make, steps_per_execution = LEFT_TO_KERAS[data]
    epoch_iterator = _epoch_iterator(make(), steps_per_execution)
    strategy = tf.distribute.get_strategy()
    assert not _compat.read_epochs_locally(epoch_iterator, strategy)
    assert epoch_iterator.steps_per_epoch is None


def test_a_distributed_dataset_holds_each_input_workers_own_dataset():
    """What `read_epochs_locally` reads with one device per worker: the
    distributed dataset's `_cloned_datasets`, one tf.data dataset per input
    worker, whose elements are the replica's batches."""
    strategy = mirrored(1)
    dataset = tf.data.Dataset.from_tensor_slices(_rows(8)).batch(4, True)
    distributed = strategy.experimental_distribute_dataset(dataset)
    (own,) = distributed._cloned_datasets
    assert isinstance(own, tf.data.Dataset)
    batches = [x.numpy().tolist() for x, _ in own]
    assert batches == [x.numpy().tolist() for x, _ in dataset]


def test_finite_distributed_datasets_still_agree_on_data_at_every_step():
    """The per-step collective `read_epochs_locally` avoids: multi-worker
    iterators over finite datasets ask every worker whether data remains."""
    from tensorflow.python.distribute import input_lib

    assert callable(input_lib._enable_get_next_as_optional)


def test_a_built_model_builds_symbolically_without_a_batch():
    """Under several workers keras-skip's `_maybe_symbolic_build` takes no
    batch from a shared repeated iterator once the model is built (the batch
    would be missing from the epoch): `_needs_data` must follow Keras'
    `_symbolic_build`, which then needs none."""
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse", metrics=["mae"])
    assert _compat.fixes._needs_data(model)
    x, y = np.ones((4, 2), "float32"), np.ones((4, 1), "float32")
    model.fit(x, y, epochs=1, verbose=0)
    assert not _compat.fixes._needs_data(model)
    model._symbolic_build(data_batch=None)  # no batch: nothing left to build


def test_a_built_skip_model_evaluates_without_an_iterator_for_the_build(
    monkeypatch,
):
    """Keras takes a batch for the symbolic build of every fit and evaluate
    (validation included) from a new distributed iterator, which it drops;
    one replica set of a skip model, once built, makes none for it."""
    from tensorflow.python.distribute import input_lib

    made = []
    original = input_lib.DistributedDataset.__iter__

    def counted(self):
        made.append(self)
        return original(self)

    monkeypatch.setattr(input_lib.DistributedDataset, "__iter__", counted)
    x = np.random.default_rng(0).random((32, 3)).astype("float32")
    strategy = mirrored(2)
    skip = _skip_model(strategy, metrics=["mae"])
    stock = _stock_model(strategy, steps_per_execution=1)
    callbacks = [keras_skip.SkipCorrectionCallback()]
    skip.fit(x, x.sum(1), batch_size=8, verbose=0, callbacks=callbacks)
    stock.fit(x, x.sum(1), batch_size=8, verbose=0)
    counts = []
    for model in (skip, stock):
        made.clear()
        loss = model.evaluate(x, x.sum(1), batch_size=8, verbose=0)
        assert np.all(np.isfinite(loss))
        counts.append(len(made))
    assert counts[0] == counts[1] - 1


def test_assigning_an_on_read_variable_across_replicas_still_reads_it_back():
    """Why keras-skip resets the metrics in replica context under several
    workers: Keras' reset assigns every metric variable in cross-replica
    context, and TensorFlow reduces the variable across all replicas to read
    it back (`SyncOnReadVariable.assign`, tensorflow 2.21); under
    MultiWorkerMirroredStrategy each is an all-reduce across workers."""
    strategy = mirrored(2)
    with strategy.scope():
        metric = keras.metrics.Mean()
        metric.update_state(3.0)
    with counting_reductions(strategy) as reductions:
        with strategy.scope():
            metric.reset_state()
        assert len(reductions) == len(metric.variables) == 2
        reductions.clear()
        strategy.run(metric.reset_state)  # what keras-skip does
        assert reductions == []
    assert float(metric.result()) == 0.0


# ---------------------------------------------------------------------------
# Private Keras and TensorFlow APIs live in _compat only.
# ---------------------------------------------------------------------------

PACKAGE = pathlib.Path(keras_skip.__file__).parent
#: Names under which package modules refer to keras-skip's own modules.
OWN_MODULES = {
    "_checks",
    "_compat",
    "_environment",
    "_replica_state",
    "_version",
    "adaptive",
    "callbacks",
    "maths",
    "multi_worker",
    "optimizer",
    "steering",
}


def _private_uses(path: pathlib.Path) -> list[str]:
    """Private modules imported, and private members of objects other than
    the class's own instance (or keras-skip's own modules) used, in `path`."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom | ast.Import):
            names = [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            names += [alias.name for alias in node.names]
            if any(n.startswith(("keras.src", "tensorflow.python")) for n in names):
                found.append(f"{path.name}:{node.lineno}: import {names[0]}")
        elif isinstance(node, ast.Attribute) and node.attr.startswith("_"):
            value = node.value
            if node.attr == "__internal__" or (
                not node.attr.startswith("__")
                and not node.attr.startswith("_keras_skip_")  # own, on a strategy
                and not (isinstance(value, ast.Name) and value.id in {"self", "cls"})
                and not (isinstance(value, ast.Name) and value.id in OWN_MODULES)
                and not (
                    isinstance(value, ast.Call)
                    and getattr(value.func, "id", None) == "super"
                )
                and ast.unparse(node) != "sys._getframe"
            ):
                found.append(f"{path.name}:{node.lineno}: {ast.unparse(node)}")
    return found


SECOND_MOMENTS = {  # optimizer: the names of its second-moment slots
    keras.optimizers.Adam: ["velocity"],
    lambda: keras.optimizers.Adam(amsgrad=True): ["velocity", "velocity_hat"],
    keras.optimizers.AdamW: ["velocity"],
    keras.optimizers.Nadam: ["velocity"],
    keras.optimizers.Lamb: ["velocity"],
    lambda: keras.optimizers.RMSprop(momentum=0.5, centered=True): ["velocity"],
    keras.optimizers.Adagrad: ["accumulator"],
    keras.optimizers.Ftrl: ["accumulator"],
    keras.optimizers.Adamax: ["norm"],
    keras.optimizers.Adadelta: ["accumulated_grad", "accumulated_delta_var"],
    keras.optimizers.SGD: [],
    lambda: keras.optimizers.SGD(momentum=0.9): [],
    keras.optimizers.Lion: [],
}


@pytest.mark.parametrize(
    "make", SECOND_MOMENTS, ids=lambda m: getattr(m, "__name__", "-")
)
def test_second_moments_are_found_by_their_attributes(make):
    """`_compat.second_moments` reads the slot lists Keras' optimizers keep
    (`SECOND_MOMENT_ATTRIBUTES`); each kind of slot is named after what it
    holds, which is checked here against the names Keras gives them."""
    optimizer = make()
    kernel = keras.Variable(np.ones((3, 2)), name="kernel")
    bias = keras.Variable(np.zeros(2), name="bias")
    optimizer.build([kernel, bias])
    found = _compat.second_moments(optimizer)
    assert all(any(v is w for w in optimizer.variables) for v in found)
    names = [v.name for v in found]
    expected = SECOND_MOMENTS[make]
    assert len(found) == 2 * len(expected), names
    for kind in expected:
        assert sum(name.endswith("_" + kind) for name in names) == 2, (kind, names)


def test_muons_second_moments_are_those_of_the_variables_it_steps_with_adam():
    """Muon steps a matrix with its own rule and a vector with Adam: only the
    vector has a velocity (kept in a list by keras 3.15, in a dict by
    variable path by keras 3.12; both are read)."""
    optimizer = keras.optimizers.Muon()
    kernel = keras.Variable(np.ones((3, 2)), name="kernel")
    bias = keras.Variable(np.zeros(2), name="bias")
    optimizer.build([kernel, bias])
    found = _compat.second_moments(optimizer)
    assert [v.name for v in found] == [
        v.name for v in optimizer.variables if v.name.endswith("bias_velocity")
    ]
    assert len(found) == 1 and any(found[0] is w for w in optimizer.variables)


def test_an_optimizer_of_another_class_has_no_second_moments():
    """Attribute names alone decide nothing: a custom optimizer whose `_v`
    holds something else is not read."""

    class Custom(keras.optimizers.SGD):
        def build(self, variables):
            super().build(variables)
            self._v = self.add_optimizer_variables(variables, "v")

    optimizer = Custom(0.1)
    optimizer.build([keras.Variable(np.ones(2))])
    assert optimizer._v and _compat.second_moments(optimizer) == []


def test_adafactor_second_moments_are_its_factored_estimates():
    optimizer = keras.optimizers.Adafactor()
    optimizer.build([keras.Variable(np.ones((3, 2))), keras.Variable(np.zeros(2))])
    found = _compat.second_moments(optimizer)
    assert found and all(any(v is w for w in optimizer.variables) for v in found)


def test_private_apis_of_keras_and_tensorflow_are_used_in_compat_only():
    sources = [p for p in PACKAGE.rglob("*.py") if "_compat" not in p.parts]
    assert len(sources) > 20
    found = [use for path in sources for use in _private_uses(path)]
    assert found == [], "\n".join(found)


def test_the_optimizer_uses_only_the_declared_protected_members_of_keras():
    """`self._x` in SkipCorrectionOptimizer, where Keras' optimizer base class
    has `_x`, must be one of the declared subclass protocol; and the base
    class still has each of those."""
    base = keras.optimizers.SGD(0.1)
    base.build([keras.Variable([1.0])])
    inherited = {name for name in dir(base) if name.startswith("_")}
    for name in _compat.OPTIMIZER_SUBCLASS_PROTOCOL:
        assert name in inherited, f"Keras' optimizer no longer has {name}"
    tree = ast.parse((PACKAGE / "optimizer.py").read_text())
    used = {
        node.attr
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute)
        and isinstance(node.value, ast.Name)
        and node.value.id == "self"
        and node.attr in inherited
        and not node.attr.startswith("__")
    }
    overridden = {
        node.name
        for node in ast.walk(tree)
        if isinstance(node, ast.FunctionDef)
        and node.name in inherited
        and node.name.startswith("_")
        and not node.name.startswith("__")
    }
    assert used | overridden == set(_compat.OPTIMIZER_SUBCLASS_PROTOCOL)


def test_the_private_state_helpers_still_reach_keras_and_tensorflow_state():
    strategy = mirrored(2)
    with strategy.scope():
        sgd = keras.optimizers.SGD(0.25)
        variable = tf.Variable([1.0, 2.0])
    sgd.build([keras.Variable([1.0])])
    assert _compat.creation_strategy(sgd) is strategy
    assert _compat.iterations_variable(sgd) is sgd.iterations
    rate = _compat.learning_rate_variable(sgd)
    assert any(rate is v for v in sgd.variables)
    assert float(rate.numpy()) == 0.25
    schedule = keras.optimizers.schedules.ExponentialDecay(0.1, 10, 0.5)
    assert _compat.learning_rate_variable(keras.optimizers.SGD(schedule)) is schedule

    copies = _compat.local_copies(variable)
    assert len(copies) == 2 and all(c.shape == (2,) for c in copies)
    plain = tf.Variable(1.0)
    assert _compat.local_copies(plain) == [plain]

    parts = [tf.constant(1.0), tf.constant(2.0)]
    values = _compat.per_replica(parts)
    assert isinstance(values, tf.distribute.DistributedValues)
    assert [float(v) for v in strategy.experimental_local_results(values)] == [
        1.0,
        2.0,
    ]


def test_untracked_assignments_stay_out_of_a_keras_objects_variables():
    shared = keras.Variable(1.0)

    class Holder(keras.layers.Layer):
        @_compat.untracked_method
        def hold(self, value):
            self.held_in_method = value

    layer = Holder()
    with _compat.untracked():
        layer.held = shared
    layer.hold(shared)
    assert not any(v is shared for v in layer.weights)
    layer.tracked = keras.Variable(2.0)  # the control: tracking is on here
    assert any(v is layer.tracked for v in layer.weights)


def test_a_checkpoint_dependency_is_restored_after_its_parent(tmp_path):
    restored = []

    class Child(_compat.Trackable):
        def _serialize_to_tensors(self):
            return {"values": tf.constant([3.0, 4.0])}

        def _restore_from_tensors(self, restored_tensors):
            restored.append((float(parent.numpy()), restored_tensors["values"]))
            return tf.no_op()

    parent = tf.Variable(1.0)
    _compat.add_checkpoint_dependency(parent, Child(), "child")
    path = tf.train.Checkpoint(v=parent).write(str(tmp_path / "ckpt"))
    parent.assign(0.0)
    tf.train.Checkpoint(v=parent).read(path).assert_consumed()
    [(parent_value, values)] = restored
    assert parent_value == 1.0  # the parent was restored first
    assert values.numpy().tolist() == [3.0, 4.0]


def test_set_initial_epoch_makes_fit_start_there():
    class StartAtTwo(keras.callbacks.Callback):
        def on_train_begin(self, logs=None):
            _compat.set_initial_epoch(self.model, 2)

    class Epochs(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.seen = []

        def on_epoch_begin(self, epoch, logs=None):
            self.seen.append(epoch)

    model = keras.Sequential([keras.Input((1,)), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
    epochs = Epochs()
    model.fit(
        np.ones((4, 1)),
        np.ones(4),
        epochs=4,
        verbose=0,
        callbacks=[StartAtTwo(), epochs],
    )
    assert epochs.seen == [2, 3]


def test_slots_by_variable_gives_every_builtin_optimizer_slot_to_its_variable():
    """Streaming averages send (or reset) a fragment's slots only: each slot
    of every optimizer the package wraps must go to the variable it was made
    for (Keras names it after that variable), and only scalar state that
    belongs to no variable (Nadam's momentum schedule, a user optimizer's
    global accumulator) may be left to travel with the last fragment."""
    from test_optimizers_exact import CASES

    from keras_skip import _slots

    builtins = {
        name: getattr(keras.optimizers, name)
        for name in dir(keras.optimizers)
        if isinstance(getattr(keras.optimizers, name), type)
        and issubclass(getattr(keras.optimizers, name), keras.optimizers.Optimizer)
        and getattr(keras.optimizers, name).update_step
        is not keras.optimizers.Optimizer.update_step
    }
    # Built-in optimizers with their defaults (which every Keras release the
    # package supports takes), and the user-written ones.
    users = {case: make for case, make in CASES.items() if case.startswith("user")}
    names = ("kernel", "bias", "square")
    shapes = ((3, 2), (2,), (4, 4))
    for case, make in {**builtins, **users}.items():
        variables = [
            keras.Variable(np.zeros(shape, "float32"), name=name)
            for name, shape in zip(names, shapes, strict=True)
        ]
        optimizer = make()
        optimizer.build(variables)
        slots = _slots.slot_variables(optimizer)
        per_variable = _compat.slots_by_variable(optimizer, variables, slots)
        given = [id(s) for owned in per_variable for s in owned]
        assert len(given) == len(set(given)), case
        for name, owned in zip(names, per_variable, strict=True):
            for slot in owned:
                assert f"/{name}" in slot.name, (case, name, slot.name)
        left = [s for s in slots if id(s) not in given]
        assert all(tuple(s.shape) == () for s in left), (case, left)
        if type(optimizer).__name__ != "SGD" or optimizer.momentum:
            assert given, case
