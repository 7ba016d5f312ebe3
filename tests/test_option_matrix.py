"""Every combination of options keeps the invariants that must always hold.

Hypothesis draws the inner optimizer, interval, correction, slot policy,
outer optimizer, compression, overlap, streaming fragments, group size,
warm-up and `steps_per_execution`, and trains the linear model of
`test_against_reference` on 4 replicas with `model.fit`. For every
combination:

- weights stay finite;
- the replicas hold identical weights right after every full average and at
  every epoch end, seen from a callback listed before
  `SkipCorrectionCallback`;
- the corrections sum to zero over the replicas after every average (with
  compression only up to the rounding of the mean, which the all-reduce
  computes in the 16-bit wire type; there the comparison with the reference
  below, which rounds alike, checks them);
- a weight without a gradient never moves;
- where the NumPy reference (`keras_skip.maths.simulate`) models the
  combination (SGD, momentum or Adam inside, SGD with Nesterov momentum or
  nothing outside), the weights and corrections agree with it.

Hypothesis also draws the model's float type. In float64 the TF path
computes what the reference computes up to float64 round-off (both round a
16-bit payload from the same float64 value, through float32, as TensorFlow's
cast does), so it must agree to 1e-9 with or without compression. In float32
without compression it agrees to 1e-4. In float32 with compression it is not
compared: the TF path's float32 round-off (about 1e-7 of a weight) can put a
payload value on the other side of a 16-bit rounding boundary, which moves
that value by a whole 16-bit unit (2**-8 of it with bfloat16); Adam's
normalisation and the outer step then carry that difference to the end,
and no bound on it would be tighter than the weights themselves. The float64
draws compare the same algebra, rounding decisions included.

A second property trains on one replica, where every drawn combination
without an outer optimizer or compression must be the inner optimizer alone.
"""

import contextlib

import internals
import keras
import numpy as np
import pytest
from conftest import components, max_replica_spread, mirrored
from hypothesis import HealthCheck, Phase, example, given, settings
from hypothesis import strategies as st
from test_against_reference import (
    EPOCHS,
    GLOBAL_BATCH,
    REPLICAS,
    STEPS_PER_EPOCH,
    D,
    assert_relative,
    corrections_of,
    linear_model,
    make_data,
    reference,
    weights_of,
)

import keras_skip
from keras_skip import maths

#: The batch of the one-replica property.
B_ONE = 8

#: Inner optimizers: (Keras, reference or None, learning rate).
INNERS = {
    "sgd": (lambda: keras.optimizers.SGD(0.05), maths.sgd, 0.05),
    "momentum": (
        lambda: keras.optimizers.SGD(0.05, momentum=0.9),
        lambda: maths.sgd(0.9),
        0.05,
    ),
    "adam": (lambda: keras.optimizers.Adam(0.01), maths.adam, 0.01),
    "nadam": (lambda: keras.optimizers.Nadam(0.01), None, 0.01),
    "adagrad": (
        lambda: keras.optimizers.Adagrad(0.1, initial_accumulator_value=0.2),
        None,
        0.1,
    ),
    "rmsprop-centered-clipnorm": (
        lambda: keras.optimizers.RMSprop(0.01, centered=True, clipnorm=0.5),
        None,
        0.01,
    ),
    "adamw-global-clipnorm": (
        lambda: keras.optimizers.AdamW(0.01, weight_decay=0.05, global_clipnorm=1.0),
        None,
        0.01,
    ),
    "lion": (lambda: keras.optimizers.Lion(0.003), None, 0.003),
}

#: Outer optimizers: (Keras or None, reference or None when not modelled).
OUTERS = {
    "none": (None, None),
    "nesterov": (
        lambda: keras.optimizers.SGD(0.7, momentum=0.9, nesterov=True),
        lambda: maths.sgd(0.9, nesterov=True),
    ),
    "adam-clipnorm": (lambda: keras.optimizers.Adam(0.1, clipnorm=0.5), False),
}


class Unused(keras.layers.Layer):
    """Passes its input through; holds a weight that gets no gradient."""

    def build(self, input_shape):
        self.idle = self.add_weight(shape=(2,), initializer="ones", name="idle")

    def call(self, x):
        return x


class Invariants(keras.callbacks.Callback):
    """Listed before SkipCorrectionCallback: checks after every execution
    and at every epoch end."""

    def __init__(self, compression=None):
        super().__init__()
        self.compression = compression

    def _optimizer(self):
        optimizer = self.model.optimizer
        return getattr(optimizer, "inner_optimizer", optimizer)

    def on_train_batch_end(self, batch, logs=None):
        optimizer = self.model.optimizer
        if optimizer.local_steps_since_average:
            return  # apart until the next average
        assert max_replica_spread(self.model.trainable_variables) == 0.0
        # Each average adds scale * (mean - x_i) to c_i, with scale at most
        # correction / lr (a period of one step), and the float32 mean is
        # off the exact one by up to n * eps * |x|: the sum over replicas
        # moves by at most that much per average.
        n = len(components(self.model.trainable_variables[0]))
        lr = float(keras.ops.convert_to_numpy(optimizer.learning_rate))
        per_average = n * np.finfo(np.float32).eps * optimizer.correction / lr
        for variable, correction in zip(
            self.model.trainable_variables,
            internals.corrections(optimizer),
            strict=True,
        ):
            if correction is None or self.compression:
                continue
            copies = np.stack(components(correction))
            scale = np.abs(copies).sum(axis=0).max()
            rounding = (
                optimizer.averages_performed
                * per_average
                * np.abs(components(variable)[0]).max()
            )
            assert np.abs(copies.sum(axis=0)).max() <= 1e-5 * scale + 1e-7 + rounding

    def on_epoch_end(self, epoch, logs=None):
        assert self.model.optimizer.local_steps_since_average == 0
        assert max_replica_spread(self.model.trainable_variables) == 0.0
        for v in self.model.weights:
            assert np.isfinite(components(v)).all(), v.path


@contextlib.contextmanager
def floatx(dtype: str):
    """Keras' default float type and dtype policy for the block, restored
    afterwards."""
    saved = keras.config.floatx(), keras.config.dtype_policy()
    keras.config.set_floatx(dtype)
    keras.config.set_dtype_policy(dtype)
    try:
        yield
    finally:
        keras.config.set_floatx(saved[0])
        keras.config.set_dtype_policy(saved[1])


def train(strategy, make_inner, make_outer, spe, dtype="float32", **skip):
    x, y = make_data()
    with strategy.scope():
        model = linear_model(Unused())
        if make_outer is not None:
            skip["outer_optimizer"] = make_outer()
        optimizer = keras_skip.SkipCorrectionOptimizer(make_inner(), **skip)
        model.compile(optimizer=optimizer, loss="mse", steps_per_execution=spe)
    assert all(v.dtype == dtype for v in model.weights)
    invariants = Invariants(skip.get("compression"))  # checks as it trains
    model.fit(
        x.reshape(-1, D).astype(dtype),
        y.reshape(-1, 1).astype(dtype),
        batch_size=GLOBAL_BATCH,
        epochs=EPOCHS,
        shuffle=False,
        verbose=0,
        callbacks=[invariants, keras_skip.SkipCorrectionCallback()],
    )
    return model, optimizer


options = st.fixed_dictionaries(
    {
        "inner": st.sampled_from(sorted(INNERS)),
        "interval": st.integers(1, 5),
        "correction": st.sampled_from([0.0, 0.5, 1.0]),
        "optimizer_state": st.sampled_from(["local", "average", "reset"]),
        "outer": st.sampled_from(sorted(OUTERS)),
        "compression": st.sampled_from([None, "bfloat16", "float16"]),
        "overlap": st.sampled_from([False, True, 2, 3]),
        "group_size": st.sampled_from([None, 2]),
        "warmup_steps": st.sampled_from([0, 3]),
        "steps_per_execution": st.sampled_from([1, 2, 4]),
        "floatx": st.sampled_from(["float32", "float64"]),
        "fragments": st.sampled_from([1, 2]),
    }
)


BFLOAT16_ADAM_OVERLAP = {
    "inner": "adam",
    "interval": 3,
    "correction": 1.0,
    "optimizer_state": "average",
    "outer": "nesterov",
    "compression": "bfloat16",
    "overlap": True,
    "group_size": None,
    "warmup_steps": 0,
    "steps_per_execution": 2,
}


@pytest.mark.slow
@settings(
    max_examples=8,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
    # Each example trains a model: report a failing one as drawn, unshrunk.
    phases=[Phase.explicit, Phase.reuse, Phase.generate],
)
@given(options)
# An integer overlap that cannot delay (interval 2, two steps per execution)
# averages after the step, as without overlap.
@example(
    {
        "inner": "sgd",
        "interval": 2,
        "correction": 0.5,
        "optimizer_state": "local",
        "outer": "nesterov",
        "compression": None,
        "overlap": 3,
        "group_size": 2,
        "warmup_steps": 3,
        "steps_per_execution": 2,
        "floatx": "float32",
    }
)
# A one-step overlap with bfloat16, Adam, an outer Nesterov step and averaged
# slots: in float32 a payload value lay about 1e-7 from a bfloat16 rounding
# boundary and the reference, then without Keras' float32 Adam betas, rounded
# it the other way (1.12e-3 apart at the end). In float64 the two agree to
# round-off, so the algebra is the reference's.
@example({**BFLOAT16_ADAM_OVERLAP, "floatx": "float32"})
@example({**BFLOAT16_ADAM_OVERLAP, "floatx": "float64"})
# In float64 the corrections were 2.4e-8 off the reference while the
# learning rates' sum was kept in float32.
@example(
    {
        "inner": "momentum",
        "interval": 3,
        "correction": 1.0,
        "optimizer_state": "reset",
        "outer": "nesterov",
        "compression": "float16",
        "overlap": False,
        "group_size": 2,
        "warmup_steps": 0,
        "steps_per_execution": 4,
        "floatx": "float64",
    }
)
# Averaged second moments with every option that changes an average: an
# outer step, float16 payloads, delayed averages, groups and a warm-up.
@example(
    {
        "inner": "adam",
        "interval": 4,
        "correction": 1.0,
        "optimizer_state": "average_second_moments",
        "outer": "nesterov",
        "compression": "float16",
        "overlap": 2,
        "group_size": 2,
        "warmup_steps": 3,
        "steps_per_execution": 1,
        "floatx": "float64",
    }
)
# Streaming averages with every option they combine with: each fragment's
# delayed bfloat16 update, its outer step and its averaged slots.
@example(
    {
        "inner": "adam",
        "interval": 5,
        "correction": 1.0,
        "optimizer_state": "average",
        "outer": "nesterov",
        "compression": "bfloat16",
        "overlap": 2,
        "group_size": 2,
        "warmup_steps": 0,
        "steps_per_execution": 1,
        "floatx": "float64",
        "fragments": 2,
    }
)
def test_every_combination_keeps_the_invariants(drawn):
    drawn = dict(drawn)
    fragments = drawn.get("fragments", 1)
    drawn["fragments"] = fragments
    inner = drawn.pop("inner")
    outer = drawn.pop("outer")
    spe = drawn.pop("steps_per_execution")
    dtype = drawn.pop("floatx")
    make_inner, reference_inner, lr = INNERS[inner]
    make_outer, reference_outer = OUTERS[outer]
    with floatx(dtype):  # the optimizer builds its variables in `fit`
        model, optimizer = train(
            mirrored(REPLICAS), make_inner, make_outer, spe, dtype, **drawn
        )
    assert optimizer.iterations.numpy() == STEPS_PER_EPOCH * EPOCHS
    np.testing.assert_array_equal(components(model.layers[1].idle), np.ones((4, 2)))

    compressed = drawn["compression"] is not None
    if reference_inner is None or reference_outer is False:
        return
    if compressed and dtype == "float32":
        return  # rounding decisions may differ; see the module's docstring
    group_size = drawn.pop("group_size") or 1
    # The reference's coordinates: the Dense layer's (the idle weight, last,
    # has none there).
    drawn["fragments"] = [part[part <= D] for part in internals.fragments(optimizer)]
    expected = reference(
        reference_inner(),
        learning_rate=lr,
        outer=None if reference_outer is None else reference_outer(),
        outer_learning_rate=0.7,
        group_size=group_size,
        steps_per_execution=spe,
        **drawn,
    )
    assert optimizer.averages_performed == expected.averages
    exact = dtype == "float64"
    assert_relative(weights_of(model), expected.x, tolerance=1e-9 if exact else 1e-4)
    if drawn["correction"]:
        assert_relative(
            corrections_of(optimizer),
            expected.correction,
            tolerance=1e-9 if exact else 1e-3,
        )


@settings(
    max_examples=6,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
    # Each example trains a model: report a failing one as drawn, unshrunk.
    phases=[Phase.explicit, Phase.reuse, Phase.generate],
)
@given(
    st.sampled_from(sorted(INNERS)),
    st.integers(1, 5),
    st.sampled_from([0.0, 1.0]),
    st.sampled_from(["local", "average", "reset"]),
    st.booleans(),
    st.sampled_from([0, 3]),
    st.sampled_from([1, 3]),
)
def test_one_replica_is_the_inner_optimizer_alone(
    inner, interval, correction, policy, overlap, warmup, spe
):
    make_inner, _, _ = INNERS[inner]
    x, y = make_data()
    xs, ys = x.reshape(-1, D).astype("float32"), y.reshape(-1, 1).astype("float32")
    results = []
    for wrap in (False, True):
        model = linear_model()
        optimizer = make_inner()
        if wrap:
            optimizer = keras_skip.SkipCorrectionOptimizer(
                optimizer,
                interval=interval,
                correction=correction,
                optimizer_state=policy,
                overlap=overlap,
                warmup_steps=warmup,
            )
        model.compile(optimizer=optimizer, loss="mse", steps_per_execution=spe)
        model.fit(xs, ys, batch_size=B_ONE, epochs=EPOCHS, shuffle=False, verbose=0)
        results.append(model.get_weights())
    for stock, wrapped in zip(*results, strict=True):
        np.testing.assert_allclose(wrapped, stock, rtol=1e-6, atol=1e-7)
