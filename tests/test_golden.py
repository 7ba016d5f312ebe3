"""Golden checkpoints: files written by an earlier version of keras-skip load
and resume exactly, whatever the optimizer's insides become.

For each option combination, ``tests/golden/<name>/`` holds what was written
after one epoch on 4 replicas: a ``.keras`` file, the optimizer's variable
paths in order, every replica's state after that epoch and after one more,
and, for two combinations, a ``BackupAndRestore`` directory of a run
interrupted before its third epoch with the state at the end of that epoch.
The tests load them with the current code and continue training: every
replica must come back and go on as the code that wrote them did.

The files are written by this module, run as a script from the repository
root, only when the format is meant to change (say so in the changelog)::

    python tests/test_golden.py [COMBINATION ...]
"""

import contextlib
import json
import pathlib
import shutil

import keras
import numpy as np
import pytest
from conftest import components, mirrored

import keras_skip

GOLDEN = pathlib.Path(__file__).resolve().parent / "golden"
D, SAMPLES, BATCH, REPLICAS = 6, 256, 32, 4


def nesterov():
    return keras.optimizers.SGD(0.7, momentum=0.9, nesterov=True, name="outer")


#: Option combinations: keyword arguments of SkipCorrectionOptimizer (an
#: outer optimizer as a factory).
COMBINATIONS = {
    "default": {},
    "slots_average": {"optimizer_state": "average"},
    "slots_reset": {"optimizer_state": "reset"},
    "warmup": {"warmup_steps": 5},
    "correction_half": {"correction": 0.5},
    "outer": {"outer_optimizer": nesterov},
    "compression": {"compression": "bfloat16"},
    "overlap": {"overlap": True},
    "drift": {"measure_drift": True},
    "groups": {"group_size": 2},
    "outer_compression_overlap": {
        "outer_optimizer": nesterov,
        "compression": "bfloat16",
        "overlap": True,
    },
    # Delayed streaming averages: fragment 0's bfloat16 update, due after
    # step 4 of the 8 of an epoch, flies beside steps 5 and 6.
    "fragments_delayed": {
        "interval": 8,
        "fragments": 2,
        "overlap": 2,
        "outer_optimizer": nesterov,
        "compression": "bfloat16",
    },
}
WITH_BACKUP = ("default", "outer_compression_overlap")
#: Float rounding may differ between CPUs (kernels' summation order): far
#: below what a lost or misplaced piece of state changes.
RTOL, ATOL = 1e-4, 1e-5


def data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(SAMPLES, D)).astype("float32")
    y = (x[:, :1] * 2 - x[:, 1:2]).astype("float32")
    return x, y


def new_model(name, seed=0):
    options = dict(COMBINATIONS[name])
    keras.utils.set_random_seed(seed)
    strategy = mirrored(REPLICAS)
    with strategy.scope():
        if "outer_optimizer" in options:
            options["outer_optimizer"] = options["outer_optimizer"]()
        # Named, so that variable paths do not depend on what the process
        # created before.
        model = keras.Sequential(
            [
                keras.Input((D,)),
                keras.layers.Dense(8, activation="tanh", name="hidden"),
                keras.layers.BatchNormalization(name="norm"),
                keras.layers.Dense(1, name="out"),
            ],
            name="net",
        )
        model.compile(
            optimizer=keras_skip.SkipCorrectionOptimizer(
                keras.optimizers.Adam(0.01, name="inner"),
                interval=options.pop("interval", 3),
                name="skip",
                **options,
            ),
            loss="mse",
        )
    return model, strategy


def fit(model, epochs, initial_epoch=0, callbacks=()):
    x, y = data()
    model.fit(
        x,
        y,
        batch_size=BATCH,
        epochs=epochs,
        initial_epoch=initial_epoch,
        shuffle=False,
        verbose=0,
        callbacks=[*callbacks, keras_skip.SkipCorrectionCallback()],
    )


def state(model) -> dict[str, np.ndarray]:
    """Every replica's copy of every weight and optimizer variable, by
    position (``w<i>`` for weights, ``o<i>`` for optimizer variables)."""
    arrays = {}
    for prefix, variables in (("w", model.weights), ("o", model.optimizer.variables)):
        for i, variable in enumerate(variables):
            arrays[f"{prefix}{i}"] = np.stack(components(variable))
    return arrays


def paths(model) -> list[str]:
    return [v.path for v in model.optimizer.variables]


class Interrupt(keras.callbacks.Callback):
    def on_epoch_begin(self, epoch, logs=None):
        if epoch == 2:
            raise RuntimeError("interrupted")


def write(directory: pathlib.Path = GOLDEN, names=None) -> None:
    """Writes the files of `names` (every combination by default)."""
    for name in names or COMBINATIONS:
        out = directory / name
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir(parents=True)
        model, _ = new_model(name)
        fit(model, epochs=1)
        model.save(out / "model.keras")
        (out / "paths.json").write_text(json.dumps(paths(model), indent=1) + "\n")
        after_1 = state(model)
        fit(model, epochs=2, initial_epoch=1)
        np.savez_compressed(
            out / "state.npz",
            **{f"epoch1_{k}": v for k, v in after_1.items()},
            **{f"epoch2_{k}": v for k, v in state(model).items()},
        )
        if name in WITH_BACKUP:
            interrupted, _ = new_model(name)
            backup = keras_skip.BackupAndRestore(str(out / "backup"))
            with contextlib.suppress(RuntimeError):
                fit(interrupted, epochs=3, callbacks=[backup, Interrupt()])
            finished, _ = new_model(name)
            fit(finished, epochs=3)
            np.savez_compressed(out / "backup_end.npz", **state(finished))


def assert_state(expected: dict, model, prefix: str = "") -> None:
    found = state(model)
    wanted = {
        k.removeprefix(prefix): v for k, v in expected.items() if k.startswith(prefix)
    }
    assert found.keys() == wanted.keys()
    for key, value in wanted.items():
        np.testing.assert_allclose(found[key], value, rtol=RTOL, atol=ATOL, err_msg=key)


def test_every_combination_has_golden_files():
    assert sorted(p.name for p in GOLDEN.iterdir() if p.is_dir()) == sorted(
        COMBINATIONS
    )
    for name in WITH_BACKUP:
        assert (GOLDEN / name / "backup").is_dir(), name


@pytest.mark.parametrize("name", sorted(COMBINATIONS))
def test_a_saved_model_loads_and_resumes_as_written(name):
    golden = GOLDEN / name
    expected = dict(np.load(golden / "state.npz"))
    with mirrored(REPLICAS).scope():
        model = keras.models.load_model(golden / "model.keras")
    assert isinstance(model.optimizer, keras_skip.SkipCorrectionOptimizer)
    assert_state(expected, model, "epoch1_")
    fit(model, epochs=2, initial_epoch=1)
    assert_state(expected, model, "epoch2_")


@pytest.mark.parametrize("name", sorted(COMBINATIONS))
def test_the_optimizer_variables_keep_their_paths_and_order(name):
    model, strategy = new_model(name)
    with strategy.scope():
        model.optimizer.build(model.trainable_variables)
    assert paths(model) == json.loads((GOLDEN / name / "paths.json").read_text())


@pytest.mark.parametrize("name", WITH_BACKUP)
def test_a_backup_directory_resumes_as_written(name, tmp_path):
    golden = GOLDEN / name
    shutil.copytree(golden / "backup", tmp_path / "backup")
    model, _ = new_model(name, seed=99)  # the backup, not the seed, decides
    resumed_from = []

    class Epochs(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            resumed_from.append(epoch)

    fit(
        model,
        epochs=3,
        callbacks=[keras_skip.BackupAndRestore(str(tmp_path / "backup")), Epochs()],
    )
    assert resumed_from == [2]
    assert_state(dict(np.load(golden / "backup_end.npz")), model)


if __name__ == "__main__":
    import sys

    write(names=sys.argv[1:])
