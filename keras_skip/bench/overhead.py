"""What choosing the interval costs: AdaptiveIntervalCallback against baselines.

    python -m keras_skip.bench.overhead [--epochs 20] [--json overhead.json]

On the same model and data, in one run, trains three times: with
`AdaptiveIntervalCallback` (three timed rounds), with the AdaComm-style
baseline (a loss all-reduce and a new interval at every average), and with a
grid search (one short trial run per candidate interval, then training at the
winner). For each it reports the wall time, collectives and bytes per replica
spent on choosing the interval, beyond training itself, and the total
training time. Tracing counts: the baseline's loss all-reduce function. The
callback traces nothing: its probe sets the interval and times rounds from
the host, and the train function holds no code for it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from typing import Any

from keras_skip.bench.workers import baselines, devices, workloads


@dataclasses.dataclass
class OverheadRow:
    strategy: str
    interval: str
    choosing_seconds: float
    collectives: int
    bytes_sent: int
    total_seconds: float
    val_accuracy: float
    #: Of `choosing_seconds`, the part spent tracing (compiling) functions;
    #: None where it is not told apart (grid search's trial runs).
    tracing_seconds: float | None = None


def run(
    epochs: int = 20,
    replicas: int = 4,
    batch_per_replica: int = 32,
    hidden: tuple[int, ...] = (1024, 1024),
    trial_steps: int = 30,
    candidates: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64),
    seed: int = 0,
    verbose: bool = True,
) -> list[OverheadRow]:
    """Trains with each way of choosing the interval in turn and returns
    one row each: the callback's, the AdaComm-style baseline's and grid
    search's."""
    devices.configure_replicas(replicas)
    (x, y), validation = workloads.load_mnist_subset(seed)
    setup = _Setup(
        x, y, validation, batch_per_replica * replicas, epochs, replicas, hidden, seed
    )
    rows = []
    for measure in (
        lambda: _adaptive_row(setup, verbose),
        lambda: _adacomm_row(setup),
        lambda: _grid_search_row(setup, candidates, trial_steps),
    ):
        rows.append(measure())
        if verbose:
            print(f"{rows[-1].strategy}: {rows[-1]}", flush=True)
    return rows


@dataclasses.dataclass
class _Setup:
    """The model and data every strategy trains on."""

    x: Any
    y: Any
    validation: tuple
    batch_size: int
    epochs: int
    replicas: int
    hidden: tuple[int, ...]
    seed: int

    def model(self, interval: int):
        import keras

        import keras_skip

        strategy = devices.mirrored_strategy(self.replicas)
        keras.utils.set_random_seed(self.seed)
        with strategy.scope():
            model = workloads.mlp(self.hidden)
            model.compile(
                optimizer=keras_skip.SkipCorrectionOptimizer(
                    keras.optimizers.SGD(0.05), interval=interval
                ),
                loss=workloads.classification_loss(),
                metrics=["accuracy"],
            )
        return model

    def train(self, model, callback) -> tuple[float, float]:
        """Wall time of the whole training and the last validation accuracy."""
        start = time.perf_counter()
        history = model.fit(
            self.x,
            self.y,
            batch_size=self.batch_size,
            epochs=self.epochs,
            validation_data=self.validation,
            verbose=0,
            callbacks=[callback],
        )
        return time.perf_counter() - start, float(history.history["val_accuracy"][-1])


def _row(
    strategy, interval, choosing_seconds, counted, total, accuracy, tracing=None
) -> OverheadRow:
    # `counted` has the collectives and bytes it spent on choosing.
    return OverheadRow(
        strategy,
        interval,
        choosing_seconds,
        counted.collectives,
        counted.bytes_sent,
        total,
        accuracy,
        tracing,
    )


def _adaptive_row(setup: _Setup, verbose: bool) -> OverheadRow:
    import keras_skip

    adaptive = keras_skip.AdaptiveIntervalCallback(verbose=int(verbose))
    seconds, accuracy = setup.train(setup.model(1), adaptive)
    return _row(
        "AdaptiveIntervalCallback",
        str(adaptive.decision.interval),
        adaptive.overhead_seconds,
        adaptive,
        seconds,
        accuracy,
        0.0,  # the train function holds no code for the probe
    )


def _adacomm_row(setup: _Setup) -> OverheadRow:
    adacomm = baselines.AdaCommCallback(initial_interval=8)
    seconds, accuracy = setup.train(setup.model(8), adacomm)
    chosen = sorted(set(adacomm.intervals)) or [8]
    return _row(
        "AdaComm-style (loss all-reduce per average)",
        f"{chosen[0]}-{chosen[-1]}" if len(chosen) > 1 else str(chosen[0]),
        adacomm.overhead_seconds,
        adacomm,
        seconds,
        accuracy,
        adacomm.tracing_seconds,
    )


def _grid_search_row(
    setup: _Setup, candidates: tuple[int, ...], trial_steps: int
) -> OverheadRow:
    import keras_skip

    search = baselines.grid_search_interval(
        setup.model,
        setup.x,
        setup.y,
        batch_size=setup.batch_size,
        candidates=candidates,
        trial_steps=trial_steps,
    )
    seconds, accuracy = setup.train(
        setup.model(search.interval), keras_skip.SkipCorrectionCallback()
    )
    return _row(
        f"grid search ({len(candidates)} trials of {trial_steps} steps)",
        str(search.interval),
        search.seconds,
        search,
        search.seconds + seconds,
        accuracy,
    )


def format_table(rows: list[OverheadRow]) -> str:
    ours = rows[0].choosing_seconds
    header = (
        "strategy",
        "interval",
        "choosing: wall time",
        "of which tracing",
        "collectives",
        "bytes / replica",
        "x ours",
        "total training",
        "val accuracy",
    )
    lines = [header]
    for r in rows:
        lines.append(
            (
                r.strategy,
                r.interval,
                f"{r.choosing_seconds * 1e3:.1f} ms",
                "in trials"
                if r.tracing_seconds is None
                else f"{r.tracing_seconds * 1e3:.1f} ms",
                str(r.collectives),
                f"{r.bytes_sent:,}",
                f"{r.choosing_seconds / ours:,.0f}x" if ours > 0 else "-",
                f"{r.total_seconds:.1f} s",
                f"{r.val_accuracy:.4f}",
            )
        )
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    text = [
        "  ".join(c.ljust(w) for c, w in zip(line, widths, strict=True))
        for line in lines
    ]
    text.insert(1, "  ".join("-" * w for w in widths))
    share = rows[0].choosing_seconds / rows[0].total_seconds
    text.append(
        f"\nAdaptiveIntervalCallback spent {share:.4%} of its training time choosing."
    )
    return "\n".join(text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m keras_skip.bench.overhead")
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--replicas", type=int, default=4)
    parser.add_argument("--batch-per-replica", type=int, default=32)
    parser.add_argument("--hidden", type=int, nargs="*", default=[1024, 1024])
    parser.add_argument("--trial-steps", type=int, default=30)
    parser.add_argument("--json", help="also write the rows to this JSON file")
    parser.add_argument("--quiet", action="store_true")
    args = parser.parse_args(argv)
    rows = run(
        epochs=args.epochs,
        replicas=args.replicas,
        batch_per_replica=args.batch_per_replica,
        hidden=tuple(args.hidden),
        trial_steps=args.trial_steps,
        verbose=not args.quiet,
    )
    print(format_table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump([dataclasses.asdict(r) for r in rows], f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
