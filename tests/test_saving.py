"""Saving and loading: every piece of state comes back, training resumes exactly."""

import internals
import keras
import numpy as np
import pytest
import tensorflow as tf
from conftest import components, mirrored

import keras_skip

D, SAMPLES, BATCH = 6, 256, 32


def data(seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(SAMPLES, D)).astype("float32")
    y = (x[:, :1] * 2 - x[:, 1:2]).astype("float32")
    return x, y


def new_model(strategy, seed=0, make_outer=None, inner=None, **skip):
    keras.utils.set_random_seed(seed)
    with strategy.scope():
        if make_outer is not None:
            skip["outer_optimizer"] = make_outer()
        model = keras.Sequential(
            [
                keras.Input((D,)),
                keras.layers.Dense(8, activation="tanh"),
                keras.layers.BatchNormalization(),
                keras.layers.Dense(1),
            ]
        )
        model.compile(
            optimizer=keras_skip.SkipCorrectionOptimizer(
                keras.optimizers.Adam(0.01) if inner is None else inner(), **skip
            ),
            loss="mse",
        )
    return model


def fit(model, epochs, initial_epoch=0, callbacks=()):
    x, y = data()
    return model.fit(
        x,
        y,
        batch_size=BATCH,
        epochs=epochs,
        initial_epoch=initial_epoch,
        shuffle=False,
        verbose=0,
        callbacks=[*callbacks, keras_skip.SkipCorrectionCallback()],
    )


def per_replica_state(model):
    opt = model.optimizer
    state = [components(v) for v in model.weights]
    state += [components(v) for v in opt.variables]
    return state


def assert_same_state(a, b):
    assert len(a) == len(b)
    for va, vb in zip(a, b, strict=True):
        for ca, cb in zip(va, vb, strict=True):
            np.testing.assert_allclose(cb, ca, rtol=1e-6, atol=1e-7)


def test_get_config_round_trip():
    optimizer = keras_skip.SkipCorrectionOptimizer(
        keras.optimizers.AdamW(0.002, weight_decay=0.01),
        interval=5,
        correction=0.25,
        optimizer_state="average",
        warmup_steps=7,
        name="skip",
    )
    optimizer.interval = 6
    config = optimizer.get_config()
    assert config["interval"] == 6
    clone = keras_skip.SkipCorrectionOptimizer.from_config(config)
    assert clone.get_config() == config
    assert isinstance(clone.inner_optimizer, keras.optimizers.AdamW)
    assert clone.inner_optimizer.weight_decay == 0.01
    revived = keras.optimizers.deserialize(keras.optimizers.serialize(optimizer))
    assert isinstance(revived, keras_skip.SkipCorrectionOptimizer)
    assert revived.get_config() == config


@pytest.mark.parametrize("optimizer_state", ["local", "average_second_moments"])
def test_save_load_continue_equals_uninterrupted_training(tmp_path, optimizer_state):
    """4 replicas, Adam slots and corrections that differ per replica (with
    averaged second moments, the first moments): saving after epoch 1 and
    continuing from the file reproduces the run."""
    uninterrupted = new_model(mirrored(4), interval=3, optimizer_state=optimizer_state)
    fit(uninterrupted, epochs=2)

    first = new_model(mirrored(4), interval=3, optimizer_state=optimizer_state)
    fit(first, epochs=1)
    assert first.optimizer.averages_performed > 0
    path = tmp_path / "model.keras"
    first.save(path)

    with mirrored(4).scope():
        resumed = keras.models.load_model(path)
    assert isinstance(resumed.optimizer, keras_skip.SkipCorrectionOptimizer)
    assert_same_state(per_replica_state(first), per_replica_state(resumed))
    fit(resumed, epochs=2, initial_epoch=1)
    assert_same_state(per_replica_state(uninterrupted), per_replica_state(resumed))
    assert (
        resumed.optimizer.averages_performed
        == uninterrupted.optimizer.averages_performed
    )


def test_nadam_momentum_schedule_is_saved_and_resumed_exactly(tmp_path):
    """Nadam keeps its momentum schedule in a plain attribute: it must be
    among the optimizer's variables, or a resumed run restarts it."""
    uninterrupted = new_model(
        mirrored(2), interval=3, inner=lambda: keras.optimizers.Nadam(0.01)
    )
    fit(uninterrupted, epochs=2)
    first = new_model(
        mirrored(2), interval=3, inner=lambda: keras.optimizers.Nadam(0.01)
    )
    fit(first, epochs=1)
    schedule = first.optimizer.inner_optimizer._u_product
    assert any(v is schedule for v in first.optimizer.variables)
    assert float(schedule.numpy()) < 1.0
    first.save_weights(tmp_path / "w.weights.h5")
    strategy = mirrored(2)
    resumed = new_model(
        strategy, interval=3, inner=lambda: keras.optimizers.Nadam(0.01)
    )
    with strategy.scope():
        resumed.optimizer.build(resumed.trainable_variables)
    resumed.load_weights(tmp_path / "w.weights.h5")
    assert float(resumed.optimizer.inner_optimizer._u_product.numpy()) == float(
        schedule.numpy()
    )
    fit(resumed, epochs=2, initial_epoch=1)
    assert_same_state(per_replica_state(uninterrupted), per_replica_state(resumed))


def test_counters_gamma_and_interval_survive_mid_interval(tmp_path):
    model = new_model(tf.distribute.get_strategy(), interval=8)
    x, y = data()
    for i in range(5):
        model.train_on_batch(
            x[BATCH * i : BATCH * (i + 1)], y[BATCH * i : BATCH * (i + 1)]
        )
    optimizer = model.optimizer
    optimizer.interval = 6
    assert optimizer.local_steps_since_average == 5
    gamma = internals.gamma(optimizer)
    assert gamma == pytest.approx(0.05)
    path = tmp_path / "mid.keras"
    model.save(path)
    loaded = keras.models.load_model(path).optimizer
    assert loaded.local_steps_since_average == 5
    assert internals.gamma(loaded) == gamma
    assert loaded.interval == 6
    assert loaded.averages_performed == 0
    assert int(loaded.iterations.numpy()) == 5

    weights = tmp_path / "mid.weights.h5"
    model.save_weights(weights)
    other = new_model(tf.distribute.get_strategy(), interval=2)
    other.optimizer.build(other.trainable_variables)
    other.load_weights(weights)
    assert other.optimizer.interval == 6
    assert other.optimizer.local_steps_since_average == 5


def test_backup_and_restore_resumes_exactly(tmp_path):
    uninterrupted = new_model(mirrored(4), interval=3)
    fit(uninterrupted, epochs=3)

    class Interrupt(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            if epoch == 2:
                raise RuntimeError("interrupted")

    backup = keras.callbacks.BackupAndRestore(str(tmp_path / "backup"))
    interrupted = new_model(mirrored(4), interval=3)
    with pytest.raises(RuntimeError, match="interrupted"):
        fit(interrupted, epochs=3, callbacks=[backup, Interrupt()])
    restarted = new_model(mirrored(4), seed=99, interval=3)
    fit(restarted, epochs=3, callbacks=[backup])
    assert_same_state(per_replica_state(uninterrupted), per_replica_state(restarted))


def test_a_single_worker_backs_up_into_backup_dir_itself(tmp_path):
    backup = keras_skip.BackupAndRestore(
        str(tmp_path / "backup"), delete_checkpoint=False
    )
    assert backup.worker_directory is None  # known once training begins
    fit(new_model(mirrored(2), interval=3), epochs=2, callbacks=[backup])
    assert backup.worker_directory == tmp_path / "backup"
    written = sorted(p.name for p in backup.worker_directory.iterdir())
    assert written == ["epoch-1", "epoch-2"]  # epochs done
    assert (backup.worker_directory / "epoch-2" / "backup.weights.h5").is_file()


def test_loading_on_another_replica_count_warns_and_resets_corrections(tmp_path):
    model = new_model(mirrored(4), interval=3)
    fit(model, epochs=1)
    path = tmp_path / "four.weights.h5"
    model.save_weights(path)
    other = new_model(mirrored(2), interval=3)
    with other.distribute_strategy.scope():
        other.optimizer.build(other.trainable_variables)
    with pytest.warns(UserWarning, match="corrections restart from zero"):
        other.load_weights(path)
    for c in internals.corrections(other.optimizer):
        assert all(not np.any(copy) for copy in components(c))
    np.testing.assert_allclose(
        components(other.optimizer.inner_optimizer._momentums[0])[0],
        np.mean(components(model.optimizer.inner_optimizer._momentums[0]), axis=0),
        rtol=1e-6,
    )
    np.testing.assert_array_equal(other.get_weights()[0], model.get_weights()[0])


def test_loading_a_mismatched_optimizer_is_a_clear_error(tmp_path):
    model = new_model(tf.distribute.get_strategy())
    model.optimizer.build(model.trainable_variables)
    path = tmp_path / "adam.weights.h5"
    model.save_weights(path)
    keras.utils.set_random_seed(0)
    other = keras.Sequential(
        [
            keras.Input((D,)),
            keras.layers.Dense(8, activation="tanh"),
            keras.layers.BatchNormalization(),
            keras.layers.Dense(1),
        ]
    )
    other.compile(
        optimizer=keras_skip.SkipCorrectionOptimizer(keras.optimizers.SGD(0.1)),
        loss="mse",
    )
    other.optimizer.build(other.trainable_variables)
    with pytest.raises(ValueError, match="holds"):
        other.load_weights(path)
