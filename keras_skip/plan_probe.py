"""Measures the planner's inputs on a running cluster instead of assuming them.

:mod:`keras_skip.planner` predicts epoch times from a :class:`~keras_skip.
planner.Link` (the network) and a step time (the model). Nominal figures,
such as a NIC's rate, say little of what an all-reduce between TensorFlow
processes achieves: framing, gRPC, copies and waking the peer process all
cost. :func:`measure` times them on the cluster the training will run on
(the ``TF_CONFIG`` cluster of a `tf.distribute.MultiWorkerMirroredStrategy`):

- all-reduces of a tiny and of a large float32 tensor, from which it fits a
  :class:`~keras_skip.planner.Link` that reproduces both timings exactly;
- optionally, one training step of a model on this worker's devices.

Every worker must call it at the same point: it runs collectives. All
workers return the same numbers (the slowest worker's), so that whatever
they decide from them, they decide alike.

Unlike the rest of the package this module imports TensorFlow and Keras when
it is imported; ``import keras_skip`` does not import it.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable

import keras
import numpy as np
import tensorflow as tf

from keras_skip import multi_worker, planner

#: Bytes of the tiny all-reduce: one float32.
SMALL_BYTES = 4

#: Untimed calls before the timed ones: tracing, collective set-up and
#: first-touch allocations happen in them.
ALL_REDUCE_WARM_UP = 1
STEP_WARM_UP = 2


@dataclasses.dataclass(frozen=True)
class ProbeResult:
    """What :func:`measure` measured; identical on every worker.

    Attributes:
        workers: Worker processes in the cluster.
        step_time: Seconds of one training step of the model on a worker's
            devices (forward and backward pass, without communication), the
            slowest worker's median; None when no model was given.
        link: The measured network, fitted to the two all-reduces below:
            ``efficiency=1.0`` and ``bandwidth`` the effective bytes per
            second the payload got; ``latency=0.0`` and ``round_trips=0.0``,
            with ``step_overhead`` the measured seconds of one step of the
            ring, which folds the latency and the hosts' overhead into one
            figure. A measurement cannot tell latency from host overhead
            apart, and the planner only needs their sum, so the link does
            not pretend to: ``link.all_reduce_seconds(large_bytes, workers)``
            is ``large_seconds`` and ``link.all_reduce_seconds(4, workers)``
            is ``small_seconds``.
        small_seconds: Median seconds of an all-reduce of one float32, the
            slowest worker's.
        large_seconds: Median seconds of an all-reduce of ``large_bytes``
            bytes of float32, the slowest worker's.
        large_bytes: Bytes of the large all-reduce.
    """

    workers: int
    step_time: float | None
    link: planner.Link
    small_seconds: float
    large_seconds: float
    large_bytes: int


def measure(
    strategy: tf.distribute.Strategy,
    model: keras.Model | None = None,
    batch_size: int = 32,
    large_bytes: int = 16 * 2**20,
    repeats: int = 5,
) -> ProbeResult:
    """Times all-reduces (and a model's training step) on this cluster.

    A collective: every worker of `strategy` must call it at the same point
    with the same arguments. It runs ``2 * (repeats + 1)`` all-reduces, the
    model's steps and one all-reduce that agrees on the results.

    The link is the ring model of :class:`keras_skip.planner.Link` fitted to
    two points: an all-reduce of ``SMALL_BYTES`` takes ``small_seconds`` and
    one of ``large_bytes`` takes ``large_seconds``. Over ``N`` workers the
    ring sends ``2 (N - 1) / N`` times the payload in ``2 (N - 1)`` steps,
    so the difference of the two timings gives the bandwidth and what
    remains of the small one the seconds of a ring step.

    Args:
        strategy: A `tf.distribute.MultiWorkerMirroredStrategy` of at least
            two workers, such as :func:`keras_skip.multi_worker_strategy`
            returns.
        model: A built Keras model, compiled with a loss, whose variables
            were created in ``strategy.scope()``; None to time only the
            link. Its step is timed on random inputs shaped like
            ``model.inputs`` and random targets shaped like its outputs
            (or, when its loss takes class labels, random labels). Its
            weights are not changed.
        batch_size: Samples per replica of the timed step; this worker's
            step takes ``batch_size`` on each of its devices.
        large_bytes: Bytes of the large all-reduce, at least 1024 (rounded
            down to whole float32 values, as is the result's). It should
            take clearly longer than the tiny one: about the size of the
            model's weights is a good choice.
        repeats: Timed calls of each kind; the median is kept.

    Returns:
        A :class:`ProbeResult`, the same on every worker.

    Raises:
        ValueError: For an argument out of range, a strategy of fewer than
            two workers, or a model that is not built and compiled.
        RuntimeError: If the large all-reduce took no longer than the tiny
            one: the measurement was dominated by noise.
    """
    batch_size = _count("batch_size", batch_size, 1)
    # Whole float32 values: the payload is what the fit is of.
    large_bytes = _count("large_bytes", large_bytes, 1024) // 4 * 4
    repeats = _count("repeats", repeats, 1)
    if model is not None:
        _check_model(model)
    workers = multi_worker.num_workers(strategy)
    if workers < 2:
        raise ValueError(
            "Measuring the link (`keras-skip plan --probe`) needs a TF_CONFIG "
            "cluster of at least 2 workers, each running the same command "
            "under a MultiWorkerMirroredStrategy; this process is the only "
            f"worker of its strategy ({type(strategy).__name__}). Received: "
            f"workers={workers}"
        )

    small = _time_all_reduce(strategy, SMALL_BYTES // 4, repeats)
    large = _time_all_reduce(strategy, large_bytes // 4, repeats)
    step = 0.0
    if model is not None:
        step = _time_step(strategy, model, batch_size, repeats)
    # One all-reduce makes every worker's figures the slowest worker's.
    small, large, step = (
        float(v) for v in multi_worker.gather(strategy, [small, large, step]).max(0)
    )
    link = fit_link(small, large, large_bytes, workers)
    return ProbeResult(
        workers=workers,
        step_time=step if model is not None else None,
        link=link,
        small_seconds=small,
        large_seconds=large,
        large_bytes=large_bytes,
    )


def fit_link(
    small_seconds: float, large_seconds: float, large_bytes: int, workers: int
) -> planner.Link:
    """The :class:`~keras_skip.planner.Link` whose ring all-reduce over
    `workers` takes `small_seconds` for ``SMALL_BYTES`` and `large_seconds`
    for `large_bytes` (see :class:`ProbeResult` for its constants).

    Raises a RuntimeError if the large all-reduce was not the slower one.
    """
    if not large_seconds > small_seconds:
        raise RuntimeError(
            "The link measurement was dominated by noise: an all-reduce of "
            f"{large_bytes} bytes took {large_seconds:.3g} s, no longer than "
            f"one of {SMALL_BYTES} bytes ({small_seconds:.3g} s). Pass a "
            "larger `large_bytes` (or more `repeats`), so that the payload's "
            "time on the wire stands out."
        )
    steps = 2 * (workers - 1)
    share = steps / workers  # bytes sent per byte of payload
    bandwidth = share * (large_bytes - SMALL_BYTES) / (large_seconds - small_seconds)
    small_wire = share * SMALL_BYTES / bandwidth
    # Clamped for a noisy pair where the wire alone would exceed `small`.
    step_overhead = max(0.0, (small_seconds - small_wire) / steps)
    return planner.Link(
        bandwidth=bandwidth,
        latency=0.0,
        efficiency=1.0,
        round_trips=0.0,
        step_overhead=step_overhead,
    )


def _count(name: str, value, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        raise ValueError(
            f"`{name}` must be an integer >= {minimum}. Received: {name}={value!r}"
        )
    if value < minimum:
        raise ValueError(
            f"`{name}` must be an integer >= {minimum}. Received: {name}={value!r}"
        )
    return int(value)


def _check_model(model) -> None:
    if not isinstance(model, keras.Model):
        raise ValueError(
            "`model` must be a keras.Model (or None to measure only the link). "
            f"Received: model={model!r}"
        )
    if not model.built or not getattr(model, "inputs", None):
        raise ValueError(
            "`model` must be built with known inputs (a functional model, or "
            "a Sequential model that starts with keras.Input) so that its "
            f"step can be timed on inputs of its shape. Received: {model.name}"
        )
    if not model.compiled or model.loss is None:
        raise ValueError(
            "`model` must be compiled with a loss (for example "
            "model.compile(optimizer='sgd', loss='mse')) so that its "
            f"training step can be timed. Received: {model.name}, "
            f"compiled={model.compiled}, loss={model.loss!r}"
        )


def _median_seconds(call: Callable[[], object], warm_up: int, repeats: int) -> float:
    """Median host-clock seconds of `call`, which must return only once its
    work is done, after `warm_up` untimed calls."""
    for _ in range(warm_up):
        call()
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds)


def _time_all_reduce(strategy, values: int, repeats: int) -> float:
    """Median seconds of a SUM all-reduce of `values` float32 per replica."""
    # Each replica's payload is made once, on its device, so that the timed
    # calls copy nothing but what the all-reduce itself sends.
    payload = strategy.experimental_distribute_values_from_function(
        lambda context: tf.zeros([values], tf.float32)
    )

    def replica_fn(tensor):
        context = tf.distribute.get_replica_context()
        # One value of the result: a scalar to fetch, which waits for it all.
        return context.all_reduce(tf.distribute.ReduceOp.SUM, tensor)[0]

    @tf.function(autograph=False)
    def all_reduce():
        return strategy.run(replica_fn, args=(payload,))

    return _median_seconds(
        lambda: _fetch(strategy, all_reduce()), ALL_REDUCE_WARM_UP, repeats
    )


def _fetch(strategy, result) -> list[np.ndarray]:
    return [np.asarray(r) for r in strategy.experimental_local_results(result)]


def _time_step(strategy, model: keras.Model, batch_size: int, repeats: int) -> float:
    """Median seconds of the model's training step on this worker's replicas:
    its forward pass, compiled loss and gradients, without the gradients'
    all-reduce (the planner counts communication apart) and without the
    optimizer's update (an elementwise pass over the weights, which would
    all-reduce the gradients first). The weights are left as they were."""
    rng = np.random.default_rng(0)
    x = [_random_input(tensor, batch_size, rng) for tensor in model.inputs]
    x = x[0] if len(x) == 1 else x
    outputs = keras.tree.map_structure(np.asarray, model(x, training=False))
    errors = []
    for make_targets in (_like_outputs, _class_labels):
        try:
            y = keras.tree.map_structure(
                lambda out, make=make_targets: make(out, rng), outputs
            )
        except ValueError as error:
            errors.append(error)
            continue
        step = _step_function(strategy, model, x, y)
        try:
            step()  # the first call traces: an unfit target fails here
        except (ValueError, TypeError, tf.errors.InvalidArgumentError) as error:
            errors.append(error)
            continue
        return _median_seconds(step, STEP_WARM_UP - 1, repeats)
    raise ValueError(
        "Could not compute the model's compiled loss on random targets shaped "
        "like its outputs, nor on random class labels. Compile it with a loss "
        "such as 'mse' to time its step. Errors: "
        + "; ".join(f"{type(e).__name__}: {e}" for e in errors)
    ) from errors[-1]


def _step_function(strategy, model: keras.Model, x, y) -> Callable[[], object]:
    """A call that runs one training step's computation on every local
    replica, each on its own copy of the `batch_size` rows of `x` and `y`."""
    inputs = strategy.experimental_distribute_values_from_function(
        lambda context: keras.tree.map_structure(tf.constant, x)
    )
    targets = strategy.experimental_distribute_values_from_function(
        lambda context: keras.tree.map_structure(tf.constant, y)
    )

    def replica_fn(x, y):
        with tf.GradientTape() as tape:
            y_pred = model(x, training=True)
            loss = model.compute_loss(x=x, y=y, y_pred=y_pred, training=True)
        gradients = tape.gradient(loss, model.trainable_variables)
        # Every gradient feeds the result, so none is pruned from the graph.
        total = tf.cast(loss, tf.float32)
        for gradient in gradients:
            if gradient is not None:
                total += tf.cast(tf.reduce_sum(gradient), tf.float32)
        return total

    @tf.function(autograph=False)
    def step():
        return strategy.run(replica_fn, args=(inputs, targets))

    return lambda: _fetch(strategy, step())


def _random_input(tensor, batch_size: int, rng: np.random.Generator) -> np.ndarray:
    shape = tuple(tensor.shape)[1:]
    if any(d is None for d in shape):
        raise ValueError(
            "The model's inputs must have a known shape besides the batch "
            "dimension, to time its step on random inputs. Received: input "
            f"{tensor.name!r} of shape {tuple(tensor.shape)}"
        )
    dtype = np.dtype(keras.backend.standardize_dtype(tensor.dtype))
    if np.issubdtype(dtype, np.floating):
        return rng.normal(size=(batch_size, *shape)).astype(dtype)
    # Zeros are valid indices for an embedding, and valid tokens or flags.
    return np.zeros((batch_size, *shape), dtype)


def _like_outputs(output: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Random values in [0, 1) shaped like an output: fit for a regression,
    and for losses that take probabilities or one-hot targets."""
    dtype = output.dtype if np.issubdtype(output.dtype, np.floating) else "float32"
    return rng.uniform(size=output.shape).astype(dtype)


def _class_labels(output: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Random class indices for an output of class scores (sparse losses)."""
    if output.ndim < 2 or not output.shape[-1]:
        raise ValueError(f"an output of shape {output.shape} has no class axis")
    return rng.integers(0, output.shape[-1], size=output.shape[:-1]).astype("int32")
