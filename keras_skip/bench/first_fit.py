"""What tracing costs in a first `fit`: the train function traced with the one
step branch its executions take, against the function that chooses with a
condition at every step.

    python -m keras_skip.bench.first_fit [--replicas 4] [--inner sgd adam]
        [--intervals 1 4] [--fragments 1] [--overlap 0] [--rounds 5]
        [--steps 8] [--json first_fit.json]

One process, ``replicas`` logical CPU devices under a MirroredStrategy, the
benchmark MLP (784-1024-1024-10), a batch of 32 per replica. For each inner
optimizer and interval, each round builds two fresh models with the same
initial weights and fits each for one epoch of ``steps`` steps: "one
branch", the train function as ``fit`` runs it, and "condition", the same
with every execution given the condition between the synchronous and the
local step (``_step.branch_of_execution`` answering None, as during a
warm-up; with ``fragments`` above 1, also between a held interval's full
average and the fragments' own, which ``fit`` traces apart). The two
alternate which goes first. Each round's ratio of the
two fits, in the process's CPU time and in wall time, is taken, and the
median and the extremes are printed, with whether the two models ended
with the same weights to the bit.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time
from unittest import mock

from keras_skip.bench import paired
from keras_skip.bench.options import (
    add_first_fit_options,
    non_negative_int,
    positive_int,
)
from keras_skip.bench.reports.script_tables import first_fit_table

#: The inner optimizers measured, by name.
INNERS = ("sgd", "adam")


def measure(
    strategy,
    inner: str,
    interval: int,
    rounds: int = 5,
    steps: int = 8,
    seed: int = 0,
    fragments: int = 1,
    overlap: int = 0,
) -> dict:
    """CPU and wall seconds of the two first fits under `strategy`, the
    median, minimum and maximum of their per-round ratio, and whether every
    round's two models ended with the same weights. `fragments` and
    `overlap`: the optimizer's options of those names (0 is
    ``overlap=False``, 1 ``overlap=True``)."""
    if inner not in INNERS:
        raise ValueError(f"inner must be one of {INNERS}; got {inner!r}.")
    options = {
        "fragments": fragments,
        "overlap": {0: False, 1: True}.get(overlap, overlap),
    }
    data = _dataset(strategy.num_replicas_in_sync, seed)
    cpu: dict[str, list[float]] = {"one branch": [], "condition": []}
    wall: dict[str, list[float]] = {"one branch": [], "condition": []}
    same = True
    for r in range(rounds):
        order = ("one branch", "condition")
        weights = {}
        for arm in order if r % 2 == 0 else order[::-1]:
            model = _model(strategy, inner, interval, seed, options)
            used, took = _first_fit(model, data, steps, arm == "condition")
            cpu[arm].append(used)
            wall[arm].append(took)
            weights[arm] = model.get_weights()
        same = same and all(
            (a == b).all()
            for a, b in zip(weights["one branch"], weights["condition"], strict=True)
        )
    return {
        "inner": inner,
        "interval": interval,
        "fragments": fragments,
        "overlap": overlap,
        "replicas": strategy.num_replicas_in_sync,
        "one_branch_cpu_seconds": statistics.median(cpu["one branch"]),
        "condition_cpu_seconds": statistics.median(cpu["condition"]),
        **paired.ratios("cpu_ratio", cpu["one branch"], cpu["condition"]),
        **paired.ratios("wall_ratio", wall["one branch"], wall["condition"]),
        "same_weights": bool(same),
        "rounds": rounds,
        "steps": steps,
    }


def _dataset(replicas: int, seed: int):
    """The benchmark's training data in global batches of 32 per replica."""
    import tensorflow as tf

    from keras_skip.bench.workers import workloads

    (x, y), _ = workloads.load_mnist_subset(seed)
    return tf.data.Dataset.from_tensor_slices((x, y)).batch(
        32 * replicas, drop_remainder=True
    )


def _model(strategy, inner: str, interval: int, seed: int, options: dict):
    """The benchmark MLP compiled under `strategy` with the wrapped `inner`
    and the optimizer's `options`; the same initial weights for the same
    `seed`."""
    import keras

    import keras_skip
    from keras_skip.bench.workers import workloads

    with strategy.scope():
        keras.utils.set_random_seed(seed)
        m = workloads.mlp()
        optimizer = {
            "sgd": lambda: keras.optimizers.SGD(0.05),
            "adam": lambda: keras.optimizers.Adam(1e-3),
        }[inner]()
        m.compile(
            optimizer=keras_skip.SkipCorrectionOptimizer(
                optimizer, interval=interval, **options
            ),
            loss=workloads.classification_loss(),
        )
    return m


def _first_fit(model, data, steps: int, condition: bool) -> tuple[float, float]:
    """CPU and wall seconds of the model's first fit, of `steps` steps."""
    import keras_skip
    from keras_skip import _step

    arm = (
        mock.patch.object(_step, "branch_of_execution", lambda *counters: None)
        if condition
        else contextlib.nullcontext()
    )
    with arm:
        began, began_cpu = time.perf_counter(), time.process_time()
        model.fit(
            data,
            steps_per_epoch=steps,
            epochs=1,
            shuffle=False,
            verbose=0,
            callbacks=[keras_skip.SkipCorrectionCallback()],
        )
        return time.process_time() - began_cpu, time.perf_counter() - began


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m keras_skip.bench.first_fit",
        description="What tracing costs in a first fit: one step branch "
        "against the condition at every step.",
    )
    add_first_fit_options(
        parser, rounds=5, rounds_help="rounds of two fresh models each", steps=8
    )
    parser.add_argument(
        "--inner",
        choices=INNERS,
        nargs="+",
        default=list(INNERS),
        help="inner optimizers (default: %(default)s)",
    )
    parser.add_argument(
        "--intervals",
        type=positive_int,
        nargs="+",
        default=[1, 4],
        help="intervals; 1 is synchronous SGD (default: %(default)s)",
    )
    parser.add_argument(
        "--fragments",
        type=positive_int,
        default=1,
        help="the optimizer's fragments (default: %(default)s)",
    )
    parser.add_argument(
        "--overlap",
        type=non_negative_int,
        default=0,
        help="the optimizer's overlap: local steps an average runs beside, "
        "0 for none (default: %(default)s)",
    )
    args = parser.parse_args(argv)

    from keras_skip.bench.workers import devices

    devices.configure_replicas(args.replicas)
    strategy = devices.mirrored_strategy(args.replicas)
    rows = [
        measure(
            strategy,
            inner,
            interval,
            args.rounds,
            args.steps,
            fragments=args.fragments,
            overlap=args.overlap,
        )
        for inner in args.inner
        for interval in args.intervals
    ]
    print(
        f"one branch / condition: median of {args.rounds} rounds of first fits "
        f"of {args.steps} steps on {args.replicas} replicas (min-max)"
    )
    print(first_fit_table(rows), end="")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
