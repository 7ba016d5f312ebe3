"""The package: light import, clear errors, version, command line."""

import json
import os
import subprocess
import sys
from importlib import metadata

import pytest

import keras_skip


def run_python(code, env=None, timeout=120):
    full_env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3", **(env or {})}
    return subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env=full_env,
        timeout=timeout,
    )


def test_import_does_not_load_tensorflow_or_keras():
    result = run_python(
        "import sys, keras_skip; "
        "print(sorted(m for m in ('tensorflow', 'keras', 'matplotlib', 'mlxtend') "
        "if m in sys.modules)); print(keras_skip.__version__)"
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == ["[]", keras_skip.__version__]


def test_classes_load_on_first_use():
    result = run_python(
        "import keras_skip, sys; cls = keras_skip.SkipCorrectionOptimizer; "
        "print(cls.__module__, 'tensorflow' in sys.modules)"
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["keras_skip.optimizer", "True"]


def test_importing_after_keras_registers_the_classes_for_loading():
    result = run_python(
        "import keras, keras_skip; "
        "print(keras.saving.get_registered_object('keras_skip>SkipCorrectionOptimizer'))"
    )
    assert result.returncode == 0, result.stderr
    assert "SkipCorrectionOptimizer" in result.stdout


def test_importing_before_keras_still_registers_the_classes(tmp_path):
    path = tmp_path / "model.keras"
    result = run_python(
        "import keras_skip, sys\n"
        "assert 'tensorflow' not in sys.modules\n"
        "import keras\n"
        "model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])\n"
        "model.compile(optimizer=keras_skip.SkipCorrectionOptimizer("
        "keras.optimizers.SGD(0.1)), loss='mse')\n"
        f"model.save({str(path)!r})\n"
    )
    assert result.returncode == 0, result.stderr[-2000:]
    result = run_python(
        "import keras_skip\n"
        "import keras\n"
        f"model = keras.models.load_model({str(path)!r})\n"
        "print(type(model.optimizer).__name__)\n"
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip().endswith("SkipCorrectionOptimizer")


def test_missing_tensorflow_is_a_clear_error():

    result = run_python(
        "import sys; sys.modules['tensorflow'] = None; import keras_skip"
    )
    assert result.returncode != 0
    assert "keras-skip needs TensorFlow, which is not installed" in result.stderr
    assert "keras-skip[cpu]" in result.stderr


def test_other_keras_backend_is_a_clear_error():
    result = run_python("import keras_skip", env={"KERAS_BACKEND": "jax"})
    assert result.returncode != 0
    assert "the Keras backend is 'jax'" in result.stderr
    assert "KERAS_BACKEND=tensorflow" in result.stderr


def test_backend_from_keras_json(tmp_path):
    (tmp_path / "keras.json").write_text(json.dumps({"backend": "torch"}))
    env = {"KERAS_HOME": str(tmp_path)}
    env_without = {k: v for k, v in os.environ.items() if k != "KERAS_BACKEND"}
    result = subprocess.run(
        [sys.executable, "-c", "import keras_skip"],
        capture_output=True,
        text=True,
        env={**env_without, **env},
        timeout=60,
    )
    assert result.returncode != 0
    assert "'torch'" in result.stderr


def test_version_matches_the_installed_metadata():
    try:
        installed = metadata.version("keras-skip")
    except metadata.PackageNotFoundError:
        pytest.fail("keras-skip is not installed; install it with pip install -e .")
    assert keras_skip.__version__ == installed


def test_command_line_help():
    result = subprocess.run(
        [sys.executable, "-m", "keras_skip", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert "demo" in result.stdout
