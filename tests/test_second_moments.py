"""`optimizer_state="average_second_moments"`: every average averages the
inner optimizer's second moments (the preconditioner) and keeps its other
slots local. The reference maths' properties, a heterogeneous quadratic on
which the policy carries the gain of averaging every slot, and `model.fit`
on several replicas against the reference."""

import json

import keras
import numpy as np
import pytest
from conftest import mirrored
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from test_against_reference import (
    REPLICAS,
    assert_relative,
    corrections_of,
    train_keras,
    weights_of,
)
from test_against_reference import reference as reference_run
from test_maths import betas, fixed_grads, problems, rates

import keras_skip
from keras_skip import maths
from keras_skip.bench.efficiency import preconditioner

POLICY = "average_second_moments"


def simulate(problem, **kwargs):
    n, _dim, steps, grads, x0 = problem
    return maths.simulate(x0, fixed_grads(grads), n=n, steps=steps, **kwargs)


# The reference maths ------------------------------------------------------------


@settings(deadline=None)
@given(problems(min_n=2), st.integers(2, 8), betas, rates)
def test_after_an_average_the_second_moments_agree_and_the_first_do_not_move(
    problem, interval, beta, lr
):
    """Right after an interval average (the last of a run) the second
    moments agree across replicas. After the first, they are the mean of
    those of a run that keeps them local (the same path up to that average),
    and the first moments are each replica's own, untouched."""
    n, dim, steps, grads, x0 = problem
    assume(steps >= interval)
    common = dict(learning_rate=lr, interval=interval, correction=beta)
    run = simulate(
        (n, dim, steps - steps % interval, grads, x0),
        inner=maths.adam(),
        optimizer_state=POLICY,
        **common,
    )
    v = run.slots[1]
    np.testing.assert_array_equal(v, np.broadcast_to(v[:1], v.shape))
    first = (n, dim, interval, grads, x0)
    shared = simulate(first, inner=maths.adam(), optimizer_state=POLICY, **common)
    local = simulate(first, inner=maths.adam(), optimizer_state="local", **common)
    np.testing.assert_array_equal(shared.slots[0], local.slots[0])
    np.testing.assert_allclose(
        shared.slots[1][0], local.slots[1].mean(0), rtol=1e-12, atol=0
    )


@settings(deadline=None)
@given(problems(min_n=2), st.integers(2, 8), betas, rates, st.booleans())
def test_without_a_first_moment_it_is_the_average_policy(
    problem, interval, beta, lr, overlap
):
    """With beta_1 = 0 Adam's first moment is the last gradient, whatever it
    held: averaging it changes nothing, so the policy is ``"average"``."""
    common = dict(learning_rate=lr, interval=interval, correction=beta, overlap=overlap)
    run = simulate(
        problem, inner=maths.adam(beta_1=0.0), optimizer_state=POLICY, **common
    )
    every = simulate(
        problem, inner=maths.adam(beta_1=0.0), optimizer_state="average", **common
    )
    np.testing.assert_allclose(run.x, every.x, rtol=1e-9, atol=1e-9)
    np.testing.assert_allclose(run.correction, every.correction, rtol=1e-9, atol=1e-6)


@settings(deadline=None)
@given(
    problems(min_n=2),
    st.integers(2, 8),
    betas,
    rates,
    st.sampled_from([False, True, 3]),
)
def test_corrections_still_sum_to_zero(problem, interval, beta, lr, overlap):
    result = simulate(
        problem,
        learning_rate=lr,
        interval=interval,
        correction=beta,
        inner=maths.adam(),
        optimizer_state=POLICY,
        overlap=overlap,
    )
    scale = max(1.0, np.abs(result.correction).max())
    np.testing.assert_allclose(result.correction.sum(0), 0, atol=1e-9 * scale)


def test_an_inner_optimizer_without_second_moments_is_refused():
    with pytest.raises(ValueError, match="needs an inner optimizer with second"):
        maths.simulate(
            np.zeros(2),
            lambda t, x: np.ones_like(x),
            n=2,
            steps=2,
            learning_rate=0.1,
            interval=2,
            correction=1.0,
            inner=maths.sgd(0.9),
            optimizer_state=POLICY,
        )


def test_on_skewed_shards_second_moments_carry_the_gain_of_averaging_every_slot():
    """Adam on 8 replicas with far-apart optima, interval 128 (the
    benchmark's problem, 3 seeds): with each replica's own second moments
    the correction does worse than plain local SGD; averaging the second
    moments alone does as well as averaging every slot, several times better
    than local SGD, and averaging the first moments alone does not."""
    rows = preconditioner.measure(range(3))
    gap = {name: row["median_gap"] for name, row in rows.items()}
    local_sgd = gap["local SGD"]
    assert gap["skip+correction"] > local_sgd
    assert gap["skip+correction, second moments averaged"] < local_sgd / 10
    assert gap["skip+correction, slots averaged"] < local_sgd / 10
    assert (
        gap["skip+correction, second moments averaged"]
        < 1.1 * gap["skip+correction, slots averaged"]
    )
    assert gap["skip+correction, first moments averaged"] > local_sgd / 2
    # The correction still helps once the scales are shared.
    second = gap["skip+correction, second moments averaged"]
    assert second < gap["local SGD, second moments averaged"]
    # With an outer Nesterov step, DiLoCo's momentum 0.9 turns the
    # correction's gain into a loss; momentum 0.5 keeps it.
    assert gap["second moments averaged, correction, outer momentum 0.9"] > second
    assert (
        gap["second moments averaged, correction, outer momentum 0.9"]
        > gap["DiLoCo, second moments averaged"]
    )
    assert gap["second moments averaged, correction, outer momentum 0.5"] < second


def test_the_benchmark_writes_its_table_and_json(tmp_path, capsys):
    out = tmp_path / "p.json"
    assert preconditioner.main(["--seeds", "1", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "| skip+correction, second moments averaged |" in printed
    written = json.loads(out.read_text())
    assert written["settings"]["seeds"] == 1
    assert set(written["variants"]) == set(preconditioner.VARIANTS)
    assert preconditioner.main(["--seeds", "0"]) == 2
    assert "--seeds must be >= 1, got 0" in capsys.readouterr().err


# model.fit against the reference ---------------------------------------------------


@pytest.mark.parametrize(
    ("inner", "share"),
    [
        ("adam", 0.5),  # velocities: 1 of its 2 slots
        ("rmsprop", 0.5),  # velocities; its momentum stays local
        ("adagrad", 1.0),  # accumulators: its only slot
    ],
)
def test_fit_averages_the_second_moments_only(inner, share):
    """4 replicas, interval 4: Adam equals the reference; every optimizer
    sends the share of its slots that are second moments, and its path
    differs from keeping the slots local."""
    make_keras = {
        "adam": lambda: keras.optimizers.Adam(0.05),
        "rmsprop": lambda: keras.optimizers.RMSprop(0.05, momentum=0.5),
        "adagrad": lambda: keras.optimizers.Adagrad(0.05),
    }[inner]
    skip = dict(interval=4, correction=1.0)
    runs = {
        policy: train_keras(
            mirrored(REPLICAS), make_keras, optimizer_state=policy, **skip
        )
        for policy in (POLICY, "average", "local")
    }
    model, optimizer = runs[POLICY]
    if inner == "adam":
        expected = reference_run(maths.adam(), optimizer_state=POLICY, **skip)
        assert_relative(weights_of(model), expected.x, tolerance=1e-5)
        assert_relative(corrections_of(optimizer), expected.correction, tolerance=1e-4)
        assert optimizer.averages_performed == expected.averages
    sent = {policy: o.bytes_sent for policy, (_, o) in runs.items()}
    assert sent[POLICY] - sent["local"] == share * (sent["average"] - sent["local"])
    local, _ = runs["local"]
    assert np.abs(weights_of(model) - weights_of(local)).max() > 1e-6
    every, _ = runs["average"]
    if share == 1.0:
        np.testing.assert_array_equal(weights_of(model), weights_of(every))
    else:
        assert np.abs(weights_of(model) - weights_of(every)).max() > 1e-6


@pytest.mark.parametrize(
    ("overlap", "steps_per_execution"),
    [(True, 2), (3, 2)],
    ids=["overlapped", "delayed"],
)
def test_fit_with_overlap_matches_the_reference(overlap, steps_per_execution):
    """An overlapped or delayed average lands each replica's own steps on
    top of the mean, second moments included (``maths.overlapped_average``)."""
    skip = dict(interval=3, correction=1.0, overlap=overlap, optimizer_state=POLICY)
    model, optimizer = train_keras(
        mirrored(REPLICAS),
        lambda: keras.optimizers.Adam(0.05),
        steps_per_execution=steps_per_execution,
        **skip,
    )
    expected = reference_run(
        maths.adam(), steps_per_execution=steps_per_execution, **skip
    )
    every = reference_run(
        maths.adam(),
        steps_per_execution=steps_per_execution,
        **{**skip, "optimizer_state": "average"},
    )
    assert np.abs(expected.x - every.x).max() > 1e-3
    assert_relative(weights_of(model), expected.x, tolerance=1e-5)
    assert_relative(corrections_of(optimizer), expected.correction, tolerance=1e-4)


def test_an_inner_optimizer_without_second_moments_is_a_clear_error():
    with mirrored(2).scope():
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
        optimizer = keras_skip.SkipCorrectionOptimizer(
            keras.optimizers.SGD(0.1, momentum=0.9), optimizer_state=POLICY
        )
        with pytest.raises(ValueError, match=r"SGD keeps none.*'average' or 'local'"):
            optimizer.build(model.trainable_variables)
