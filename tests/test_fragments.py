"""Streaming averages (`fragments=F`): the reference maths' invariants.

A fragment is a part of the coordinates with an algorithm of its own: its
own period, learning-rate sum, correction, compression error and outer step,
averaged at its own offset in the interval (and, with ``overlap``, delayed
like any average). These properties pin that down on random problems.
"""

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from test_maths import betas, fixed_grads, problems, rates

from keras_skip import maths

INNER = {
    "sgd": maths.sgd,
    "momentum": lambda: maths.sgd(0.9),
    "nesterov": lambda: maths.sgd(0.9, nesterov=True),
    "adam": maths.adam,
}
#: The slot policies of an inner optimizer without second moments.
SGD_POLICIES = tuple(p for p in maths.OPTIMIZER_STATE_POLICIES if "second" not in p)


@st.composite
def partitions(draw, dim: int, count: int) -> list[np.ndarray]:
    """``count`` non-empty fragments of the coordinates ``0..dim-1``, in any
    order (fragments are sets of variables, not necessarily contiguous)."""
    order = draw(st.permutations(range(dim)))
    cuts = sorted(
        draw(st.sets(st.integers(1, dim - 1), min_size=count - 1, max_size=count - 1))
    )
    return [np.array(sorted(p)) for p in np.split(np.array(order), cuts)]


@st.composite
def fragmented(draw, min_n=2, min_steps=2, max_fragments=4):
    """A problem with at least two coordinates, a fragment count and a
    partition of the coordinates."""
    n = draw(st.integers(min_n, 5))
    dim = draw(st.integers(2, 6))
    steps = draw(st.integers(min_steps, 30))
    grads = draw(
        st.lists(
            st.lists(
                st.lists(st.floats(-5, 5), min_size=dim, max_size=dim),
                min_size=n,
                max_size=n,
            ),
            min_size=steps,
            max_size=steps,
        )
    )
    x0 = np.array(draw(st.lists(st.floats(-5, 5), min_size=dim, max_size=dim)))
    count = draw(st.integers(1, min(dim, max_fragments)))
    return n, dim, steps, np.array(grads, np.float64), x0, draw(partitions(dim, count))


def test_offsets_spread_the_fragments_over_the_interval():
    assert maths.fragment_offsets(32, 4) == (8, 16, 24, 32)
    assert maths.fragment_offsets(10, 3) == (3, 6, 10)
    assert maths.fragment_offsets(5, 1) == (5,)
    with pytest.raises(
        ValueError, match=r"`fragments` must be at most the interval \(2\)"
    ):
        maths.fragment_offsets(2, 3)
    with pytest.raises(ValueError, match=r"fragments=0"):
        maths.fragment_offsets(8, 0)


def test_fragments_that_do_not_partition_the_coordinates_are_refused():
    grads = fixed_grads(np.zeros((3, 2, 4)))
    kwargs = dict(n=2, steps=3, learning_rate=0.1, interval=2, correction=1.0)
    with pytest.raises(ValueError, match=r"partition the coordinates 0\.\.3"):
        maths.simulate(np.zeros(4), grads, fragments=[[0, 1], [1, 2, 3]], **kwargs)
    with pytest.raises(ValueError, match=r"`fragments` must be an integer in \[1, 4\]"):
        maths.simulate(np.zeros(4), grads, fragments=5, **kwargs)
    with pytest.raises(ValueError, match="at most the interval"):
        maths.simulate(np.zeros(4), grads, fragments=3, **kwargs)


@settings(deadline=None, max_examples=60)
@given(
    fragmented(),
    st.integers(2, 5),
    betas,
    st.sampled_from(sorted(INNER)),
    st.sampled_from(maths.OPTIMIZER_STATE_POLICIES),
    st.sampled_from([None, "bfloat16", "float16"]),
    st.booleans(),
    st.booleans(),
    st.integers(0, 3),
)
def test_each_fragment_is_the_plain_algorithm_on_its_coordinates(
    problem, per_fragment, beta, inner, policy, compression, outer, overlap, warmup
):
    """Every update is per coordinate (the inner and outer optimizers,
    compression, the correction), so fragment ``j`` of a fragmented run is
    exactly the unfragmented algorithm on fragment ``j``'s coordinates alone
    whose first interval after the warm-up is fragment ``j``'s offset. With
    one fragment this is the unfragmented algorithm itself."""
    assume(policy != "average_second_moments" or INNER[inner]().second_moments)
    n, _dim, steps, grads, x0, parts = problem
    interval = per_fragment * len(parts)  # offsets of at least 2 steps
    offsets = maths.fragment_offsets(interval, len(parts))
    common = dict(
        n=n,
        steps=steps,
        learning_rate=lambda t: 0.05 / (1 + 0.1 * t),
        correction=beta,
        optimizer_state=policy,
        compression=compression,
        warmup_steps=warmup,
        outer_learning_rate=0.7,
        overlap=overlap,
    )

    def make(**kwargs):
        kwargs = {**common, **kwargs}
        kwargs["inner"] = INNER[inner]()
        kwargs["outer"] = maths.sgd(0.9, nesterov=True) if outer else None
        return kwargs

    whole = maths.simulate(
        x0, fixed_grads(grads), interval=interval, fragments=parts, **make()
    )
    averages = 0
    for j, part in enumerate(parts):
        alone = maths.simulate(
            x0[part],
            fixed_grads(grads[:, :, part]),
            interval=lambda t, j=j: offsets[j] if t < warmup + offsets[j] else interval,
            **make(),
        )
        np.testing.assert_array_equal(whole.x[:, part], alone.x)
        np.testing.assert_array_equal(whole.correction[:, part], alone.correction)
        for mine, its in zip(whole.slots, alone.slots, strict=True):
            np.testing.assert_array_equal(mine[:, part], its)
        assert whole.fragment_local_steps[j] == alone.local_steps
        averages += alone.interval_averages
    assert whole.interval_averages == averages


@settings(deadline=None, max_examples=60)
@given(
    fragmented(),
    st.integers(1, 4),
    st.sampled_from([False, True, 2, 3, 5]),
    st.integers(1, 3),
    st.sets(st.integers(1, 30), max_size=4),
    rates,
)
def test_with_a_shared_curvature_the_mean_is_synchronous_sgd(
    problem, per_fragment, overlap, steps_per_execution, boundaries, lr
):
    """Replicas minimise quadratics with the same curvature and their own
    optimum. Fragmented, overlapped or delayed averages leave the replicas'
    mean where the steps put it and the corrections sum to zero over the
    replicas, so the mean follows synchronous SGD step by step, as it does
    without fragments."""
    n, dim, steps, _grads, x0, parts = problem
    rng = np.random.default_rng(steps * 7 + dim)
    curvature = rng.uniform(0.5, 2.0, size=dim)
    optima = rng.normal(size=(n, dim))

    def grads(t, x):
        return curvature * (x - optima)

    result = maths.simulate(
        x0,
        grads,
        n=n,
        steps=steps,
        learning_rate=lr,
        interval=per_fragment * len(parts) + 1,
        correction=1.0,
        overlap=overlap,
        steps_per_execution=steps_per_execution,
        boundaries=boundaries,
        fragments=parts,
    )
    np.testing.assert_allclose(result.correction.sum(0), 0.0, atol=1e-9)
    expected = maths.synchronous(
        x0, lambda t, x: grads(t, x), n=n, steps=steps, learning_rate=lr
    )
    np.testing.assert_allclose(result.x.mean(0), expected, rtol=1e-8, atol=1e-8)


@settings(deadline=None, max_examples=60)
@given(
    fragmented(min_steps=4),
    st.integers(1, 4),
    st.sampled_from([True, 2, 3, 6]),
    st.integers(1, 3),
    st.sampled_from(SGD_POLICIES),
    st.data(),
)
def test_an_average_changes_only_its_own_fragment(
    problem, per_fragment, overlap, steps_per_execution, policy, data
):
    """Replicas start apart and take no steps of their own (zero gradients,
    no correction), so weights change only where an average lands: each
    fragment's coordinates keep their start until its first average lands,
    then hold the mean of that start, whatever the other fragments do."""
    n, dim, steps, _grads, _x0, parts = problem
    x_init = np.array(
        data.draw(
            st.lists(
                st.lists(st.floats(-5, 5), min_size=dim, max_size=dim),
                min_size=n,
                max_size=n,
            )
        )
    )
    interval = per_fragment * len(parts) + 1
    result = maths.simulate(
        np.zeros(dim),
        fixed_grads(np.zeros((steps, n, dim))),
        n=n,
        steps=steps,
        learning_rate=0.1,
        interval=interval,
        correction=0.0,
        inner=maths.sgd(0.9),
        optimizer_state=policy,
        x_init=x_init,
        overlap=overlap,
        steps_per_execution=steps_per_execution,
        boundaries=[steps],
        fragments=parts,
    )
    mean = np.broadcast_to(x_init.mean(0), x_init.shape)
    for part in parts:
        path = [h[:, part] for h in result.history]
        landed = [np.array_equal(x, mean[:, part]) for x in path]
        first = landed.index(True)  # the boundary at the end lands them all
        assert all(landed[first:])
        for x in path[:first]:
            np.testing.assert_array_equal(x, x_init[:, part])


@settings(deadline=None, max_examples=60)
@given(
    fragmented(min_steps=4),
    st.integers(1, 4),
    st.sampled_from([False, True, 2, 3, 6]),
    st.integers(1, 3),
    st.sampled_from(maths.OPTIMIZER_STATE_POLICIES),
    st.sampled_from([None, "bfloat16"]),
    st.booleans(),
    st.sets(st.integers(1, 30), max_size=3),
    st.data(),
)
def test_a_fragment_never_sees_the_other_fragments(
    problem,
    per_fragment,
    overlap,
    steps_per_execution,
    policy,
    compression,
    outer,
    boundaries,
    data,
):
    """Changing the gradients of every other coordinate leaves fragment j's
    path unchanged: no average, landing or boundary mixes fragments."""
    n, dim, steps, grads, x0, parts = problem
    j = data.draw(st.integers(0, len(parts) - 1))
    others = np.setdiff1d(np.arange(dim), parts[j])
    changed = grads.copy()
    changed[:, :, others] = np.random.default_rng(steps).normal(
        size=changed[:, :, others].shape
    )
    kwargs = dict(
        n=n,
        steps=steps,
        learning_rate=0.05,
        interval=per_fragment * len(parts) + 1,
        correction=1.0,
        inner=maths.adam(),
        optimizer_state=policy,
        overlap=overlap,
        steps_per_execution=steps_per_execution,
        boundaries=boundaries,
        compression=compression,
        outer=maths.sgd(0.9, nesterov=True) if outer else None,
        fragments=parts,
    )
    first = maths.simulate(x0, fixed_grads(grads), **kwargs)
    second = maths.simulate(x0, fixed_grads(changed), **kwargs)
    for a, b in zip(first.history, second.history, strict=True):
        np.testing.assert_array_equal(a[:, parts[j]], b[:, parts[j]])
    np.testing.assert_array_equal(
        first.correction[:, parts[j]], second.correction[:, parts[j]]
    )


@settings(deadline=None, max_examples=60)
@given(
    fragmented(min_steps=2),
    st.integers(1, 4),
    st.sampled_from([False, True, 2, 4]),
    st.integers(1, 2),
    st.sets(st.integers(1, 30), max_size=5),
    st.sampled_from(SGD_POLICIES),
)
def test_fragmented_boundaries_leave_the_replicas_identical(
    problem, per_fragment, overlap, steps_per_execution, boundaries, policy
):
    """Whatever is in flight, an epoch boundary averages every fragment."""
    n, _dim, steps, grads, x0, parts = problem
    result = maths.simulate(
        x0,
        fixed_grads(grads),
        n=n,
        steps=steps,
        learning_rate=0.05,
        interval=per_fragment * len(parts) + 1,
        correction=1.0,
        inner=maths.sgd(0.9),
        optimizer_state=policy,
        overlap=overlap,
        steps_per_execution=steps_per_execution,
        boundaries=boundaries,
        fragments=parts,
    )
    for t in boundaries:
        if t <= steps:
            x = result.history[t - 1]
            np.testing.assert_allclose(x, np.broadcast_to(x[:1], x.shape), atol=1e-9)


@settings(deadline=None, max_examples=40)
@given(
    problems(min_steps=2),
    st.integers(1, 3),
    st.sampled_from([False, 2, 3]),
    betas,
    rates,
)
def test_fragmented_identical_replicas_are_one_replica(
    problem, per_fragment, overlap, beta, lr
):
    _n, dim, steps, grads, x0 = problem
    same = [grads[t][:1].repeat(3, axis=0) for t in range(steps)]
    count = min(dim, 2)
    kwargs = dict(steps=steps, learning_rate=lr, interval=per_fragment * count + 1)
    fragmented_run = maths.simulate(
        x0,
        fixed_grads(same),
        n=3,
        correction=beta,
        overlap=overlap,
        fragments=count,
        **kwargs,
    )
    one = maths.simulate(
        x0, fixed_grads([g[:1] for g in same]), n=1, correction=beta, **kwargs
    )
    np.testing.assert_allclose(
        fragmented_run.x, np.broadcast_to(one.x, fragmented_run.x.shape), atol=1e-9
    )
    np.testing.assert_allclose(fragmented_run.correction, 0.0, atol=1e-9)


def test_fragments_average_in_turn_and_a_delayed_fragment_lands_alone():
    """Interval 4, 2 fragments (coordinates 0 and 1), delay 2, 12 steps:
    fragment 0 is due after steps 2, 6 and 10 (1-based), fragment 1 after
    steps 4, 8 and 12; each mean lands 2 steps after its snapshot, touching
    its own coordinate only."""
    rng = np.random.default_rng(0)
    grads = rng.normal(size=(12, 3, 2))
    kwargs = dict(
        n=3, steps=12, learning_rate=0.1, interval=4, correction=0.0, fragments=2
    )
    plain = maths.simulate(np.zeros(2), fixed_grads(grads), **kwargs)
    assert plain.interval_averages == 6
    for t, coordinate in [(1, 0), (3, 1), (5, 0), (7, 1), (9, 0), (11, 1)]:
        x = plain.history[t]
        assert np.ptp(x[:, coordinate]) == 0  # averaged after this step
        assert np.ptp(x[:, 1 - coordinate]) > 1e-3  # the other still apart
    delayed = maths.simulate(np.zeros(2), fixed_grads(grads), overlap=2, **kwargs)
    assert delayed.interval_averages == 6
    # Fragment 0's snapshot after step 2 travels beside step 3 and lands
    # before step 4, after which fragment 1 is due: one in flight at a time.
    own = -0.1 * np.cumsum(grads, axis=0)  # each replica's own steps alone
    snapshot = own[1][:, 0]
    landed = snapshot.mean() + (own[3][:, 0] - snapshot)
    np.testing.assert_allclose(delayed.history[3][:, 0], landed)
    np.testing.assert_allclose(delayed.history[3][:, 1], own[3][:, 1])  # untouched
    assert np.abs(delayed.x - plain.x).max() > 1e-3


def test_a_fragment_in_flight_lands_before_the_interval_turns_synchronous():
    """Interval 8, 2 fragments, delay 4: fragment 0's snapshot after step 4
    is on its way when the interval becomes 1 (as `interval = 1` between two
    executions sets it). The run goes on (the landing test once computed
    the fragments' offsets at interval 1 and raised), and the synchronous
    step 6 averages everything first: from then on the replicas agree."""
    rng = np.random.default_rng(1)
    grads = rng.normal(size=(8, 3, 2))
    result = maths.simulate(
        np.zeros(2),
        fixed_grads(grads),
        n=3,
        steps=8,
        learning_rate=0.1,
        interval=lambda t: 8 if t < 5 else 1,
        correction=1.0,
        overlap=4,
        fragments=2,
    )
    assert np.ptp(result.history[4], axis=0).min() > 1e-3  # step 5: apart
    assert result.interval_averages == 1 and result.boundary_averages == 1
    for x in result.history[5:]:
        assert np.ptp(x, axis=0).max() == 0
