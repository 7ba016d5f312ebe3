"""Test set-up: four logical CPU devices, so MirroredStrategy has 4 replicas."""

import contextlib
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ["KERAS_BACKEND"] = "tensorflow"

import numpy as np
import pytest
import tensorflow as tf

try:  # the oldest-versions environment runs the suite's core without it
    from hypothesis import settings
except ImportError:
    settings = None

# The suite draws the same examples on every run and every clean clone (for
# a pinned Hypothesis; see pyproject.toml), so it passes or fails by the code
# alone. `pytest --hypothesis-profile=explore` draws new examples each run;
# a failure it finds is added to its test as an explicit `@example`.
if settings is not None:
    settings.register_profile("deterministic", derandomize=True, print_blob=True)
    settings.register_profile("explore", derandomize=False, print_blob=True)
    settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "deterministic"))


def draw_without_local_constants() -> None:
    """Hypothesis also draws numbers it finds in the source of the project's
    modules loaded at the time of the draw (not the tests'). Which of them are
    loaded depends on the tests the process ran before, and pytest-xdist hands
    tests out by load, so the derandomized draws of one test changed from run
    to run. Under the deterministic profile the draws use Hypothesis' own
    constants only; `explore` keeps the project's."""
    from hypothesis.internal.conjecture import providers

    if not callable(getattr(providers, "_get_local_constants", None)):
        raise RuntimeError(
            "Hypothesis no longer has providers._get_local_constants: the "
            "deterministic profile needs another way to draw without the "
            "project's constants (see tests/conftest.py)"
        )
    found, empty = providers._get_local_constants, providers.Constants()

    def local_constants():
        if settings.get_current_profile_name() == "deterministic":
            return empty
        return found()

    providers._get_local_constants = local_constants


if settings is not None:
    draw_without_local_constants()

LOGICAL_DEVICES = 4

_cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(
    _cpu, [tf.config.LogicalDeviceConfiguration()] * LOGICAL_DEVICES
)


def mirrored(replicas: int) -> tf.distribute.MirroredStrategy:
    """A MirroredStrategy over the first `replicas` logical CPU devices, with
    collective keys of its own (tests create many strategies per process)."""
    from keras_skip import _compat

    strategy = tf.distribute.MirroredStrategy([f"/cpu:{i}" for i in range(replicas)])
    _compat.isolate_collective_keys(strategy)
    return strategy


def components(variable) -> list[np.ndarray]:
    """Every replica's own copy of a (Keras or tf) variable."""
    import keras

    v = variable.value if isinstance(variable, keras.Variable) else variable
    if not hasattr(v, "_values"):
        return [np.asarray(v.numpy())]
    return [
        np.asarray(c.numpy())
        for c in v.distribute_strategy.experimental_local_results(v)
    ]


def max_replica_spread(variables) -> float:
    """Largest difference between any replica's copy and replica 0's."""
    spread = 0.0
    for v in variables:
        copies = components(v)
        for c in copies[1:]:
            spread = max(spread, float(np.abs(c - copies[0]).max()))
    return spread


def quadratic_problem(seed, n, dim=3):
    """``grad_fn`` for `maths.simulate`: replica i minimises its own noisy,
    scaled quadratic around its own target, so replicas drift apart."""
    rng = np.random.default_rng(seed)
    targets = rng.normal(size=(n, dim))
    scales = rng.uniform(0.5, 2.0, size=(n, dim))
    noise = rng.normal(size=(64, n, dim)) * 0.1
    return lambda t, x: scales * (x - targets) + noise[t % 64]


@pytest.fixture
def strategy4():
    return mirrored(4)


@pytest.fixture
def strategy2():
    return mirrored(2)


@contextlib.contextmanager
def keras_fixes_for_every_model():
    """`keras_skip.apply_keras_fixes()` for the duration of the block: plain
    Keras optimizers under the trainer fixes, as the benchmark's synchronous
    baseline runs; undone afterwards, so other tests see stock Keras."""
    from keras.src.backend.tensorflow import trainer

    from keras_skip import _compat

    cls = trainer.TensorFlowTrainer
    saved = (
        cls.__dict__["_make_function"],
        cls.__dict__["_maybe_symbolic_build"],
        _compat.originals._GLOBAL_FIXES,
    )
    try:
        yield _compat.apply_keras_fixes()
    finally:
        (
            cls._make_function,
            cls._maybe_symbolic_build,
            _compat.originals._GLOBAL_FIXES,
        ) = saved


def pytest_collection_modifyitems(config, items):
    """The longest tests first (the oldest-versions run, then those marked
    slow), each group in collection order: `pytest -n 3` hands the first
    tests out to its workers in turn, so that no long test starts last and
    keeps one worker busy while the others wait.

    Three workers on 2 cores, not two: many tests wait on worker processes,
    emulated links or package installs, which left about a fifth of the
    cores idle with two; a third worker runs tests in those waits (on 2
    cores the whole suite took 1461-1934 s in two runs instead of
    2164-2255 s)."""

    def rank(item) -> int:
        if item.get_closest_marker("oldest"):
            return 0
        return 1 if item.get_closest_marker("slow") else 2

    items.sort(key=rank)
