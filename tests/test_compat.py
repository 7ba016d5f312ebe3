"""Pins the upstream behaviour that keras_skip._compat works around.

If one of the `*_still_*` tests fails after a Keras or TensorFlow upgrade,
the upstream behaviour changed: re-check the workaround it guards and update
keras_skip/_compat.py (and its CHECKED_* versions).
"""

import subprocess
import sys
import textwrap

import keras
import numpy as np
import pytest
import tensorflow as tf
from conftest import mirrored

import keras_skip
from keras_skip import _compat


def test_checked_versions_are_the_installed_ones_or_newer():
    def parse(version):
        return tuple(int(p) for p in version.split(".")[:3] if p.isdigit())

    assert parse(keras.__version__) >= parse(_compat.CHECKED_KERAS)
    assert parse(tf.__version__) >= parse(_compat.CHECKED_TENSORFLOW)


def _stock_model(strategy, steps_per_execution):
    with strategy.scope():
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
        model.compile(
            optimizer=keras.optimizers.SGD(0.1),
            loss="mse",
            steps_per_execution=steps_per_execution,
        )
    return model


def test_stock_keras_still_fails_steps_per_execution_under_mirrored_strategy():
    x = np.random.default_rng(0).random((64, 3)).astype("float32")
    with _compat.keras_fixes_removed():
        model = _stock_model(mirrored(2), steps_per_execution=2)
        with pytest.raises(tf.errors.InvalidArgumentError, match=r"(?i)placeholder"):
            model.fit(x, x.sum(1), batch_size=8, epochs=1, verbose=0)


def test_fixed_keras_runs_steps_per_execution_with_stock_optimizers():
    assert _compat.apply_keras_fixes() == [
        "symbolic_build",
        "scalar_logs",
        "steps_per_execution",
        "loss_scale_agreement",
    ]
    x = np.random.default_rng(0).random((70, 3)).astype("float32")
    model = _stock_model(mirrored(2), steps_per_execution=3)
    history = model.fit(
        x, x.sum(1), batch_size=8, epochs=2, verbose=0, validation_data=(x, x.sum(1))
    )
    assert int(model.optimizer.iterations.numpy()) == 2 * 9  # 70 / 8 -> 9 steps
    assert history.history["loss"][1] < history.history["loss"][0]
    assert np.isfinite(model.evaluate(x, x.sum(1), verbose=0))


def test_fixes_leave_single_replica_training_to_keras():
    from keras.src.backend.tensorflow import trainer

    model = _stock_model(tf.distribute.get_strategy(), steps_per_execution=4)
    x = np.random.default_rng(0).random((64, 3)).astype("float32")
    model.fit(x, x.sum(1), batch_size=8, epochs=1, verbose=0)
    assert trainer.TensorFlowTrainer._make_function is _compat._make_function
    assert not _compat.is_multi_worker(tf.distribute.get_strategy())


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
