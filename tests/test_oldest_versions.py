"""The core of the suite under the oldest Keras and TensorFlow keras-skip supports.

keras-skip works around Keras and TensorFlow internals (``keras_skip._compat``,
``keras_skip.optimizer``), which change between releases without notice. Its
supported range goes from the oldest releases whose internals match what the
workarounds expect (Keras 3.12: the TensorFlow trainer's ``_make_function``
with ``_autoconvert_optionals``; TensorFlow 2.19: ``coordination_config_pb2``
under ``tensorflow.compiler.xla.tsl``) to the newest minor releases tested.
The rest of the suite runs with the newest releases in that range; this test
builds a fresh environment with the oldest pair, checks that it really has
them, and runs the suite's core there.

The range is stated once, in ``keras_skip._compat`` (which also warns outside
it):
`test_supported_range_is_stated_consistently` checks that ``pyproject.toml``
and the installation docs state the same one, and the oldest pair must not
set off keras-skip's warning about untested versions.
"""

import json
import os
import pathlib
import shutil
import subprocess
import sys
import tomllib

import pytest
from packaging.requirements import Requirement

from keras_skip import _compat

#: The oldest releases supported, which this test installs, and the newest
#: minor releases tested (the rest of the suite runs with them): the range of
#: keras-skip's warning about untested versions.
OLDEST_KERAS = _compat.OLDEST_KERAS
OLDEST_TENSORFLOW = _compat.OLDEST_TENSORFLOW
NEWEST_KERAS = ".".join(_compat.CHECKED_KERAS.split(".")[:2])
NEWEST_TENSORFLOW = ".".join(_compat.CHECKED_TENSORFLOW.split(".")[:2])

#: The core of the suite (its tests not marked slow): the upstream behaviours
#: the workarounds rely on, the step through Keras' own optimizer hooks, loss
#: scaling, averages between replicas and at epoch boundaries (before every
#: callback), and two worker processes under MultiWorkerMirroredStrategy.
CORE_TESTS = (
    "tests/test_compat.py",
    "tests/test_errors.py",
    "tests/test_mixed_precision.py",
    "tests/test_replicas.py",
    "tests/test_boundaries.py",
    "tests/test_callback_order.py",
    "tests/test_multi_worker.py",
)
#: Left out of the core, to keep the suite's time: the benchmark launcher
#: (keras-skip's own process handling), and the two longest boundary tests,
#: whose validation runs add to the epoch-boundary average the core checks
#: elsewhere only Keras' evaluate loop inside fit.
NOT_IN_CORE = "not launcher and not validation"

ROOT = pathlib.Path(__file__).resolve().parents[1]
#: What building the package from a copy of the checkout needs.
PACKAGE_FILES = ("pyproject.toml", "README.md", "LICENSE")
#: Output of a pip that could not reach the package index.
NETWORK_ERRORS = (
    "NewConnectionError",
    "Failed to establish a new connection",
    "Temporary failure in name resolution",
    "Name or service not known",
    "Network is unreachable",
    "ConnectTimeoutError",
    "ReadTimeoutError",
    "ProxyError",
    "Max retries exceeded",
)

VERSIONS_SCRIPT = """
import json
import warnings

import keras
import tensorflow as tf

with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    import keras_skip.optimizer
print(json.dumps({
    "keras": keras.__version__,
    "tensorflow": tf.__version__,
    "keras_skip": keras_skip.optimizer.__file__,
    "warnings": [str(w.message) for w in caught],
}))
"""


def next_minor(version: str) -> str:
    major, minor = version.split(".")[:2]
    return f"{major}.{int(minor) + 1}"


def supported(package: str) -> str:
    """The requirement pyproject.toml states for `package`."""
    oldest, newest = (
        (OLDEST_KERAS, NEWEST_KERAS)
        if package == "keras"
        else (OLDEST_TENSORFLOW, NEWEST_TENSORFLOW)
    )
    return f"{package}>={oldest},<{next_minor(newest)}"


def test_supported_range_is_stated_consistently():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    stated = {
        "keras": project["dependencies"],
        "tensorflow-cpu": extras["cpu"],
        "tensorflow": extras["tensorflow"],
    }
    docs = (ROOT / "docs" / "installation.md").read_text()
    for package, requirements in stated.items():
        found = [r for r in map(Requirement, requirements) if r.name == package]
        assert len(found) == 1, (package, requirements)
        expected = Requirement(supported(package))
        assert found[0].specifier == expected.specifier, (package, str(found[0]))
        assert f"`{supported(package)}`" in docs, supported(package)
    for version in (OLDEST_KERAS, OLDEST_TENSORFLOW):
        assert version in docs, version


def run(command, timeout, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(
        command,
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
        **kwargs,
    )


def tail(result: subprocess.CompletedProcess, lines: int = 60) -> str:
    output = (result.stdout + result.stderr).splitlines()
    return "\n".join(output[-lines:])


def skip_if_the_index_is_unreachable(directory: pathlib.Path) -> None:
    probe = run(
        [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--disable-pip-version-check",
            "--retries",
            "1",
            "--timeout",
            "20",
            "--dest",
            str(directory),
            f"keras=={OLDEST_KERAS}",
        ],
        timeout=120,
    )
    if probe.returncode != 0 and any(
        marker in probe.stdout + probe.stderr for marker in NETWORK_ERRORS
    ):
        pytest.skip(f"the package index is unreachable:\n{tail(probe, 5)}")
    assert probe.returncode == 0, tail(probe)


def copy_of_the_package(destination: pathlib.Path) -> pathlib.Path:
    """The package's sources, so that building it leaves the checkout alone."""
    shutil.copytree(
        ROOT / "keras_skip",
        destination / "keras_skip",
        ignore=shutil.ignore_patterns("__pycache__", "*.pyc"),
    )
    for name in PACKAGE_FILES:
        shutil.copy2(ROOT / name, destination / name)
    return destination


def tools_from_the_test_extra() -> list[str]:
    """pytest and pytest-timeout as the ``test`` extra requires them."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    tools = [
        r
        for r in project["optional-dependencies"]["test"]
        if Requirement(r).name in ("pytest", "pytest-timeout")
    ]
    assert len(tools) == 2, tools
    return tools


@pytest.mark.oldest
@pytest.mark.timeout(1800)  # its steps' own timeouts add up to 1740 s
def test_core_passes_with_the_oldest_keras_and_tensorflow(tmp_path):
    skip_if_the_index_is_unreachable(tmp_path / "probe")
    venv = tmp_path / "venv"
    try:
        check_the_core(tmp_path, venv)
    finally:
        shutil.rmtree(venv, ignore_errors=True)  # about 1.5 GB


def check_the_core(tmp_path: pathlib.Path, venv: pathlib.Path) -> None:
    env = {
        name: value
        for name, value in os.environ.items()
        if not name.startswith(("PYTEST_", "PYTHON", "VIRTUAL_ENV"))
    }
    env.update(TF_CPP_MIN_LOG_LEVEL="2", PYTHONDONTWRITEBYTECODE="1")
    created = run([sys.executable, "-m", "venv", str(venv)], timeout=120, env=env)
    assert created.returncode == 0, tail(created)
    python = str(venv / "bin" / "python")
    source = copy_of_the_package(tmp_path / "source")
    # Installed with its dependencies, so that pip also checks the pins
    # against the bounds of pyproject.toml.
    installed = run(
        [
            python,
            "-m",
            "pip",
            "install",
            "--disable-pip-version-check",
            "--quiet",
            f"{source}[cpu]",
            f"keras=={OLDEST_KERAS}",
            f"tensorflow-cpu=={OLDEST_TENSORFLOW}",
            *tools_from_the_test_extra(),
        ],
        timeout=600,
        env=env,
    )
    assert installed.returncode == 0, tail(installed)

    # Run from an empty directory: the package comes from the new
    # environment, not from the checkout.
    work = tmp_path / "work"
    work.mkdir()
    probed = run([python, "-c", VERSIONS_SCRIPT], timeout=120, cwd=work, env=env)
    assert probed.returncode == 0, tail(probed)
    found = json.loads(probed.stdout.splitlines()[-1])
    assert (found["keras"], found["tensorflow"]) == (OLDEST_KERAS, OLDEST_TENSORFLOW)
    assert pathlib.Path(found["keras_skip"]).is_relative_to(venv), found
    untested = [
        message
        for message in found["warnings"]
        if OLDEST_KERAS in message or OLDEST_TENSORFLOW in message
    ]
    assert not untested, f"the oldest supported versions are warned about: {untested}"

    core = run(
        [
            python,
            "-m",
            "pytest",
            "-p",
            "no:cacheprovider",
            "-q",
            "--tb=short",
            "--disable-warnings",
            "-m",
            "not slow",
            "-k",
            NOT_IN_CORE,
            *(str(ROOT / path) for path in CORE_TESTS),
        ],
        timeout=780,
        cwd=work,
        env=env,
    )
    assert core.returncode == 0, (
        f"the core of the suite failed with keras {OLDEST_KERAS} and "
        f"tensorflow-cpu {OLDEST_TENSORFLOW}:\n{tail(core, 80)}"
    )
