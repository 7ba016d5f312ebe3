"""The maths of keras-skip as pure NumPy functions: the reference and test oracle.

Every array carries a leading *replica axis*: a model's weights on ``n``
replicas are an array ``x`` of shape ``(n, *shape)``, ``x[i]`` being replica
``i``'s copy. The functions implement the equations of the algorithm page
(``docs/algorithm.md``) and nothing else: no framework, no device, no
communication. :class:`keras_skip.SkipCorrectionOptimizer` implements the same
equations with TensorFlow and is tested against :func:`simulate`.

Example:

>>> import numpy as np
>>> from keras_skip import maths
>>> targets = np.array([[1.0], [3.0]])           # replica i minimises (x - a_i)^2 / 2
>>> result = maths.simulate(
...     np.zeros(1), lambda t, x: x - targets, n=2, steps=400,
...     learning_rate=0.1, interval=4, correction=1.0, inner=maths.sgd())
>>> np.round(result.x, 6)                          # both replicas at the optimum
array([[2.],
       [2.]])
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Callable, Iterable
from fractions import Fraction
from typing import NamedTuple

import numpy as np

OPTIMIZER_STATE_POLICIES = ("local", "average", "average_second_moments", "reset")
COMPRESSIONS = ("bfloat16", "float16")


# ---------------------------------------------------------------------------
# Inner optimizers: Step(x, g), the displacement the wrapped optimizer makes.
# ---------------------------------------------------------------------------


class InnerOptimizer(NamedTuple):
    """A pure inner optimizer, in the style of optax.

    ``init(x)`` returns the slots for weights ``x``; ``step(g, x, slots, lr,
    t)`` returns ``(displacement, new_slots)`` for gradient ``g`` at 0-based
    step ``t``, so that the optimizer moves ``x`` to ``x + displacement``.
    ``slots`` is a tuple of arrays shaped like ``x`` (empty for plain SGD);
    ``second_moments`` gives the indices of those that estimate the squared
    gradient and scale the step (Adam's ``v``): the preconditioner.
    """

    init: Callable[[np.ndarray], tuple[np.ndarray, ...]]
    step: Callable[..., tuple[np.ndarray, tuple[np.ndarray, ...]]]
    second_moments: tuple[int, ...] = ()


def as_keras_casts(value: float) -> float:
    """``value`` as Keras' optimizers use a Python float hyperparameter:
    ``ops.cast(value, variable.dtype)`` makes a float32 tensor of it first, so
    a float64 model steps with the float32 value too."""
    return float(np.float32(value))


def sgd(momentum: float = 0.0, nesterov: bool = False) -> InnerOptimizer:
    """``keras.optimizers.SGD``: ``m <- mu m - lr g``; ``x <- x + m``, with
    ``mu`` rounded to float32 as Keras does (:func:`as_keras_casts`)."""
    mu = as_keras_casts(momentum)

    def init(x):
        return (np.zeros_like(x),) if momentum else ()

    def step(g, x, slots, lr, t):
        if not momentum:
            return -lr * g, slots
        (m,) = slots
        m = mu * m - lr * g
        displacement = mu * m - lr * g if nesterov else m
        return displacement, (m,)

    return InnerOptimizer(init, step)


def adam(
    beta_1: float = 0.9,
    beta_2: float = 0.999,
    epsilon: float = 1e-7,
    weight_decay: float | None = None,
) -> InnerOptimizer:
    """``keras.optimizers.Adam`` (``AdamW`` when ``weight_decay`` is set).

    The bias correction and the decay use ``beta_1``, ``beta_2`` and
    ``weight_decay`` rounded to float32, as Keras does
    (:func:`as_keras_casts`): with the exact betas the first steps would
    differ by a relative 2.4e-7, enough to round a 16-bit payload value
    the other way.
    """
    b1, b2 = as_keras_casts(beta_1), as_keras_casts(beta_2)
    wd = as_keras_casts(weight_decay) if weight_decay else None

    def init(x):
        return (np.zeros_like(x), np.zeros_like(x))

    def step(g, x, slots, lr, t):
        m, v = slots
        decay = -x * wd * lr if wd else 0.0
        x_decayed = x + decay
        alpha = lr * math.sqrt(1 - b2 ** (t + 1)) / (1 - b1 ** (t + 1))
        m = m + (g - m) * (1 - beta_1)
        v = v + (g * g - v) * (1 - beta_2)
        x_new = x_decayed - alpha * m / (np.sqrt(v) + epsilon)
        return x_new - x, (m, v)

    return InnerOptimizer(init, step, second_moments=(1,))


# ---------------------------------------------------------------------------
# The three equations.
# ---------------------------------------------------------------------------


def local_step(
    x: np.ndarray, displacement: np.ndarray, correction: np.ndarray, learning_rate
) -> np.ndarray:
    """One local step: ``x_i <- x_i + Step(x_i, g_i) + lr * c_i``.

    The correction is added in update space, after the inner optimizer, so
    that it works for any inner optimizer. For plain SGD this is
    ``x_i - lr (g_i - c_i)``, the VRL-SGD update.
    """
    return x + displacement + learning_rate * correction


def average(
    x: np.ndarray, correction: np.ndarray, gamma: float, beta: float
) -> tuple[np.ndarray, np.ndarray]:
    """One average with its correction update.

    Returns ``(x_new, c_new)`` where every replica of ``x_new`` holds
    ``x_bar = mean_i x_i`` and ``c_new_i = c_i + beta (x_bar - x_i) / gamma``,
    ``gamma`` being the sum of the learning rates used since the last average.
    With ``gamma == 0`` (no local step since the last average) the correction
    is unchanged.
    """
    x_bar = x.mean(axis=0, keepdims=True)
    if gamma > 0 and beta:
        correction = correction + beta * (x_bar - x) / gamma
    return np.broadcast_to(x_bar, x.shape).copy(), correction


def outer_step(
    x_start: np.ndarray,
    x_bar: np.ndarray,
    outer: InnerOptimizer,
    slots: tuple[np.ndarray, ...],
    learning_rate: float,
    t: int,
) -> tuple[np.ndarray, tuple[np.ndarray, ...]]:
    """The outer optimizer's step at an average (SlowMo, DiLoCo).

    The period's averaged update ``x_start - x_bar`` is a pseudo-gradient for
    the outer optimizer, applied from ``x_start``, the weights every replica
    held when the period began. Returns ``(x_new, new_slots)``. Plain SGD with
    learning rate 1 gives ``x_new = x_bar``: the average without an outer
    optimizer.
    """
    displacement, slots = outer.step(x_start - x_bar, x_start, slots, learning_rate, t)
    return x_start + displacement, slots


def overlapped_average(
    averaged: np.ndarray, now: np.ndarray, snapshot: np.ndarray
) -> np.ndarray:
    """Applies an average that was computed while a local step ran.

    The all-reduce sent ``snapshot``, each replica's value before the step,
    and returned ``averaged`` (the average of the snapshots, after any outer
    step); meanwhile the step moved the replica to ``now``. Each replica
    keeps its own step on top of the average:
    ``x_i <- averaged + (now_i - snapshot_i)``. With no step in between
    (``now == snapshot``) this is the plain average. The replicas then
    differ by their own last displacement only, which the next average
    includes; the mean over replicas is the average of ``now`` when
    ``averaged`` is the exact mean of ``snapshot``.
    """
    return averaged + (now - snapshot)


def quantize(x, dtype: str) -> np.ndarray:
    """``x`` rounded to float32, then to ``dtype`` ("bfloat16" or "float16")
    to nearest with ties to even, as a float64 array: what a payload cast to
    that type carries."""
    x32 = np.asarray(x, np.float32)
    if dtype == "float16":
        return x32.astype(np.float16).astype(np.float64)
    if dtype != "bfloat16":
        raise ValueError(f"unknown dtype {dtype!r}; allowed: {COMPRESSIONS}")
    bits = x32.view(np.uint32).astype(np.uint64)
    bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
    return bits.astype(np.uint32).view(np.float32).astype(np.float64)


def compress_with_feedback(
    update: np.ndarray, error: np.ndarray, dtype: str
) -> tuple[np.ndarray, np.ndarray]:
    """Error feedback: sends ``update + error`` rounded to ``dtype`` and keeps
    what the rounding lost for the next payload. Returns ``(sent, error)``;
    ``sent + error == update + old error``, so over many rounds the sum of
    what was sent trails the sum of the updates by the last error only."""
    corrected = np.asarray(update, np.float64) + error
    sent = quantize(corrected, dtype)
    return sent, corrected - sent


def wire_mean(sent: np.ndarray, dtype: str) -> np.ndarray:
    """The mean over replicas (axis 0) of values in the wire type, computed in
    that type as an all-reduce does: a running sum rounded after each
    addition, then the division, rounded. Keeps the replica axis (size 1)."""
    total = sent[0]
    for value in sent[1:]:
        total = quantize(total + value, dtype)
    return quantize(total / len(sent), dtype)[None]


def drift(x: np.ndarray, x_bar: np.ndarray | None = None) -> float:
    """The replicas' drift ``mean_i ||x_i - x_bar||``, measured at an average.

    ``x`` has the replica axis first; the norm runs over all other axes (the
    whole model as one vector). ``x_bar`` is the average the replicas
    received (default: the exact mean). 0 when the replicas agree.
    """
    x = np.asarray(x, np.float64)
    if x_bar is None:
        x_bar = x.mean(axis=0, keepdims=True)
    deviation = (x - x_bar).reshape(len(x), -1)
    return float(np.linalg.norm(deviation, axis=1).mean())


def is_synchronous_step(step: int, interval: int, warmup_steps: int) -> bool:
    """Whether 0-based optimizer step ``step`` takes the synchronous path.

    Interval 1 and the warm-up steps are ordinary synchronous data-parallel
    steps: gradients are averaged, then one inner step runs on every replica.
    """
    return interval <= 1 or step < warmup_steps


def average_due(local_steps: int, interval: int) -> bool:
    """Whether an interval average follows, ``local_steps`` after the last one."""
    return local_steps >= interval


#: The share of an overlapped average's wire time that the local steps
#: beside it hide, fitted on the committed benchmark runs (worker processes
#: sharing 2 CPU cores, where the all-reduce competes with the steps for the
#: cores; ``docs/planner.md``). Devices whose all-reduce does not compete
#: with their compute likely hide more (not measured here), up to 1.
OVERLAP_SHARE = 0.5


def overlap_window(
    overlap: int, interval: int, fragments: int = 1, steps_per_execution: int = 1
) -> int:
    """The local steps an interval average's all-reduce runs beside.

    ``overlap`` is the optimizer's (0: none, 1: the step it is due after,
    ``k >= 2``: delayed over ``k`` steps). An average runs beside at most
    the steps until the next one falls due, ``interval // fragments``; at
    interval 1 (synchronous steps) nothing overlaps, and a delayed average
    needs an interval longer than ``steps_per_execution``.

    >>> overlap_window(6, interval=16, fragments=2)
    6
    >>> overlap_window(6, interval=8, fragments=2)
    4
    >>> overlap_window(6, interval=4, steps_per_execution=4)
    0
    """
    if overlap <= 0 or interval <= 1:
        return 0
    if overlap >= 2 and interval <= steps_per_execution:
        return 0
    return min(overlap, interval // fragments)


def hidden_communication(
    t_comm: float,
    t_comp: float,
    window: int,
    fragments: int = 1,
    overlap_share: float = OVERLAP_SHARE,
) -> float:
    """Seconds of one interval's communication that overlap hides.

    An interval sends ``fragments`` averages of ``t_comm / fragments`` seconds
    each (``t_comm``: one average of the whole payload); each runs beside
    ``window`` local steps of ``t_comp`` seconds (:func:`overlap_window`),
    which hide ``overlap_share`` of the shorter of the two.

    >>> hidden_communication(t_comm=0.9, t_comp=0.03, window=6, fragments=2)
    0.18
    """
    return fragments * overlap_share * min(t_comm / fragments, window * t_comp)


def adaptive_interval(
    t_comm: float,
    t_comp: float,
    target_ratio: float = 1.0,
    max_interval: int = 64,
    *,
    overlap: int = 0,
    fragments: int = 1,
    steps_per_execution: int = 1,
    overlap_share: float = 0.0,
) -> int:
    """The interval that makes communication time about ``target_ratio`` times
    computation time per epoch: ``clip(round(t_comm / (rho t_comp)), 1, H_max)``.

    Per epoch of ``I`` steps, computation costs ``I t_comp`` and communication
    ``(I / H) t_comm``; this ``H`` makes their ratio close to ``rho``. The
    rounding is exact (on the binary values of the floats, halves rounded up),
    so the result never decreases as ``t_comm`` grows or ``t_comp`` shrinks,
    and scaling both times by a power of two leaves it unchanged.

    With ``overlap`` and ``overlap_share > 0`` only the communication that
    stops the steps counts: ``t_comm`` less :func:`hidden_communication` at
    the :func:`overlap_window` of ``H``. That window grows with ``H`` (up to
    ``overlap``), so the rule is the smallest ``H`` with
    ``H >= round((t_comm - hidden(H)) / (rho t_comp))``, within
    ``[1, H_max]``: never longer than the interval without overlap, and the
    same when nothing is hidden.

    >>> adaptive_interval(t_comm=1.0, t_comp=0.012)
    64
    >>> adaptive_interval(t_comm=0.05, t_comp=0.012)
    4
    >>> adaptive_interval(t_comm=0.001, t_comp=0.012)
    1
    >>> adaptive_interval(t_comm=0.05, t_comp=0.012, overlap=2, overlap_share=0.5)
    3
    """
    for name, value in (("t_comm", t_comm), ("t_comp", t_comp)):
        if not math.isfinite(value) or value < 0:
            raise ValueError(
                f"`{name}` must be a finite time >= 0. Received: {name}={value!r}"
            )
    if t_comp == 0:
        raise ValueError("`t_comp` must be > 0. Received: t_comp=0")
    if not math.isfinite(target_ratio) or target_ratio <= 0:
        raise ValueError(
            f"`target_ratio` must be > 0. Received: target_ratio={target_ratio!r}"
        )
    for name, value, minimum in (
        ("max_interval", max_interval, 1),
        ("overlap", overlap, 0),
        ("fragments", fragments, 1),
        ("steps_per_execution", steps_per_execution, 1),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise ValueError(
                f"`{name}` must be an integer >= {minimum}. Received: {name}={value!r}"
            )
    if (
        isinstance(overlap_share, bool)
        or not isinstance(overlap_share, numbers.Real)
        or not 0 <= overlap_share <= 1
    ):
        raise ValueError(
            "`overlap_share` must be a share of the wire time, in [0, 1]. "
            f"Received: overlap_share={overlap_share!r}"
        )
    scale = Fraction(target_ratio) * Fraction(t_comp)

    def rule(hidden) -> int:
        rounded = math.floor((Fraction(t_comm) - hidden) / scale + Fraction(1, 2))
        return int(min(max(rounded, 1), max_interval))

    blocking = rule(0)
    if not overlap or not overlap_share or blocking == 1:
        return blocking

    def hidden(interval: int) -> Fraction:
        window = overlap_window(overlap, interval, fragments, steps_per_execution)
        return hidden_communication(
            Fraction(t_comm),
            Fraction(t_comp),
            window,
            fragments,
            Fraction(overlap_share),
        )

    # interval - rule(hidden(interval)) grows with the interval (the hidden
    # time never shrinks as it grows), so the smallest interval that covers
    # its own rule is found by bisection; `blocking` always covers its own.
    low, high = 1, blocking
    while low < high:
        middle = (low + high) // 2
        if middle >= rule(hidden(middle)):
            high = middle
        else:
            low = middle + 1
    return low


# ---------------------------------------------------------------------------
# The whole algorithm, step by step.
# ---------------------------------------------------------------------------


@dataclasses.dataclass
class SimulationResult:
    """State after :func:`simulate`; every array has the leading replica axis."""

    x: np.ndarray
    correction: np.ndarray
    slots: tuple[np.ndarray, ...]
    #: The learning rates summed since the last average (of the last fragment).
    gamma: float
    #: Local steps since the last average (of the last fragment).
    local_steps: int
    #: Interval averages, each fragment's average counted once.
    interval_averages: int
    boundary_averages: int
    history: list[np.ndarray]
    #: :func:`drift` just before each average, in order (with fragments, the
    #: drift of the averaged fragment's coordinates).
    drifts: list[float] = dataclasses.field(default_factory=list)
    #: Per fragment: local steps since its last average.
    fragment_local_steps: tuple[int, ...] = ()

    @property
    def averages(self) -> int:
        return self.interval_averages + self.boundary_averages


def fragment_offsets(interval: int, fragments: int) -> tuple[int, ...]:
    """The local step after which each fragment's first average falls, counted
    from a full average: ``(j + 1) * interval // fragments`` for fragment
    ``j``. Later averages of a fragment follow every ``interval`` steps, so
    the ``fragments`` averages of an interval are evenly spread and the last
    fragment is averaged when one fragment alone would be.

    >>> fragment_offsets(32, 4)
    (8, 16, 24, 32)
    >>> fragment_offsets(32, 1)
    (32,)
    """
    if isinstance(fragments, bool) or not isinstance(fragments, int) or fragments < 1:
        raise ValueError(
            f"`fragments` must be an integer >= 1. Received: fragments={fragments!r}"
        )
    if interval < fragments:
        raise ValueError(
            f"`fragments` must be at most the interval ({interval}): every "
            f"fragment is averaged once per interval. Received: fragments={fragments}"
        )
    return tuple((j + 1) * interval // fragments for j in range(fragments))


def _fragment_indices(fragments, size: int) -> list[np.ndarray] | None:
    """Flat coordinate indices of each fragment, or None for one fragment."""
    if isinstance(fragments, bool):
        raise ValueError(f"`fragments` must be an integer >= 1, got {fragments!r}")
    if isinstance(fragments, int | np.integer):
        if not 1 <= fragments <= size:
            raise ValueError(
                f"`fragments` must be an integer in [1, {size}] (the number of "
                f"coordinates). Received: fragments={fragments}"
            )
        if fragments == 1:
            return None
        return np.array_split(np.arange(size), int(fragments))
    parts = [np.asarray(p, dtype=np.int64).ravel() for p in fragments]
    every = np.sort(np.concatenate(parts)) if parts else np.array([], np.int64)
    if not np.array_equal(every, np.arange(size)):
        raise ValueError(
            "`fragments` as index arrays must partition the coordinates "
            f"0..{size - 1}: every coordinate in exactly one fragment"
        )
    return parts if len(parts) > 1 else None


def simulate(
    x0: np.ndarray,
    grad_fn: Callable[[int, np.ndarray], np.ndarray],
    *,
    n: int,
    steps: int,
    learning_rate: float | Callable[[int], float],
    interval: int | Callable[[int], int],
    correction: float,
    inner: InnerOptimizer | None = None,
    optimizer_state: str = "local",
    warmup_steps: int = 0,
    boundaries: Iterable[int] = (),
    x_init: np.ndarray | None = None,
    outer: InnerOptimizer | None = None,
    outer_learning_rate: float = 1.0,
    compression: str | None = None,
    group_size: int = 1,
    overlap: bool | int = False,
    steps_per_execution: int = 1,
    fragments: int | Iterable[np.ndarray] = 1,
    landings: Iterable[int] = (),
) -> SimulationResult:
    """Runs the algorithm for ``steps`` optimizer steps on ``n`` replicas.

    Args:
        x0: Initial weights, shape ``shape``, copied to every replica (or
            pass ``x_init`` with shape ``(n, *shape)`` to start replicas
            apart).
        grad_fn: ``grad_fn(t, x)`` returns the gradient of every replica's own
            mini-batch loss at step ``t``, shape ``(n, *shape)``.
        n: Number of replicas.
        steps: Number of optimizer steps.
        learning_rate: A float, or a function of the 0-based step.
        interval: Local steps between two averages (``H``), or a function of
            the 0-based step (an interval changed during training).
        correction: ``beta`` in ``[0, 1]``.
        inner: The inner optimizer (default: plain SGD).
        optimizer_state: ``"local"``, ``"average"``,
            ``"average_second_moments"`` or ``"reset"``: what an average does
            to the inner optimizer's slots. ``"average_second_moments"``
            averages the slots ``inner.second_moments`` names (the
            preconditioner) and keeps the others local; an inner optimizer
            without such slots is refused.
        warmup_steps: Number of initial synchronous steps.
        boundaries: Step counts after which a boundary average happens (end of
            an epoch): ``3`` means after the third step.
        outer: An outer optimizer applied at every average (see
            :func:`outer_step`), or None.
        outer_learning_rate: Its learning rate.
        compression: None, or "bfloat16" / "float16": an average sends each
            replica's update since the period began, ``x_i - x_start``, in
            that type with error feedback (:func:`compress_with_feedback`),
            and the mean is computed in that type (:func:`wire_mean`). The
            correction uses what each replica sent.
        group_size: Hierarchical averaging: consecutive groups of this many
            replicas average their gradients at every local step (see
            :func:`group_mean`), so a group moves as one replica with its
            members' mini-batches; groups skip and average as replicas do.
            Must divide ``n``; 1 is the plain algorithm.
        overlap: Overlapped interval averages (see :func:`overlapped_average`):
            the average due after a local step is taken on the weights as they
            were before that step, and each replica keeps that step's own
            displacement on top of it. Boundary averages, an average due at
            a boundary step, and the pending average before a synchronous
            step are full averages. An integer ``k >= 2`` (the *delay*):
            delayed averages, as ``model.fit`` takes them with one step per
            execution. The average due after a local step sends the weights
            after it (a snapshot) and the next period starts there; its
            mean lands by the same rule (:func:`overlapped_average`, the
            correction updated on the snapshot with the snapshot period's
            learning rates) before the first step at which the weights
            hold ``k`` steps past the snapshot, or before a step that would
            be due or synchronous, or before an epoch's last execution
            (whose last step takes the boundary average) unless that is a
            single step right after the snapshot, which lands at the
            boundary.
        steps_per_execution: With delayed averages: a mean lands only
            between executions of this many steps (when the next execution
            holds no due step), and an average is delayed only when the
            next due average is more than an execution away.
        fragments: Streaming averages. An integer ``F``: the coordinates
            (flattened ``shape``) split into ``F`` contiguous fragments of
            near-equal size; or a sequence of flat index arrays that
            partition the coordinates. Each fragment is an algorithm of its
            own on its coordinates (its own ``Gamma``, local step count,
            period start, compression error and outer step count), and
            fragment ``j`` is averaged after :func:`fragment_offsets` local
            steps counted from a full average, then every ``interval``
            steps. A full average (a boundary, or before a synchronous
            step) averages every fragment that moved. With ``overlap``, each
            fragment's average is overlapped or delayed by the rules above,
            one in flight at a time; landing touches only its fragment.
            ``1`` is the unfragmented algorithm.
        landings: Step counts after which a delayed average on its way
            lands with no other average: the end of an epoch whose boundary
            shows the latest averages (``boundary="latest"``).

    Returns:
        A :class:`SimulationResult`; ``history[t]`` is ``x`` after step ``t``.
    """
    if optimizer_state not in OPTIMIZER_STATE_POLICIES:
        raise ValueError(f"unknown optimizer_state {optimizer_state!r}")
    if group_size < 1 or n % group_size:
        raise ValueError(f"group_size {group_size} does not divide n={n}")
    inner = inner or sgd()
    second_moments = set(inner.second_moments)
    if optimizer_state == "average_second_moments" and not second_moments:
        raise ValueError(
            "optimizer_state 'average_second_moments' needs an inner optimizer "
            "with second moments (InnerOptimizer.second_moments)"
        )
    lr_fn = learning_rate if callable(learning_rate) else (lambda t: learning_rate)
    interval_fn = interval if callable(interval) else (lambda t: interval)
    x = (
        np.array(x_init, dtype=np.float64)
        if x_init is not None
        else np.broadcast_to(np.asarray(x0, np.float64), (n, *np.shape(x0))).copy()
    )
    parts = _fragment_indices(fragments, int(np.prod(x.shape[1:], dtype=np.int64)))
    count = 1 if parts is None else len(parts)

    def get(a, j):
        return a if parts is None else a.reshape(len(a), -1)[:, parts[j]]

    def put(a, j, value):
        if parts is None:
            return value
        a = a.copy()
        a.reshape(len(a), -1)[:, parts[j]] = value
        return a

    c = np.zeros_like(x)
    slots = inner.init(x)
    interval_averages, boundary_averages = 0, 0
    # Per fragment: learning rates summed and local steps since its average;
    # whether it holds an overlapped step no average has included yet (the
    # step an overlapped average ran alongside); whether its slots differ
    # across replicas (under "local" after an average: a synchronous step
    # must not start from them, or the replicas would part again); its
    # outer step count; whether its period is the first since a full
    # average (due after its offset rather than after a whole interval).
    gamma = [0.0] * count
    local = [0] * count
    carried = [False] * count
    slots_apart = [False] * count
    outer_steps = [0] * count
    first = [True] * count
    boundaries, landings = set(boundaries), set(landings)
    history = []
    drifts = []
    # The weights every replica held when each fragment's period began.
    x_start = x.copy()
    outer_slots = outer.init(x_start) if outer else ()
    errors = np.zeros_like(x)  # what compression has not sent yet
    # Delayed averages: ``(fragment, x, slots, gamma)`` of the average on its
    # way (the snapshot), or None.
    delayed = None

    def due_in(j, h):
        """Local steps until fragment ``j``'s next average."""
        period = fragment_offsets(h, count)[j] if first[j] else h
        return period - local[j]

    def do_average(j, include_slots=False):
        nonlocal x, c, slots, outer_slots, errors
        moved = bool(local[j]) or carried[j]
        xj, cj = get(x, j), get(c, j)
        if n > 1 and compression:
            base = get(x_start, j) if moved else xj  # replicas agree if unmoved
            sent, error = compress_with_feedback(xj - base, get(errors, j), compression)
            errors = put(errors, j, error)
            x_bar = base[:1] + wire_mean(sent, compression)
            drifts.append(drift(xj, x_bar))
            if gamma[j] > 0 and correction:
                cj = cj + correction * (x_bar - (base + sent)) / gamma[j]
            xj = np.broadcast_to(x_bar, xj.shape).copy()
        elif n > 1:
            drifts.append(drift(xj))
            xj, cj = average(xj, cj, gamma[j], correction)
        if n > 1:
            if optimizer_state == "average" or include_slots:
                slots = tuple(put(s, j, _replicate_mean(get(s, j))) for s in slots)
                slots_apart[j] = False
            elif optimizer_state == "average_second_moments":
                # The other slots stay apart.
                slots = tuple(
                    put(s, j, _replicate_mean(get(s, j))) if k in second_moments else s
                    for k, s in enumerate(slots)
                )
            elif optimizer_state == "reset":
                slots = tuple(put(s, j, np.zeros_like(get(s, j))) for s in slots)
                slots_apart[j] = False
        if outer and moved:  # not for slots-only averages
            xj, new_slots = outer_step(
                get(x_start, j),
                xj,
                outer,
                tuple(get(s, j) for s in outer_slots),
                outer_learning_rate,
                outer_steps[j],
            )
            outer_slots = tuple(
                put(s, j, new) for s, new in zip(outer_slots, new_slots, strict=True)
            )
            outer_steps[j] += 1
        x, c = put(x, j, xj), put(c, j, cj)
        gamma[j], local[j], carried[j] = 0.0, 0, False

    def full_average(include_slots=False):
        """Every fragment that moved (or, with ``include_slots``, whose slots
        differ): one boundary average."""
        for j in range(count):
            if local[j] or carried[j] or (include_slots and slots_apart[j]):
                do_average(j, include_slots)
        first[:] = [True] * count

    def combine(j, snapshot, snapshot_slots, x_now, slots_now):
        """After fragment ``j``'s mean of ``snapshot`` was taken into ``x``:
        each replica keeps its own steps since the snapshot on top of it."""
        nonlocal x, x_start, slots
        x_start = put(x_start, j, get(x, j))  # the next period starts there
        x = put(
            x_now, j, overlapped_average(get(x, j), get(x_now, j), get(snapshot, j))
        )
        if optimizer_state == "local":
            slots = slots_now
        elif optimizer_state.startswith("average"):  # "reset" restarted them
            averaged = (
                range(len(slots)) if optimizer_state == "average" else second_moments
            )
            slots = tuple(
                put(now, j, overlapped_average(get(s, j), get(now, j), get(snap, j)))
                if k in averaged
                else now
                for k, (s, now, snap) in enumerate(
                    zip(slots, slots_now, snapshot_slots, strict=True)
                )
            )
        else:
            slots = tuple(
                put(now, j, get(s, j)) for s, now in zip(slots, slots_now, strict=True)
            )
        slots_apart[j] = bool(slots)

    def do_overlapped_average(j, snapshot, snapshot_slots, snapshot_gamma, lr):
        nonlocal x, slots
        x_now, slots_now = x, slots
        x, slots = snapshot, snapshot_slots
        gamma[j], local[j] = snapshot_gamma, local[j] - 1
        do_average(j)
        combine(j, snapshot, snapshot_slots, x_now, slots_now)
        gamma[j], carried[j], first[j] = lr, True, False

    def land_delayed():
        nonlocal x, slots, delayed
        (j, snapshot, snapshot_slots, snapshot_gamma), delayed = delayed, None
        x_now, slots_now = x, slots
        gamma_now, local_now = gamma[j], local[j]
        x, slots = snapshot, snapshot_slots
        gamma[j], local[j] = snapshot_gamma, 1
        do_average(j)
        combine(j, snapshot, snapshot_slots, x_now, slots_now)
        gamma[j], local[j] = gamma_now, local_now

    delay = 0 if isinstance(overlap, bool) else int(overlap)
    for t in range(steps):
        lr = lr_fn(t)
        h = interval_fn(t)
        if (
            delayed is not None
            and t % steps_per_execution == 0
            and (
                local[delayed[0]] >= delay
                # Before the offsets, which an interval of 1 has none of.
                or is_synchronous_step(t, h, warmup_steps)
                or min(due_in(j, h) for j in range(count)) <= steps_per_execution
                or local[delayed[0]]
                + _steps_to_boundary(t, steps_per_execution, boundaries)
                >= 2
            )
        ):
            land_delayed()
        g = np.asarray(grad_fn(t, x), np.float64)
        if is_synchronous_step(t, h, warmup_steps):
            if any(local) or any(slots_apart) or any(carried):
                full_average(include_slots=True)
                boundary_averages += 1
            first[:] = [True] * count
            g_bar = np.broadcast_to(g.mean(axis=0, keepdims=True), g.shape)
            displacement, slots = inner.step(g_bar, x, slots, lr, t)
            x = x + displacement
        else:
            for j in range(count):
                in_flight = delayed is not None and delayed[0] == j
                if not local[j] and not carried[j] and not in_flight:
                    x_start = put(x_start, j, get(x, j))
            if group_size > 1:
                g = group_mean(g, group_size)
            snapshot, snapshot_slots, snapshot_gamma = x, slots, list(gamma)
            displacement, slots = inner.step(g, x, slots, lr, t)
            x = local_step(x, displacement, c if n > 1 else 0.0, lr)
            for j in range(count):
                gamma[j] += lr
                local[j] += 1
                slots_apart[j] = n > 1 and bool(slots)
            for j in range(count):
                if due_in(j, h) > 0:
                    continue
                first[j] = False
                if (
                    delay >= 2
                    and n > 1
                    and t + 1 not in boundaries
                    and delayed is None
                    and min(h if i == j else due_in(i, h) for i in range(count))
                    > steps_per_execution
                ):
                    delayed = (j, x.copy(), slots, gamma[j])
                    gamma[j], local[j] = 0.0, 0
                elif overlap and delay < 2 and n > 1 and t + 1 not in boundaries:
                    do_overlapped_average(
                        j, snapshot, snapshot_slots, snapshot_gamma[j], lr
                    )
                else:
                    do_average(j)
                interval_averages += 1
        if (t + 1 in boundaries or t + 1 in landings) and delayed is not None:
            land_delayed()
        if t + 1 in boundaries and (any(local) or any(carried)):
            full_average()
            boundary_averages += 1
        history.append(x.copy())
    return SimulationResult(
        x,
        c,
        slots,
        gamma[-1],
        local[-1],
        interval_averages,
        boundary_averages,
        history,
        drifts,
        tuple(local),
    )


def _steps_to_boundary(t: int, steps_per_execution: int, boundaries) -> int:
    """The steps of the execution starting at step ``t`` if a boundary ends
    it, else 0: its last step takes the boundary average (a full one), so
    a delayed mean lands before it unless the execution is one step that
    follows the snapshot right away."""
    for count in range(1, steps_per_execution + 1):
        if t + count in boundaries:
            return count
    return 0


def group_mean(a: np.ndarray, group_size: int) -> np.ndarray:
    """Replaces each replica's row of ``a`` by the mean over its group:
    consecutive groups of ``group_size`` replicas (hierarchical averaging)."""
    groups = a.reshape(a.shape[0] // group_size, group_size, *a.shape[1:])
    return np.repeat(groups.mean(axis=1), group_size, axis=0)


def _replicate_mean(a: np.ndarray) -> np.ndarray:
    return np.broadcast_to(a.mean(axis=0, keepdims=True), a.shape).copy()


def synchronous(
    x0: np.ndarray,
    grad_fn: Callable[[int, np.ndarray], np.ndarray],
    *,
    n: int,
    steps: int,
    learning_rate: float | Callable[[int], float],
    inner: InnerOptimizer | None = None,
) -> np.ndarray:
    """Ordinary synchronous data parallelism, written independently of
    :func:`simulate`: returns the weights (one copy) after ``steps`` steps."""
    inner = inner or sgd()
    lr_fn = learning_rate if callable(learning_rate) else (lambda t: learning_rate)
    x = np.asarray(x0, np.float64)[None].copy()
    slots = inner.init(x)
    for t in range(steps):
        g = np.asarray(grad_fn(t, np.broadcast_to(x, (n, *x.shape[1:]))), np.float64)
        displacement, slots = inner.step(
            g.mean(0, keepdims=True), x, slots, lr_fn(t), t
        )
        x = x + displacement
    return x[0]
