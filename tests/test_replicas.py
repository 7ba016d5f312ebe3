"""What each replica holds: apart between averages, identical after one."""

import internals
import keras
import numpy as np
import pytest
from conftest import components, max_replica_spread, mirrored

import keras_skip

D = 6


def classification_data(n=256, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, D)).astype("float32")
    y = (x[:, 0] + 0.5 * x[:, 1] > 0).astype("int32")
    return x, y


def compiled_model(strategy, batch_norm=False, **skip):
    keras.utils.set_random_seed(0)
    with strategy.scope():
        layers = [keras.Input((D,)), keras.layers.Dense(8, activation="relu")]
        if batch_norm:
            layers.append(keras.layers.BatchNormalization())
        layers.append(keras.layers.Dense(2))
        model = keras.Sequential(layers)
        optimizer = keras_skip.SkipCorrectionOptimizer(
            keras.optimizers.SGD(0.05, momentum=0.5), **skip
        )
        model.compile(
            optimizer=optimizer,
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy"],
        )
        optimizer.build(model.trainable_variables)
    optimizer.attach(model)
    return model, optimizer


class Recorder(keras.callbacks.Callback):
    """Records, after every step and before SkipCorrectionCallback runs,
    how far apart the replicas are."""

    def __init__(self, variables=None):
        super().__init__()
        self.variables = variables
        self.spreads, self.local_steps, self.snapshots = [], [], []

    def on_train_batch_end(self, batch, logs=None):
        variables = self.variables or self.model.trainable_variables
        self.spreads.append(max_replica_spread(variables))
        self.local_steps.append(self.model.optimizer.local_steps_since_average)
        self.snapshots.append([components(v) for v in variables])


def fit(model, x, y, recorder, epochs=1, extra=()):
    model.fit(
        x,
        y,
        batch_size=32,
        epochs=epochs,
        shuffle=False,
        verbose=0,
        callbacks=[recorder, *extra, keras_skip.SkipCorrectionCallback()],
    )


def test_replicas_differ_between_averages_and_agree_right_after_one():
    x, y = classification_data()
    model, optimizer = compiled_model(mirrored(4), interval=3)
    recorder = Recorder()
    fit(model, x, y, recorder)
    # The epoch's last step takes the boundary average itself.
    assert recorder.local_steps == [1, 2, 0, 1, 2, 0, 1, 0]

    for step, spread in enumerate(recorder.spreads):
        if recorder.local_steps[step] == 0:
            assert spread == 0.0, (
                f"replicas differ right after the average at step {step}"
            )
        else:
            assert spread > 1e-4, f"replicas identical at local step {step}"
    # The epoch's last step (local step 2) is followed by a boundary average.
    assert max_replica_spread(model.trainable_variables) == 0.0
    assert optimizer.averages_performed == 3
    corrections = [c for c in internals.corrections(optimizer) if c is not None]
    assert max_replica_spread(corrections) > 0
    for c in corrections:
        np.testing.assert_allclose(np.sum(components(c), axis=0), 0, atol=1e-5)


def test_batch_norm_statistics_are_averaged_and_integer_state_is_not():
    x, y = classification_data()
    model, optimizer = compiled_model(mirrored(4), batch_norm=True, interval=2)
    bn = model.layers[1]
    recorder = Recorder([bn.moving_mean, bn.moving_variance])
    fit(model, x, y, recorder)
    assert recorder.spreads[0] > 0
    assert recorder.spreads[1] == 0
    state = {id(v) for v in internals.model_state(optimizer)}
    assert {id(bn.moving_mean.value), id(bn.moving_variance.value)} <= state
    assert all(v.dtype.is_floating for v in internals.model_state(optimizer))
    assert [int(i) for i in components(optimizer.iterations)] == [8] * 4


def test_going_back_to_interval_1_resynchronizes_replicas():
    """Interval 1 after local steps averages weights and slots first, so the
    synchronous steps that follow keep the replicas identical."""
    x, y = classification_data()
    model, optimizer = compiled_model(mirrored(4), interval=4)

    class BackToOne(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if batch == 4:
                optimizer.interval = 1

    variables = model.trainable_variables + internals.slot_variables(optimizer)
    recorder = Recorder(variables)
    fit(model, x, y, recorder, extra=[BackToOne()])
    assert recorder.spreads[4] > 0  # one local step pending, slots apart
    assert recorder.spreads[5:] == [0.0, 0.0, 0.0]


def test_frozen_layers_are_not_averaged():
    keras.utils.set_random_seed(0)
    strategy = mirrored(2)
    with strategy.scope():
        frozen = keras.layers.Dense(4)
        frozen_bn = keras.layers.BatchNormalization()
        model = keras.Sequential(
            [
                keras.Input((D,)),
                frozen,
                frozen_bn,
                keras.layers.BatchNormalization(),
                keras.layers.Dense(2),
            ]
        )
        frozen.trainable = False
        frozen_bn.trainable = False
        model.compile(
            optimizer=keras_skip.SkipCorrectionOptimizer(keras.optimizers.SGD(0.1)),
            loss="mse",
        )
    model.optimizer.attach(model)
    averaged = {id(v.value) for v in model.layers[2].non_trainable_variables}
    state = {id(v) for v in internals.model_state(model.optimizer)}
    assert averaged <= state
    assert not state & {id(v.value) for v in frozen.weights + frozen_bn.weights}


@pytest.mark.parametrize("policy", ["local", "average", "reset"])
def test_slot_policy_on_replicas(policy):
    x, y = classification_data()
    model, optimizer = compiled_model(mirrored(4), interval=2, optimizer_state=policy)
    slots = internals.slot_variables(optimizer)
    assert slots
    recorder = Recorder(slots)
    fit(model, x, y, recorder)
    after_averages = recorder.snapshots[1::2]
    if policy == "local":
        assert min(recorder.spreads[1::2]) > 0
    elif policy == "average":
        assert max(recorder.spreads[1::2]) == 0
    else:
        assert all(
            not np.any(c) for snapshot in after_averages for s in snapshot for c in s
        )
    assert min(recorder.spreads[0::2]) > 0


@pytest.mark.parametrize(
    "inner, starts",
    [
        # Adagrad's accumulators start from initial_accumulator_value.
        (
            lambda: keras.optimizers.Adagrad(0.1, initial_accumulator_value=0.3),
            {np.float32(0.3)},
        ),
        # Nadam's momentum schedule starts from 1, its moments from 0.
        (lambda: keras.optimizers.Nadam(0.01), {0.0, 1.0}),
    ],
    ids=["adagrad", "nadam"],
)
def test_reset_puts_the_state_back_where_it_started(inner, starts):
    x, y = classification_data()
    keras.utils.set_random_seed(0)
    strategy = mirrored(2)
    with strategy.scope():
        model = keras.Sequential(
            [keras.Input((D,)), keras.layers.Dense(4), keras.layers.Dense(2)]
        )
        optimizer = keras_skip.SkipCorrectionOptimizer(
            inner(), interval=2, optimizer_state="reset"
        )
        model.compile(
            optimizer=optimizer,
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
    model.fit(
        x,
        y,
        batch_size=32,
        epochs=1,
        shuffle=False,
        verbose=0,
        callbacks=[keras_skip.SkipCorrectionCallback()],
    )
    assert optimizer.local_steps_since_average == 0
    held = {
        float(c)
        for s in internals.slot_variables(optimizer)
        for c in np.ravel(components(s))
    }
    assert held == starts
    assert np.isfinite(model.get_weights()[0]).all()


def test_fit_without_the_callback_on_several_replicas_is_a_clear_error():
    x, y = classification_data()
    strategy = mirrored(2)
    with strategy.scope():
        model = keras.Sequential([keras.Input((D,)), keras.layers.Dense(2)])
        model.compile(
            optimizer=keras_skip.SkipCorrectionOptimizer(keras.optimizers.SGD(0.1)),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
    with pytest.raises(RuntimeError, match="SkipCorrectionCallback"):
        model.fit(x, y, batch_size=32, epochs=1, verbose=0)


def test_one_replica_needs_no_callback():
    x, y = classification_data()
    model = keras.Sequential([keras.Input((D,)), keras.layers.Dense(2)])
    model.compile(
        optimizer=keras_skip.SkipCorrectionOptimizer(keras.optimizers.SGD(0.1)),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    model.fit(x, y, batch_size=32, epochs=1, verbose=0)
    assert model.optimizer.iterations.numpy() == 8
