"""``boundary="latest"``: an epoch ends with no communication.

The epoch's end shows each fragment's latest average on every replica
(validation and every callback's `on_epoch_end` see it), and the next
epoch's first step puts every replica's own weights back. Training is then
the reference's run with no boundary average (a delayed average on its way
lands at the epoch's end), and the model after `fit` is the full average of
its last step. The split linear model of test_streaming trains on 4
MirroredStrategy replicas for 3 epochs of 6 steps.
"""

import internals
import keras
import numpy as np
import pytest
from conftest import mirrored
from test_against_reference import (
    GLOBAL_BATCH,
    INNERS,
    REPLICAS,
    STEPS_PER_EPOCH,
    assert_relative,
    make_data,
)
from test_saving import assert_same_state, per_replica_state
from test_streaming import (
    compile_model,
    fit,
    outer_options,
    per_replica,
    reference,
    weights_of,
)

import keras_skip
from keras_skip import maths

EPOCHS = 3
STEPS = STEPS_PER_EPOCH * EPOCHS
ENDS = tuple(range(STEPS_PER_EPOCH, STEPS, STEPS_PER_EPOCH))


class Shown(keras.callbacks.Callback):
    """Every replica's weights and the averages performed, at each epoch's
    end (after `SkipCorrectionCallback`'s boundary) and at the next epoch's
    first step."""

    def __init__(self):
        super().__init__()
        self.ends, self.averages, self.begins = [], [], []

    def on_epoch_end(self, epoch, logs=None):
        self.ends.append(weights_of(self.model))
        self.averages.append(self.model.optimizer.averages_performed)

    def on_train_batch_begin(self, batch, logs=None):
        if batch == 0:
            self.begins.append(weights_of(self.model))


def run(make_keras, make_outer=None, **skip):
    model, optimizer = compile_model(
        mirrored(REPLICAS), make_keras, make_outer=make_outer, **skip
    )
    shown = Shown()
    fit(model, epochs=EPOCHS, callbacks=[shown])
    return model, optimizer, shown


def expect(make_reference, optimizer, steps, boundaries=(), **skip):
    """The reference's run of `steps` steps (correction 1) with the
    optimizer's fragments, a full average after `boundaries` only, and a
    delayed average on its way landing at each epoch's end."""
    count = optimizer.fragments
    return reference(
        make_reference(),
        steps=steps,
        boundaries=boundaries,
        landings=ENDS,
        correction=1.0,
        fragments=internals.fragments(optimizer) if count > 1 else 1,
        **skip,
    )


def last_average(interval, count, fragment, steps):
    """The step count after which `fragment`'s latest average (of a run
    with no full average) was taken, or 0."""
    offset = maths.fragment_offsets(interval, count)[fragment]
    if steps < offset:
        return 0
    return offset + (steps - offset) // interval * interval


@pytest.mark.parametrize(
    ("count", "interval", "inner"),
    [(1, 4, "momentum"), (2, 5, "sgd"), (3, 6, "momentum")],
)
def test_an_epoch_shows_each_fragments_latest_average_and_training_goes_on(
    count, interval, inner
):
    """At each epoch's end every replica shows, per fragment, the weights
    its latest average left (the reference's, at that step); the next
    epoch starts from every replica's own weights, and the whole run is the
    reference's with no boundary average but the one after `fit`."""
    make_keras, make_reference = INNERS[inner]
    skip = dict(interval=interval, correction=1.0, fragments=count)
    model, optimizer, shown = run(make_keras, boundary="latest", **skip)
    parts = internals.fragments(optimizer) if count > 1 else [np.arange(7)]

    def expected(steps, boundaries=()):
        return expect(make_reference, optimizer, steps, boundaries, interval=interval)

    final = expected(STEPS, boundaries=(STEPS,))
    assert_relative(weights_of(model), final.x)
    assert optimizer.averages_performed == final.averages
    assert not optimizer.showing_latest_averages
    apart = []
    for epoch, end in enumerate(ENDS):
        history = expected(end).history
        # No full average at the boundary: only the schedule's.
        assert shown.averages[epoch] == expected(end).averages
        for j, coordinates in enumerate(parts):
            at = last_average(interval, count, j, end)
            assert at > 0
            average = history[at - 1][:, coordinates]
            np.testing.assert_allclose(
                shown.ends[epoch][:, coordinates], average, rtol=1e-5, atol=1e-6
            )
        # Every replica's own weights are back for the next epoch.
        assert_relative(shown.begins[epoch + 1], history[-1])
        apart.append(np.ptp(history[-1], axis=0).max() > 1e-4)
    assert any(apart)  # the replicas' own weights differed at some boundary


@pytest.mark.parametrize(
    ("count", "overlap", "compression", "outer"),
    [
        (1, True, "bfloat16", True),
        (2, True, None, False),
        (2, 2, "bfloat16", True),
        (1, 2, None, False),
    ],
)
def test_latest_boundary_with_overlap_compression_and_outer_matches_reference(
    count, overlap, compression, outer
):
    """Overlapped and delayed averages (one on its way lands at the
    epoch's end), compression and an outer Nesterov step: every replica
    shows the same model at each epoch's end and the run follows the
    reference."""
    make_keras, make_reference = INNERS["sgd"]
    interval = 5 if count == 2 else 4
    skip = dict(
        interval=interval,
        correction=1.0,
        fragments=count,
        overlap=overlap,
        compression=compression,
    )
    make_outer, extra = outer_options("nesterov" if outer else None)
    model, optimizer, shown = run(
        make_keras, make_outer=make_outer, boundary="latest", **skip
    )

    def expected(steps, boundaries=()):
        return expect(
            make_reference,
            optimizer,
            steps,
            boundaries,
            interval=interval,
            overlap=overlap,
            compression=compression,
            **extra,
        )

    tolerance = 1e-5 if compression is None else 1e-4
    for epoch, end in enumerate(ENDS):
        # Every replica's own weights, back for the next epoch.
        assert_relative(shown.begins[epoch + 1], expected(end).history[-1], tolerance)
        assert shown.averages[epoch] == expected(end).averages
        assert np.ptp(shown.ends[epoch], axis=0).max() == 0.0  # one model shown
    if overlap is True:
        # After `fit`, the full average of the last step (a delayed average
        # lands there first, which the reference's boundary rule does
        # earlier).
        final = expected(STEPS, boundaries=(STEPS,))
        assert_relative(weights_of(model), final.x, tolerance)
        assert optimizer.averages_performed == final.averages
    assert np.ptp(weights_of(model), axis=0).max() == 0.0


def test_an_epoch_without_every_fragments_average_ends_with_a_full_average():
    """Interval 8 and 2 fragments on epochs of 6 steps: only fragment 0's
    average falls in each epoch, so each epoch ends with a full average, as
    with ``boundary="full"``."""
    make_keras, _ = INNERS["sgd"]
    skip = dict(interval=8, correction=1.0, fragments=2)
    latest, optimizer, shown = run(make_keras, boundary="latest", **skip)
    full, _, _ = run(make_keras, **skip)
    np.testing.assert_array_equal(weights_of(latest), weights_of(full))
    assert optimizer.averages_performed == full.optimizer.averages_performed
    for end in shown.ends:
        assert np.ptp(end, axis=0).max() == 0.0


def test_validation_sees_the_shown_model_and_takes_no_average():
    """`fit(validation_data=...)` evaluates the latest averages: the
    validation loss is the loss of the weights shown at the epoch's end,
    and validating averages nothing."""
    make_keras, _ = INNERS["momentum"]
    model, _ = compile_model(
        mirrored(REPLICAS), make_keras, interval=4, boundary="latest"
    )
    shown = Shown()
    rng = np.random.default_rng(3)
    x_val = rng.normal(size=(32, 5)).astype("float32")
    y_val = rng.normal(size=(32, 1)).astype("float32")
    x, y = make_data()
    history = model.fit(
        x.reshape(-1, 5).astype("float32"),
        y.reshape(-1, 1).astype("float32"),
        batch_size=GLOBAL_BATCH,
        epochs=2,
        shuffle=False,
        verbose=0,
        validation_data=(x_val, y_val),
        callbacks=[keras_skip.SkipCorrectionCallback(), shown],
    )
    assert shown.averages == [1, 3]  # after steps 4, then 8 and 12
    for epoch in range(2):
        k1, b1, k2, b2 = np.split(shown.ends[epoch][0], [2, 3, 6])
        prediction = x_val[:, :2] @ k1 + b1 + x_val[:, 2:] @ k2 + b2
        loss = float(np.mean((prediction[:, None] - y_val) ** 2))
        assert history.history["val_loss"][epoch] == pytest.approx(loss, rel=1e-5)


def test_a_checkpoint_taken_while_shown_resumes_exactly(tmp_path):
    """A `.keras` file written by `ModelCheckpoint` at an epoch's end holds
    the shown (averaged) weights for inference and every replica's own
    weights for training: continuing from it equals the uninterrupted run."""
    make_keras, _ = INNERS["momentum"]
    skip = dict(interval=4, correction=1.0, fragments=2, boundary="latest")
    uninterrupted, _ = compile_model(mirrored(REPLICAS), make_keras, **skip)
    fit(uninterrupted, epochs=EPOCHS)

    first, _ = compile_model(mirrored(REPLICAS), make_keras, **skip)
    path = tmp_path / "m.keras"
    shown = Shown()
    saver = keras.callbacks.ModelCheckpoint(path)
    fit(first, epochs=2, callbacks=[shown, saver])
    with mirrored(REPLICAS).scope():
        resumed = keras.saving.load_model(path)
    assert resumed.optimizer.boundary == "latest"
    assert resumed.optimizer.showing_latest_averages
    np.testing.assert_array_equal(weights_of(resumed), shown.ends[1])
    fit(resumed, epochs=EPOCHS, initial_epoch=2)
    assert not resumed.optimizer.showing_latest_averages
    assert_same_state(per_replica_state(uninterrupted), per_replica_state(resumed))


class Worse(keras.callbacks.Callback):
    """Reports a loss that grows each epoch: the first epoch is the best."""

    def on_epoch_end(self, epoch, logs=None):
        logs["loss"] = float(epoch)


@pytest.mark.parametrize("stopping_first", [True, False])
def test_early_stoppings_best_weights_are_kept(stopping_first):
    """`EarlyStopping(restore_best_weights=True)` listed before or after the
    callback: the model after `fit` holds the weights shown at the best
    epoch's end, not an average of the replicas' own."""
    make_keras, _ = INNERS["sgd"]
    model, _ = compile_model(
        mirrored(REPLICAS), make_keras, interval=4, boundary="latest"
    )
    shown = Shown()
    stop = keras.callbacks.EarlyStopping(
        monitor="loss", patience=10, restore_best_weights=True
    )
    skip = keras_skip.SkipCorrectionCallback()
    order = [stop, skip] if stopping_first else [skip, stop]
    x, y = make_data()
    model.fit(
        x.reshape(-1, 5).astype("float32"),
        y.reshape(-1, 1).astype("float32"),
        batch_size=GLOBAL_BATCH,
        epochs=EPOCHS,
        shuffle=False,
        verbose=0,
        callbacks=[Worse(), shown, *order],
    )
    np.testing.assert_array_equal(weights_of(model), shown.ends[0])
    assert np.ptp(weights_of(model), axis=0).max() == 0.0


def test_boundary_is_checked_and_kept_in_the_config():
    inner = keras.optimizers.SGD(0.1)
    with pytest.raises(ValueError, match=r"`boundary` must be 'full' or 'latest'"):
        keras_skip.SkipCorrectionOptimizer(inner, boundary="stream")
    optimizer = keras_skip.SkipCorrectionOptimizer(inner, boundary="latest")
    config = optimizer.get_config()
    assert config["boundary"] == "latest"
    assert keras_skip.SkipCorrectionOptimizer.from_config(config).boundary == "latest"
    full = keras_skip.SkipCorrectionOptimizer(keras.optimizers.SGD(0.1))
    assert full.boundary == "full"
    with pytest.raises(ValueError, match="boundary='latest'"):
        full.show_latest_averages()


def test_a_shown_model_is_restored_before_a_full_average():
    """`optimizer.average()` while the averages are shown puts every
    replica's own weights back first, so the full average is theirs."""
    make_keras, _ = INNERS["sgd"]
    model, optimizer = compile_model(
        mirrored(REPLICAS), make_keras, interval=4, boundary="latest"
    )
    fit(model, epochs=1)  # ends with a full average after step 6
    before = per_replica(model.trainable_variables)
    assert np.ptp(before, axis=0).max() == 0.0
    optimizer.show_latest_averages()  # nothing moved: shows the weights
    assert optimizer.showing_latest_averages
    np.testing.assert_array_equal(per_replica(model.trainable_variables), before)
    assert optimizer.average() is False
    assert not optimizer.showing_latest_averages


def test_many_models_in_one_process_do_not_warn_that_tracing_is_expensive(caplog):
    """Each optimizer traces its own functions (the delayed averages' reduce
    and landing, the shown model's, the full average `fit` ends with).
    TensorFlow counts retracing by the Python code a function was made from,
    so functions made from one lambda by six models in one process (a
    notebook's cells) looked like one function traced six times and warned
    that "tracing is expensive"."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 4)).astype("float32")
    for _ in range(6):
        with mirrored(2).scope():
            model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
            model.compile(
                optimizer=keras_skip.SkipCorrectionOptimizer(
                    keras.optimizers.SGD(0.01),
                    interval=2,
                    fragments=2,
                    overlap=2,
                    boundary="latest",
                ),
                loss="mse",
            )
        model.fit(
            x,
            x.sum(axis=1),
            batch_size=16,
            epochs=2,
            verbose=0,
            callbacks=[keras_skip.SkipCorrectionCallback()],
        )
        assert model.optimizer.averages_performed > 0
    assert "triggered tf.function retracing" not in caplog.text
