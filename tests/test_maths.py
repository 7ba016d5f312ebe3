"""Property tests of the reference maths: invariants 1-9 of docs/algorithm.md."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from keras_skip import maths

finite = st.floats(-10, 10, allow_nan=False, width=64)
replicas = st.integers(1, 6)
intervals = st.integers(1, 12)
betas = st.sampled_from([0.0, 0.25, 0.5, 1.0]) | st.floats(0, 1)
rates = st.floats(0.001, 0.2)


@st.composite
def problems(draw, min_n=1, min_steps=1):
    """Per-replica gradient sequences for a small problem: g[t, i] is replica
    i's gradient at step t, independent of the weights (a linear loss)."""
    n = draw(st.integers(min_n, 6))
    dim = draw(st.integers(1, 4))
    steps = draw(st.integers(min_steps, 30))
    grads = draw(hnp.arrays(np.float64, (steps, n, dim), elements=finite))
    x0 = draw(hnp.arrays(np.float64, (dim,), elements=finite))
    return n, dim, steps, grads, x0


def fixed_grads(grads):
    return lambda t, x: grads[t]


def quadratic_grads(a, A):
    """f_i(x) = 1/2 (x - a_i)^T diag(A_i) (x - a_i), full gradients."""
    return lambda t, x: A * (x - a)


# Invariant 1 ----------------------------------------------------------------


@given(problems(), betas, rates)
def test_interval_1_local_equations_equal_synchronous_sgd(problem, beta, lr):
    """With H = 1, the local step + average equations are synchronous SGD,
    for any beta (this is why SGD needs no special case; Adam does)."""
    n, dim, steps, grads, x0 = problem
    x = np.broadcast_to(x0, (n, dim)).copy()
    c = np.zeros_like(x)
    for t in range(steps):
        x = maths.local_step(x, -lr * grads[t], c, lr)
        x, c = maths.average(x, c, lr, beta)
    expected = maths.synchronous(
        x0, fixed_grads(grads), n=n, steps=steps, learning_rate=lr
    )
    np.testing.assert_allclose(x, np.broadcast_to(expected, x.shape), atol=1e-9)


@given(problems(), betas, rates, st.sampled_from(["sgd", "momentum", "adam"]))
def test_interval_1_is_synchronous_for_every_inner_optimizer(problem, beta, lr, kind):
    n, _dim, steps, grads, x0 = problem
    inner = {"sgd": maths.sgd(), "momentum": maths.sgd(0.9), "adam": maths.adam()}[kind]
    result = maths.simulate(
        x0,
        fixed_grads(grads),
        n=n,
        steps=steps,
        learning_rate=lr,
        interval=1,
        correction=beta,
        inner=inner,
    )
    inner = {"sgd": maths.sgd(), "momentum": maths.sgd(0.9), "adam": maths.adam()}[kind]
    expected = maths.synchronous(
        x0, fixed_grads(grads), n=n, steps=steps, learning_rate=lr, inner=inner
    )
    np.testing.assert_allclose(
        result.x, np.broadcast_to(expected, result.x.shape), atol=1e-9
    )
    assert result.averages == 0


# Invariants 2 and 3 -----------------------------------------------------------


@given(
    problems(min_n=2),
    intervals,
    betas,
    rates,
    st.sampled_from(["sgd", "momentum", "adam"]),
    st.booleans(),
)
def test_after_every_average_corrections_sum_to_zero_and_replicas_agree(
    problem, interval, beta, lr, kind, overlap
):
    """Also with overlapped averages, after which the replicas differ by
    their last step (see test_overlap.py)."""
    n, _dim, steps, grads, x0 = problem
    inner = {"sgd": maths.sgd(), "momentum": maths.sgd(0.9), "adam": maths.adam()}[kind]
    seen = []

    def grad_fn(t, x):
        seen.append(x.copy())
        return grads[t]

    result = maths.simulate(
        x0,
        grad_fn,
        n=n,
        steps=steps,
        learning_rate=lr,
        interval=interval,
        correction=beta,
        inner=inner,
        overlap=overlap,
    )
    averaged_after = [t for t in range(steps) if (t + 1) % interval == 0]
    if overlap and interval > 1:
        averaged_after = []  # each replica keeps its last step (test_overlap.py)
    for t in averaged_after:
        x = result.history[t]
        np.testing.assert_allclose(x, np.broadcast_to(x[:1], x.shape), atol=1e-12)
    scale = 1 + np.abs(result.correction).max()
    np.testing.assert_allclose(result.correction.sum(axis=0), 0, atol=1e-9 * scale)


def test_average_makes_replicas_identical_and_keeps_their_mean():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(4, 3))
    c = rng.normal(size=(4, 3))
    c -= c.mean(axis=0)
    x_new, c_new = maths.average(x, c, gamma=0.3, beta=1.0)
    np.testing.assert_allclose(x_new, np.broadcast_to(x.mean(0), x.shape))
    np.testing.assert_allclose(c_new, c + (x.mean(0) - x) / 0.3)
    np.testing.assert_allclose(c_new.sum(0), 0, atol=1e-12)


def test_average_without_local_steps_leaves_the_correction_alone():
    x = np.ones((3, 2))
    c = np.arange(6.0).reshape(3, 2)
    _, c_new = maths.average(x, c, gamma=0.0, beta=1.0)
    np.testing.assert_array_equal(c_new, c)


# Invariant 4 -----------------------------------------------------------------


@given(problems(), intervals, rates)
def test_beta_0_keeps_corrections_zero_and_is_plain_local_sgd(problem, interval, lr):
    n, dim, steps, grads, x0 = problem
    result = maths.simulate(
        x0,
        fixed_grads(grads),
        n=n,
        steps=steps,
        learning_rate=lr,
        interval=interval,
        correction=0.0,
    )
    assert not result.correction.any()
    # Plain local SGD, written out independently.
    x = np.broadcast_to(x0, (n, dim)).copy()
    for t in range(steps):
        x = x - lr * grads[t]
        if interval > 1 and (t + 1) % interval == 0:
            x = np.broadcast_to(x.mean(0), x.shape).copy()
        if interval == 1:
            x = np.broadcast_to(x.mean(0), x.shape).copy()
    np.testing.assert_allclose(result.x, x, atol=1e-9)


# Invariant 5 -----------------------------------------------------------------


@given(problems(min_n=2, min_steps=2), st.data(), rates)
def test_correction_is_the_period_mean_gradient_deviation(problem, data, lr):
    n, _dim, steps, grads, x0 = problem
    interval = data.draw(st.integers(2, min(10, steps)))
    result = maths.simulate(
        x0,
        fixed_grads(grads),
        n=n,
        steps=interval,
        learning_rate=lr,
        interval=interval,
        correction=1.0,
    )
    period = grads[:interval]
    expected = (period - period.mean(axis=1, keepdims=True)).mean(axis=0)
    np.testing.assert_allclose(result.correction, expected, atol=1e-8)


@given(problems(min_n=2, min_steps=4), st.data(), rates)
def test_correction_formula_holds_in_every_period_not_only_the_first(problem, data, lr):
    n, _dim, steps, grads, x0 = problem
    interval = data.draw(st.integers(2, min(6, steps // 2)))
    periods = steps // interval
    result = maths.simulate(
        x0,
        fixed_grads(grads),
        n=n,
        steps=periods * interval,
        learning_rate=lr,
        interval=interval,
        correction=1.0,
    )
    last = grads[(periods - 1) * interval : periods * interval]
    expected = (last - last.mean(axis=1, keepdims=True)).mean(axis=0)
    np.testing.assert_allclose(result.correction, expected, atol=1e-7)


# Invariant 6 -----------------------------------------------------------------


@given(
    st.integers(1, 5),
    st.integers(1, 3),
    st.integers(1, 25),
    intervals,
    betas,
    rates,
    st.sampled_from(["sgd", "momentum", "adam"]),
    st.sampled_from(["local", "average", "reset"]),
    st.data(),
)
def test_identical_replicas_stay_identical_and_match_one_replica(
    n, dim, steps, interval, beta, lr, kind, policy, data
):
    grads = data.draw(hnp.arrays(np.float64, (steps, 1, dim), elements=finite))
    x0 = data.draw(hnp.arrays(np.float64, (dim,), elements=finite))

    def make():
        return {"sgd": maths.sgd(), "momentum": maths.sgd(0.9), "adam": maths.adam()}[
            kind
        ]

    same = np.broadcast_to(grads, (steps, n, dim))
    result = maths.simulate(
        x0,
        fixed_grads(same),
        n=n,
        steps=steps,
        learning_rate=lr,
        interval=interval,
        correction=beta,
        inner=make(),
        optimizer_state="local",
    )
    single = maths.synchronous(
        x0, fixed_grads(grads), n=1, steps=steps, learning_rate=lr, inner=make()
    )
    np.testing.assert_allclose(
        result.x, np.broadcast_to(single, result.x.shape), atol=1e-9
    )
    np.testing.assert_allclose(result.correction, 0, atol=1e-9)
    one = maths.simulate(
        x0,
        fixed_grads(grads),
        n=1,
        steps=steps,
        learning_rate=lr,
        interval=interval,
        correction=beta,
        inner=make(),
        optimizer_state=policy,
    )
    np.testing.assert_array_equal(one.x[0], single)


# Invariant 7 -----------------------------------------------------------------


@settings(deadline=None, max_examples=40)
@given(
    st.integers(2, 5),
    st.integers(1, 3),
    st.integers(1, 8),
    st.floats(0.02, 0.2),
    st.data(),
)
def test_heterogeneous_quadratics_fixed_point(n, dim, interval, lr, data):
    a = data.draw(hnp.arrays(np.float64, (n, dim), elements=st.floats(-3, 3)))
    A = data.draw(hnp.arrays(np.float64, (n, dim), elements=st.floats(0.5, 2.0)))
    x_star = (A * a).sum(0) / A.sum(0)
    grad = quadratic_grads(a, A)
    # x* with c_i = grad f_i(x*) is a fixed point for any interval and rate.
    x = np.broadcast_to(x_star, (n, dim)).copy()
    c = A * (x_star - a)  # c_i = grad f_i(x*)
    gamma = 0.0
    for t in range(3 * interval):
        x = maths.local_step(x, -lr * grad(t, x), c, lr)
        gamma += lr
        if (t + 1) % interval == 0:
            x, c = maths.average(x, c, gamma, 1.0)
            gamma = 0.0
    np.testing.assert_allclose(x, np.broadcast_to(x_star, x.shape), atol=1e-9)


@settings(deadline=None, max_examples=30)
@given(st.integers(2, 4), st.integers(2, 8), st.floats(0.02, 0.1), st.data())
def test_correction_converges_to_the_optimum_and_local_sgd_stalls_at_a_bias(
    n, interval, lr, data
):
    a = data.draw(hnp.arrays(np.float64, (n, 1), elements=st.floats(-3, 3)))
    A = data.draw(hnp.arrays(np.float64, (n, 1), elements=st.floats(0.5, 2.0)))
    x_star = (A * a).sum(0) / A.sum(0)
    # The fixed point of plain local GD on 1-D quadratics: sum w_i (x - a_i) = 0
    # with w_i = 1 - (1 - lr A_i)^H, which differs from x* when A_i differ.
    w = 1 - (1 - lr * A) ** interval
    x_biased = (w * a).sum(0) / w.sum(0)
    steps = interval * int(np.ceil(4000 / interval))
    kw = dict(n=n, steps=steps, learning_rate=lr, interval=interval)
    corrected = maths.simulate(np.zeros(1), quadratic_grads(a, A), correction=1.0, **kw)
    plain = maths.simulate(np.zeros(1), quadratic_grads(a, A), correction=0.0, **kw)
    np.testing.assert_allclose(corrected.history[-1].mean(0), x_star, atol=1e-6)
    np.testing.assert_allclose(plain.history[-1].mean(0), x_biased, atol=1e-6)


def test_local_sgd_bias_is_real_on_a_concrete_problem():
    a = np.array([[-2.0], [2.0]])
    A = np.array([[0.5], [2.0]])
    kw = dict(n=2, steps=4000, learning_rate=0.1, interval=8)
    plain = maths.simulate(np.zeros(1), quadratic_grads(a, A), correction=0.0, **kw)
    corrected = maths.simulate(np.zeros(1), quadratic_grads(a, A), correction=1.0, **kw)
    x_star = (A * a).sum() / A.sum()
    assert abs(plain.x.mean() - x_star) > 0.1
    assert abs(corrected.x.mean() - x_star) < 1e-6


# Invariant 8 -----------------------------------------------------------------


@given(problems(min_n=2), intervals, betas, rates, st.randoms(use_true_random=False))
def test_permuting_replicas_permutes_corrections(problem, interval, beta, lr, rnd):
    n, _dim, steps, grads, x0 = problem
    perm = list(range(n))
    rnd.shuffle(perm)
    kw = dict(n=n, steps=steps, learning_rate=lr, interval=interval, correction=beta)
    base = maths.simulate(x0, fixed_grads(grads), **kw)
    permuted = maths.simulate(x0, fixed_grads(grads[:, perm]), **kw)
    scale = 1 + np.abs(base.correction).max()
    np.testing.assert_allclose(
        permuted.correction, base.correction[perm], atol=1e-9 * scale
    )
    np.testing.assert_allclose(
        permuted.x.mean(0), base.x.mean(0), atol=1e-9 * (1 + np.abs(base.x).max())
    )


# Invariant 9 -----------------------------------------------------------------


@given(
    st.integers(0, 200),
    intervals,
    st.integers(0, 20),
    st.lists(st.integers(1, 200), max_size=5),
)
def test_number_of_averages(steps, interval, warmup, boundaries):
    result = maths.simulate(
        np.zeros(1),
        lambda t, x: np.ones_like(x),
        n=2,
        steps=steps,
        learning_rate=0.01,
        interval=interval,
        correction=1.0,
        warmup_steps=warmup,
        boundaries=boundaries,
    )
    if interval == 1:
        assert result.averages == 0
        return
    local = max(0, steps - warmup)
    cuts = sorted({b for b in boundaries if warmup < b <= steps})
    # Counting restarts at every average: each stretch between two boundary
    # averages contributes floor(length / H) interval averages.
    expected_interval, boundary_averages, start = 0, 0, min(warmup, steps)
    for b in [*cuts, steps]:
        length = b - start
        expected_interval += length // interval
        if b in cuts and length % interval:
            boundary_averages += 1
        start = b
    assert result.interval_averages == expected_interval
    assert result.boundary_averages == boundary_averages
    if not boundaries:
        assert result.interval_averages == local // interval


# Slot policies and warm-up ------------------------------------------------------


@given(problems(min_n=2, min_steps=2), st.data(), rates)
def test_slot_policies(problem, data, lr):
    n, dim, steps, grads, x0 = problem
    interval = data.draw(st.integers(2, min(6, steps)))
    steps -= steps % interval
    kw = dict(n=n, steps=steps, learning_rate=lr, interval=interval, correction=1.0)
    avg = maths.simulate(
        x0, fixed_grads(grads), inner=maths.sgd(0.9), optimizer_state="average", **kw
    )
    (m,) = avg.slots
    np.testing.assert_allclose(m, np.broadcast_to(m[:1], m.shape), atol=1e-12)
    reset = maths.simulate(
        x0, fixed_grads(grads), inner=maths.sgd(0.9), optimizer_state="reset", **kw
    )
    assert not reset.slots[0].any()
    local = maths.simulate(
        x0, fixed_grads(grads), inner=maths.sgd(0.9), optimizer_state="local", **kw
    )
    # Each replica's momentum is its own exponential sum of its own gradients
    # (with Keras' float32 momentum).
    mu = float(np.float32(0.9))
    expected = np.zeros((n, dim))
    for t in range(steps):
        expected = mu * expected - lr * grads[t]
    np.testing.assert_allclose(local.slots[0], expected, atol=1e-9)


@given(problems(min_n=2), st.integers(2, 8), st.data(), rates)
def test_warmup_steps_are_synchronous(problem, interval, data, lr):
    n, dim, steps, grads, x0 = problem
    warmup = data.draw(st.integers(1, steps))
    result = maths.simulate(
        x0,
        fixed_grads(grads),
        n=n,
        steps=steps,
        learning_rate=lr,
        interval=interval,
        correction=1.0,
        warmup_steps=warmup,
    )
    expected = maths.synchronous(
        x0, fixed_grads(grads), n=n, steps=warmup, learning_rate=lr
    )
    after_warmup = result.history[warmup - 1]
    np.testing.assert_allclose(
        after_warmup, np.broadcast_to(expected, (n, dim)), atol=1e-9
    )


@given(problems(min_n=2, min_steps=2), st.integers(2, 8), st.data(), rates)
def test_going_back_to_interval_1_averages_weights_and_slots_first(
    problem, interval, data, lr
):
    """A pending local period is closed (weights and slots averaged) before a
    synchronous step, or the replicas would stay apart for ever."""
    n, _dim, steps, grads, x0 = problem
    switch = data.draw(st.integers(1, steps - 1))
    result = maths.simulate(
        x0,
        fixed_grads(grads),
        n=n,
        steps=steps,
        learning_rate=lr,
        interval=lambda t: interval if t < switch else 1,
        correction=1.0,
        inner=maths.sgd(0.9),
    )
    x, (m,) = result.x, result.slots
    np.testing.assert_allclose(x, np.broadcast_to(x[:1], x.shape), atol=1e-9)
    np.testing.assert_allclose(m, np.broadcast_to(m[:1], m.shape), atol=1e-9)


def test_simulate_rejects_unknown_policy():
    with pytest.raises(ValueError, match="optimizer_state"):
        maths.simulate(
            np.zeros(1),
            lambda t, x: x,
            n=1,
            steps=1,
            learning_rate=0.1,
            interval=1,
            correction=0.0,
            optimizer_state="bogus",
        )
