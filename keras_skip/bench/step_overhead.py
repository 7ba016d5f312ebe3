"""What the wrapper costs on a local step: SkipCorrectionOptimizer against its
inner optimizer alone.

    python -m keras_skip.bench.step_overhead [--steps-per-execution 1 8]
        [--rounds 9] [--steps 125] [--json step_overhead.json]

One process, one worker (TensorFlow's default strategy), the benchmark MLP
(784-1024-1024-10) with a batch of 32. For each ``steps_per_execution`` two
models with the same initial weights train on the same batches: one with
``keras.optimizers.SGD`` alone, one with it wrapped in a
``SkipCorrectionOptimizer`` whose interval never comes, so that every step
is a local step (inner update, correction, counters) and no average is due.
After an untimed epoch each (tracing), the two alternate epoch by epoch for
``rounds`` rounds; the ratio of each round's two epochs, in wall time and
in the process's CPU time, is taken, and the median of those ratios is
printed with the extremes. Interleaving and pairing keep the machine's drift
out of the ratio; CPU time also leaves out time the process waited for a
core.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from keras_skip.bench import paired
from keras_skip.bench.options import positive_int

#: An interval that never comes: every step is a local step.
NEVER = 2**62


def measure(
    steps_per_execution: int, rounds: int = 9, steps: int = 125, seed: int = 0
) -> dict:
    """Milliseconds per step of the bare and the wrapped optimizer, and the
    median, minimum and maximum of their per-round ratio."""
    data = _dataset(seed)
    models = {
        "bare": _model(False, steps_per_execution, seed),
        "wrapped": _model(True, steps_per_execution, seed),
    }
    seconds, cpu = _interleaved_epochs(models, data, rounds, steps)
    # Every step was local; each epoch's boundary average, on one replica,
    # only updates counters.
    assert models["wrapped"].optimizer.synchronous_steps == 0
    return {
        "steps_per_execution": steps_per_execution,
        "bare_ms_per_step": 1e3 * statistics.median(seconds["bare"]) / steps,
        "wrapped_ms_per_step": 1e3 * statistics.median(seconds["wrapped"]) / steps,
        **paired.ratios("ratio", seconds["wrapped"], seconds["bare"]),
        **paired.ratios("cpu_ratio", cpu["wrapped"], cpu["bare"]),
        "rounds": rounds,
        "steps": steps,
    }


def _dataset(seed: int):
    """The benchmark's training data in batches of 32, repeated."""
    import tensorflow as tf

    from keras_skip.bench.workers import workloads

    (x, y), _ = workloads.load_mnist_subset(seed)
    return (
        tf.data.Dataset.from_tensor_slices((x, y))
        .batch(32, drop_remainder=True)
        .repeat()
        .prefetch(4)
    )


def _model(wrapped: bool, steps_per_execution: int, seed: int):
    """The benchmark MLP with SGD, bare or wrapped; the same initial weights
    either way."""
    import keras

    import keras_skip
    from keras_skip.bench.workers import workloads

    keras.utils.set_random_seed(seed)
    m = workloads.mlp()
    optimizer = keras.optimizers.SGD(0.05)
    if wrapped:
        optimizer = keras_skip.SkipCorrectionOptimizer(optimizer, interval=NEVER)
    m.compile(
        optimizer=optimizer,
        loss=workloads.classification_loss(),
        steps_per_execution=steps_per_execution,
    )
    return m


def _interleaved_epochs(
    models: dict, data, rounds: int, steps: int
) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """Wall and CPU seconds of each model's epochs, after an untimed one
    each (tracing), the two models taking turns to go first."""
    seconds: dict[str, list[float]] = {name: [] for name in models}
    cpu: dict[str, list[float]] = {name: [] for name in models}

    def epoch(name: str) -> tuple[float, float]:
        began, began_cpu = time.perf_counter(), time.process_time()
        models[name].fit(data, steps_per_epoch=steps, epochs=1, verbose=0)
        return time.perf_counter() - began, time.process_time() - began_cpu

    for name in models:
        epoch(name)  # tracing
    for r in range(rounds):
        order = ("bare", "wrapped") if r % 2 == 0 else ("wrapped", "bare")
        for name in order:
            wall, used = epoch(name)
            seconds[name].append(wall)
            cpu[name].append(used)
    return seconds, cpu


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m keras_skip.bench.step_overhead",
        description="The wrapper's cost on a local step, against the bare "
        "inner optimizer (one worker).",
    )
    parser.add_argument(
        "--steps-per-execution",
        type=positive_int,
        nargs="+",
        default=[1, 8],
        help="values of steps_per_execution to measure (default: %(default)s)",
    )
    parser.add_argument(
        "--rounds",
        type=positive_int,
        default=9,
        help="interleaved pairs of epochs (default: %(default)s)",
    )
    parser.add_argument(
        "--steps",
        type=positive_int,
        default=125,
        help="steps per epoch (default: %(default)s)",
    )
    parser.add_argument("--json", help="also write the rows to this file")
    args = parser.parse_args(argv)
    rows = [measure(spe, args.rounds, args.steps) for spe in args.steps_per_execution]
    print(
        f"wrapped / SGD: median of {args.rounds} interleaved pairs of epochs "
        f"of {args.steps} steps (min-max)"
    )
    print(
        f"{'steps_per_execution':<21}{'SGD ms/step':<13}{'wrapped ms/step':<17}"
        f"{'wall time':<22}{'CPU time'}"
    )
    for row in rows:
        print(
            f"{row['steps_per_execution']:<21}{row['bare_ms_per_step']:<13.2f}"
            f"{row['wrapped_ms_per_step']:<17.2f}"
            f"{row['ratio']:.3f} ({row['ratio_min']:.2f}-{row['ratio_max']:.2f})"
            f"{'':<6}{row['cpu_ratio']:.3f} "
            f"({row['cpu_ratio_min']:.2f}-{row['cpu_ratio_max']:.2f})"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
