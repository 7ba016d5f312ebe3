"""What a first `fit` costs against Keras' own as the model's variables grow.

    python -m keras_skip.bench.first_fit_scale [--replicas 4] [--layers 2 8 32]
        [--width 64] [--rounds 3] [--steps 32] [--json first_fit_scale.json]

One process, ``replicas`` logical CPU devices under a MirroredStrategy, an
MLP of ``layers`` hidden layers of ``width`` units on the benchmark's MNIST
subset (two variables a layer, so the variables grow with the layers while
the steps stay cheap: what is left is mostly tracing, and the run time of
the traced functions' first calls). For each depth, each round builds three
fresh models with the same initial weights and fits each once, for one
epoch of ``steps`` steps of 32 examples per replica, from the call of `fit`
to its return (so with the full average `fit` ends with):

- "keras": the plain SGD optimizer, Keras' own synchronous training;
- "skip": ``SkipCorrectionOptimizer(SGD, interval=16)``;
- "streaming": the streaming option set of the benchmark's fastest
  method, ``outer-compress-overlap-stream-latest``: interval 16, an outer
  Nesterov step, bfloat16 averages, ``overlap=6``, ``fragments=2``,
  ``boundary="latest"``.

The three take turns in each round's order. Each round's ratios to "keras",
in wall time and in the process's CPU time, are taken, and their median and
extremes are printed.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from keras_skip.bench import paired
from keras_skip.bench.options import add_first_fit_options, positive_int
from keras_skip.bench.reports.script_tables import first_fit_scale_table

#: The variants, in the order of the first round.
VARIANTS = ("keras", "skip", "streaming")
#: The interval of "skip" and "streaming".
INTERVAL = 16


def measure(
    strategy, layers: int, width: int = 64, rounds: int = 3, steps: int = 32
) -> dict:
    """Wall and CPU seconds of the three first fits (medians) at ``layers``
    hidden layers, and the median and extremes of each round's ratios to
    "keras"."""
    if isinstance(layers, bool) or not isinstance(layers, int) or layers < 1:
        raise ValueError(f"layers must be an integer >= 1; got {layers!r}.")
    data = _dataset(strategy.num_replicas_in_sync, steps)
    wall: dict[str, list[float]] = {v: [] for v in VARIANTS}
    cpu: dict[str, list[float]] = {v: [] for v in VARIANTS}
    variables = 0
    for r in range(rounds):
        shift = r % len(VARIANTS)
        for variant in VARIANTS[shift:] + VARIANTS[:shift]:
            model = _model(strategy, variant, layers, width)
            used, took = _first_fit(model, data, steps, variant)
            cpu[variant].append(used)
            wall[variant].append(took)
            variables = len(model.trainable_variables)
    row = {
        "layers": layers,
        "width": width,
        "variables": variables,
        "replicas": strategy.num_replicas_in_sync,
        "rounds": rounds,
        "steps": steps,
    }
    for variant in VARIANTS:
        row[f"{variant}_seconds"] = statistics.median(wall[variant])
        row[f"{variant}_cpu_seconds"] = statistics.median(cpu[variant])
    for variant in VARIANTS[1:]:
        row.update(paired.ratios(f"{variant}_ratio", wall[variant], wall["keras"]))
        row.update(paired.ratios(f"{variant}_cpu_ratio", cpu[variant], cpu["keras"]))
    return row


def _dataset(replicas: int, steps: int):
    """``steps`` global batches of 32 examples per replica of the benchmark's
    MNIST subset (repeated if it holds fewer)."""
    import tensorflow as tf

    from keras_skip.bench.workers import workloads

    (x, y), _ = workloads.load_mnist_subset(0)
    batch = 32 * replicas
    return (
        tf.data.Dataset.from_tensor_slices((x, y))
        .repeat()
        .batch(batch, drop_remainder=True)
        .take(steps)
    )


def _model(strategy, variant: str, layers: int, width: int):
    """The MLP of `layers` hidden layers compiled under `strategy` for
    `variant`, with the same initial weights for every variant."""
    import keras

    import keras_skip
    from keras_skip.bench.workers import workloads

    with strategy.scope():
        keras.utils.set_random_seed(0)
        model = workloads.mlp(hidden=(width,) * layers)
        optimizer = keras.optimizers.SGD(0.05)
        if variant == "skip":
            optimizer = keras_skip.SkipCorrectionOptimizer(optimizer, interval=INTERVAL)
        elif variant == "streaming":
            optimizer = keras_skip.SkipCorrectionOptimizer(
                optimizer,
                interval=INTERVAL,
                outer_optimizer=keras.optimizers.SGD(0.7, momentum=0.9, nesterov=True),
                compression="bfloat16",
                overlap=6,
                fragments=2,
                boundary="latest",
            )
        model.compile(optimizer=optimizer, loss=workloads.classification_loss())
    return model


def _first_fit(model, data, steps: int, variant: str) -> tuple[float, float]:
    """CPU and wall seconds of the model's first fit, of `steps` steps."""
    import keras_skip

    callbacks = [] if variant == "keras" else [keras_skip.SkipCorrectionCallback()]
    began, began_cpu = time.perf_counter(), time.process_time()
    model.fit(data, epochs=1, shuffle=False, verbose=0, callbacks=callbacks)
    return time.process_time() - began_cpu, time.perf_counter() - began


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m keras_skip.bench.first_fit_scale",
        description="What a first fit costs against Keras' own as the model's "
        "variables grow.",
    )
    add_first_fit_options(
        parser, rounds=3, rounds_help="rounds of three fresh models each", steps=32
    )
    parser.add_argument(
        "--layers",
        type=positive_int,
        nargs="+",
        default=[2, 8, 32],
        help="hidden layers of each model measured (default: %(default)s)",
    )
    parser.add_argument(
        "--width",
        type=positive_int,
        default=64,
        help="units of each hidden layer (default: %(default)s)",
    )
    args = parser.parse_args(argv)

    from keras_skip.bench.workers import devices

    devices.configure_replicas(args.replicas)
    strategy = devices.mirrored_strategy(args.replicas)
    rows = []
    for layers in args.layers:
        rows.append(measure(strategy, layers, args.width, args.rounds, args.steps))
        print(first_fit_scale_table(rows[-1:]).splitlines()[-1], flush=True)
    print(
        f"first fits of {args.steps} steps on {args.replicas} replicas, median "
        f"of {args.rounds} rounds; ratios to Keras' own fit (min-max)"
    )
    print(first_fit_scale_table(rows), end="")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
