"""Time to accuracy over slow links: ``keras-skip bench``.

Runs every method on the same workload with N MultiWorkerMirroredStrategy
worker processes, on loopback or over emulated slow links of a given rate
and one-way latency (:mod:`keras_skip.bench.links`: as root each worker in
its own network namespace behind a rate-limited link, otherwise through a
user-space relay). For
each method it measures wall time to a target validation accuracy, epochs to
target, accuracy after the epoch budget, synchronizations and bytes sent,
the chosen interval and the compute utilisation; it prints a table and
writes ``results.json`` and PNG plots.

Methods: ``sync`` (synchronous SGD with a stock Keras optimizer), ``local``
(plain local SGD: ``correction=0``, fixed interval), ``skip`` (skip+correction,
fixed interval), ``adaptive`` (skip+correction with AdaptiveIntervalCallback,
once per ``--target-ratios`` value), ``adacomm`` (the AdaComm-style baseline),
and ``nocomm``: the same local steps with no averaging at all, which only
gives the compute-only epoch time, the physical limit of skipping; ``solo``
runs the same steps as independent processes with no cluster at all (plain
Keras SGD, started together, the slowest one's epoch reported), to show what
the cluster costs where nothing is averaged. The
*bound* is the no-communication run's training time over as many epochs as
synchronous SGD needs to reach the target, its first epoch (tracing)
included, as every method's time to target includes its own.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import math
import pathlib
import signal
import sys
import tempfile
import time
from collections.abc import Sequence

from keras_skip.bench import launcher, links, options, tables
from keras_skip.bench.worker import OPTION_METHODS

ALL_METHODS = (
    "sync",
    "local",
    "skip",
    "adaptive",
    "adacomm",
    "nocomm",
    *OPTION_METHODS,
    "solo",
)
#: What runs without --methods: the options of issue-free defaults are opt-in.
DEFAULT_METHODS = ALL_METHODS[:6]


@dataclasses.dataclass
class MethodResult:
    name: str
    label: str
    epochs: list[dict]
    synchronizations: int
    payload_bytes: int
    wire_bytes: int | None
    intervals: list[int]
    decision: dict | None
    seconds: float

    def time_to(self, target: float) -> tuple[float | None, int | None]:
        """Training time (validation excluded) and epochs until the end of
        the first epoch whose validation accuracy reaches ``target``."""
        for record in self.epochs:
            accuracy = record.get("val_accuracy")
            if accuracy is not None and accuracy >= target:
                return training_seconds(record), record["epoch"]
        return None, None

    def seconds_at(self, epochs: int) -> float:
        """Training time (validation excluded) at the end of epoch ``epochs``,
        first epoch and its tracing included: as measured, or past the last
        measured epoch extended by the steady epoch time."""
        if not self.epochs:
            return math.nan
        measured = min(epochs, len(self.epochs))
        extra = epochs - measured
        return training_seconds(self.epochs[measured - 1]) + extra * self.epoch_seconds

    @property
    def final_accuracy(self) -> float | None:
        return self.epochs[-1].get("val_accuracy") if self.epochs else None

    @property
    def epoch_seconds(self) -> float:
        """Median training time (validation excluded) of the epochs after the
        first, which includes tracing."""
        return _steady_epoch_seconds(self.epochs)


def _steady_epoch_seconds(epochs: list[dict]) -> float:
    times = [training_seconds(r) for r in epochs]
    steady = sorted(b - a for a, b in itertools.pairwise(times))
    if not steady:
        return times[0] if times else math.nan
    return steady[len(steady) // 2]


def training_seconds(record: dict) -> float:
    """Wall time since the start of ``fit`` at the end of an epoch, minus the
    time spent on validation, which costs every method the same and only
    measures progress."""
    return record["seconds"] - record.get("validation_seconds", 0.0)


def method_plan(args) -> list[tuple[str, str, dict]]:
    """``(name, label, worker config overrides)`` for every method to run."""
    plan = []
    for method in args.methods:
        if method == "sync":
            plan.append(("sync", "synchronous SGD", {"method": "sync"}))
        elif method == "local":
            plan.append(
                ("local", f"local SGD (interval {args.interval})", {"method": "local"})
            )
        elif method == "skip":
            plan.append(
                (
                    "skip",
                    f"skip+correction (interval {args.interval})",
                    {"method": "skip"},
                )
            )
        elif method == "adaptive":
            for ratio in args.target_ratios:
                name = (
                    "adaptive"
                    if len(args.target_ratios) == 1
                    else f"adaptive@{ratio:g}"
                )
                plan.append(
                    (
                        name,
                        f"skip+correction, adaptive (target_ratio {ratio:g})",
                        {"method": "adaptive", "target_ratio": ratio},
                    )
                )
        elif method == "adacomm":
            plan.append(("adacomm", "AdaComm-style local SGD", {"method": "adacomm"}))
        elif method in OPTION_METHODS:
            parts = []
            if "outer" in method:
                parts.append(f"Nesterov outer {args.outer_learning_rate:g}")
            if "compress" in method:
                parts.append(f"{args.compression} averages")
            if "overlap" in method:
                parts.append("overlapped averages")
            plan.append(
                (
                    method,
                    f"skip+correction, {', '.join(parts)} (interval {args.interval})",
                    {"method": method},
                )
            )
        elif method in ("nocomm", "solo"):
            label = (
                "no communication (bound)"
                if method == "nocomm"
                else f"{args.workers} independent processes (no cluster)"
            )
            plan.append(
                (
                    method,
                    label,
                    {"method": method, "epochs": args.nocomm_epochs, "stop_at": None},
                )
            )
    return plan


def run_method(
    name, label, overrides, base, args, network, out_dir: pathlib.Path, progress
) -> MethodResult:
    directory = out_dir / name
    directory.mkdir(parents=True, exist_ok=True)
    config = {**base, **overrides, "out": str(directory)}
    before = network.transmitted_bytes() if network else None
    start = time.monotonic()
    result = launcher.launch(
        [sys.executable, "-m", "keras_skip.bench.worker", json.dumps(config)],
        args.workers,
        timeout=args.timeout,
        log_dir=directory,
        on_progress=lambda worker, line: progress(name, worker, line),
        **(network.launch_arguments() if network else {}),
    )
    if not result.ok:
        raise RuntimeError(f"method {name!r} failed:\n{result.failure_report()}")
    seconds = time.monotonic() - start
    after = network.transmitted_bytes() if network else None
    with open(directory / "worker-0.json") as f:
        worker = json.load(f)
    if name == "solo":
        # Independent processes end their epochs apart: the slowest one's
        # epoch is what a cluster's epoch would compare with.
        slowest = []
        for i in range(args.workers):
            with open(directory / f"worker-{i}.json") as f:
                slowest.append(json.load(f)["epochs"])
        worker["epochs"] = max(
            slowest, key=lambda epochs: _steady_epoch_seconds(epochs)
        )
    wire = (
        None
        if before is None
        else max(a - b for a, b in zip(after, before, strict=True))
    )
    return MethodResult(
        name,
        label,
        worker["epochs"],
        worker["synchronizations"],
        worker["payload_bytes"],
        wire,
        worker["intervals"],
        worker["decision"],
        seconds,
    )


def summary_rows(results: Sequence[MethodResult], target: float) -> list[dict]:
    by_name = {r.name: r for r in results}
    sync = by_name.get("sync")
    nocomm = by_name.get("nocomm")
    sync_time, sync_epochs = sync.time_to(target) if sync else (None, None)
    bound = None
    if nocomm is not None and sync_epochs is not None:
        bound = nocomm.seconds_at(sync_epochs)
    rows = []
    for r in results:
        if r.name == "nocomm":
            rows.append(
                {
                    "method": r.label,
                    "epoch_seconds": r.epoch_seconds,
                    "time_to_target": bound,
                    "epochs_to_target": sync_epochs,
                }
            )
            continue
        if r.name == "solo":
            rows.append({"method": r.label, "epoch_seconds": r.epoch_seconds})
            continue
        seconds, epochs = r.time_to(target)
        rows.append(
            {
                "method": r.label,
                "time_to_target": seconds,
                "epochs_to_target": epochs,
                "vs_sync": None
                if seconds is None or not sync_time
                else seconds / sync_time,
                "vs_bound": None if seconds is None or not bound else seconds / bound,
                "final_accuracy": r.final_accuracy,
                "epoch_seconds": r.epoch_seconds,
                "utilization": None
                if nocomm is None
                else nocomm.epoch_seconds / r.epoch_seconds,
                "synchronizations": r.synchronizations,
                "payload_mb": r.payload_bytes / 1e6,
                "wire_mb": None if r.wire_bytes is None else r.wire_bytes / 1e6,
                "interval": _interval_text(r),
            }
        )
    return rows


def overlap_hidden(results: Sequence[MethodResult]) -> dict[str, float]:
    """For each method with overlapped averages run beside the same method
    without them and the no-communication run: the share of the
    communication time per epoch that overlapping hid,
    ``(without - with) / (without - no communication)``, from the steady
    epoch times of this one run."""
    by_name = {r.name: r for r in results}
    nocomm = by_name.get("nocomm")
    hidden = {}
    for name, r in by_name.items():
        if nocomm is None or "overlap" not in name:
            continue
        base = by_name.get(
            name.removesuffix("-overlap") if name != "overlap" else "skip"
        )
        if base is None:
            continue
        communication = base.epoch_seconds - nocomm.epoch_seconds
        if communication > 0:
            hidden[name] = (base.epoch_seconds - r.epoch_seconds) / communication
    return hidden


def independent_ratio(results: Sequence[MethodResult]) -> float | None:
    """The no-communication run's steady epoch time over that of the same
    steps run as independent processes: what the cluster costs even where
    nothing is averaged (1.0 is nothing)."""
    by_name = {r.name: r for r in results}
    if "nocomm" not in by_name or "solo" not in by_name:
        return None
    return by_name["nocomm"].epoch_seconds / by_name["solo"].epoch_seconds


def _interval_text(r: MethodResult) -> str:
    if r.name == "sync":
        return "1"
    if r.decision:
        return str(r.decision["interval"])
    values = [i for i in r.intervals if i < 2**40]
    if not values:
        return "-"
    return str(values[0]) if len(values) == 1 else f"{min(values)}-{max(values)}"


def format_table(rows: list[dict], target: float) -> str:
    header = (
        "method",
        f"time to {target:.3f}",
        "epochs",
        "vs sync",
        "vs bound",
        "final acc",
        "s / epoch",
        "compute",
        "syncs",
        "MB sent",
        "interval",
    )
    lines = [header, *(tables.cells(row, megabytes=".1f") for row in rows)]
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    text = [
        "  ".join(c.ljust(w) for c, w in zip(line, widths, strict=True))
        for line in lines
    ]
    text.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(text)


def plot(
    results: Sequence[MethodResult], target: float, out_dir: pathlib.Path
) -> list[str]:
    """Validation accuracy against wall time, epoch time split into compute and
    communication, and accuracy per epoch; returns the PNG paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    trained = [r for r in results if r.name not in ("nocomm", "solo")]

    def accuracy_plot(x_of, xlabel: str, filename: str, log: bool = False):
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for r in trained:
            ax.plot(
                [x_of(e) for e in r.epochs],
                [e["val_accuracy"] for e in r.epochs],
                marker="o",
                markersize=3,
                label=r.label,
            )
        ax.axhline(target, color="grey", linestyle=":", label=f"target {target:.3f}")
        if log:
            ax.set_xscale("log")
        ax.set_xlabel(xlabel)
        ax.set_ylabel("validation accuracy")
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
        fig.tight_layout()
        paths.append(str(out_dir / filename))
        fig.savefig(paths[-1], dpi=120)
        plt.close(fig)

    accuracy_plot(
        training_seconds,
        "training time (s, validation excluded, log scale)",
        "accuracy_vs_time.png",
        log=True,
    )

    nocomm = next((r for r in results if r.name == "nocomm"), None)
    if nocomm is not None:
        compute = nocomm.epoch_seconds
        fig, ax = plt.subplots(figsize=(7, 4))
        labels = [r.label for r in trained]
        totals = [r.epoch_seconds for r in trained]
        ax.barh(labels, [min(compute, t) for t in totals], label="computation")
        ax.barh(
            labels,
            [max(t - compute, 0) for t in totals],
            left=[min(compute, t) for t in totals],
            label="communication and waiting",
        )
        ax.set_xlabel("seconds per epoch")
        ax.legend(fontsize=8)
        fig.tight_layout()
        paths.append(str(out_dir / "epoch_time.png"))
        fig.savefig(paths[-1], dpi=120)
        plt.close(fig)

    accuracy_plot(lambda e: e["epoch"], "epoch", "accuracy_vs_epoch.png")

    drifting = [r for r in trained if any(e.get("drift") for e in r.epochs)]
    if drifting:
        fig, ax = plt.subplots(figsize=(7, 4))
        for r in drifting:
            ax.plot(
                [e["epoch"] for e in r.epochs],
                [e.get("drift") for e in r.epochs],
                marker="o",
                markersize=3,
                label=r.label,
            )
        ax.set_xlabel("epoch")
        ax.set_ylabel("drift at an average, mean_i ||x_i - x_bar||")
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
        fig.tight_layout()
        paths.append(str(out_dir / "drift_vs_epoch.png"))
        fig.savefig(paths[-1], dpi=120)
        plt.close(fig)
    return paths


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="keras-skip bench",
        description="Time to accuracy of synchronous SGD, local SGD and "
        "skip+correction with real worker processes, optionally over emulated "
        "slow links.",
        formatter_class=options.HelpFormatter,
    )
    options.add_link_options(parser, epochs=12, epochs_help="epoch budget per method")
    add = parser.add_argument
    add(
        "--workload",
        choices=("mlp", "mlp-noniid", "cnn"),
        default="mlp",
        help="the MLP on MNIST, the same with label-sorted shards, or a small CNN",
    )
    add(
        "--hidden",
        type=options.positive_int,
        nargs="+",
        default=[1024, 1024],
        help="hidden layer sizes of the MLP workloads",
    )
    add(
        "--batch-per-worker",
        type=options.positive_int,
        default=32,
        help="batch size of each worker (the global batch is this times --workers)",
    )
    add(
        "--learning-rate",
        type=options.positive_float,
        default=0.05,
        help="SGD learning rate of every method",
    )
    add(
        "--interval",
        type=options.positive_int,
        default=32,
        help="interval of the fixed-interval methods and AdaComm's start",
    )
    add(
        "--target-ratios",
        type=options.positive_float,
        nargs="+",
        default=[1.0],
        help="the adaptive method's communication/computation ratios per "
        "epoch, one run each",
    )
    add(
        "--max-interval",
        type=options.positive_int,
        default=64,
        help="largest interval the adaptive methods may choose",
    )
    add(
        "--target",
        type=options.accuracy,
        default=None,
        help="validation accuracy to reach (default: what synchronous SGD "
        "reaches after the epoch budget)",
    )
    add(
        "--stop-at-target",
        action="store_true",
        help="stop each method once it reaches --target",
    )
    add(
        "--methods",
        nargs="+",
        choices=ALL_METHODS,
        default=list(DEFAULT_METHODS),
        metavar="METHOD",
        help=f"methods to run, in order, among: {', '.join(ALL_METHODS)}",
    )
    add(
        "--outer-learning-rate",
        type=options.positive_float,
        default=0.7,
        help="learning rate of method outer's Nesterov SGD outer optimizer",
    )
    add(
        "--compression",
        choices=("bfloat16", "float16"),
        default="bfloat16",
        help="wire type of the methods with compress",
    )
    add(
        "--outer-momentum",
        type=options.fraction,
        default=0.9,
        help="momentum of method outer's outer optimizer",
    )
    add(
        "--nocomm-epochs",
        type=options.positive_int,
        default=3,
        help="epochs of the no-communication run (its epoch time is steady)",
    )
    add(
        "--measure-drift",
        action="store_true",
        help="measure the replicas' drift at every average (one more small "
        "all-reduce per average) and plot it",
    )
    add(
        "--timeout",
        type=options.positive_float,
        default=3600,
        help="seconds after which a method's workers are killed",
    )
    add(
        "--quick",
        action="store_true",
        help="a small run on loopback (2 workers, a small MLP, 2 epochs)",
    )
    add("--seed", type=int, default=0, help="seed of the data split and the weights")
    return parser


def run(args, print_fn=print) -> dict:

    if args.quick:
        args.workers, args.bandwidth, args.hidden, args.epochs = 2, None, [64], 2
        args.latency = "0ms"
        args.interval, args.nocomm_epochs = 8, 2
    if args.stop_at_target and args.target is None:
        raise SystemExit("--stop-at-target needs --target.")
    try:
        mechanism, note = links.choose(args.bandwidth, args.latency, args.links)
    except RuntimeError as error:
        raise SystemExit(str(error)) from error
    out_dir = pathlib.Path(args.out or tempfile.mkdtemp(prefix="keras-skip-bench-"))
    out_dir.mkdir(parents=True, exist_ok=True)
    base = {
        "workload": args.workload,
        "hidden": args.hidden,
        "epochs": args.epochs,
        "batch_per_worker": args.batch_per_worker,
        "learning_rate": args.learning_rate,
        "interval": args.interval,
        "max_interval": args.max_interval,
        "seed": args.seed,
        "stop_at": args.target if args.stop_at_target else None,
        "measure_drift": args.measure_drift,
        "outer_learning_rate": args.outer_learning_rate,
        "outer_momentum": args.outer_momentum,
        "compression": args.compression,
    }
    if note:
        print_fn(f"Note: {note}.")
    network = (
        links.SlowLinks(args.workers, args.bandwidth, args.latency, mechanism)
        if mechanism
        else None
    )
    link = network.describe() if network else "loopback"
    print_fn(
        f"{args.workers} workers, {link}, workload {args.workload}, "
        f"{args.epochs} epochs; results in {out_dir}"
    )

    def progress(name, worker, line):
        if worker == 0 and line.startswith("PROGRESS"):
            print_fn(f"[{name}] {line.removeprefix('PROGRESS ').strip()}")

    results = []
    round_trip = None
    started = time.monotonic()
    try:
        if network:
            network.__enter__()
            if args.workers > 1:
                round_trip = network.round_trip()
                print_fn(
                    f"Round trip between two workers, measured: "
                    f"{round_trip * 1e3:.1f} ms"
                )
        for name, label, overrides in method_plan(args):
            print_fn(f"[{name}] {label}: starting {args.workers} workers")
            results.append(
                run_method(
                    name, label, overrides, base, args, network, out_dir, progress
                )
            )
    finally:
        if network:
            network.close()
    target = args.target
    if target is None:
        sync = next((r for r in results if r.name == "sync"), None)
        target = (
            sync.final_accuracy
            if sync
            else max((r.final_accuracy or 0 for r in results), default=0)
        )
    rows = summary_rows(results, target)
    table = format_table(rows, target)
    hidden = overlap_hidden(results)
    for name, share in hidden.items():
        table += (
            f"\n{name}: overlapping hid {share:.1%} of the communication time "
            "per epoch (steady epochs, against the same method without it "
            "and the no-communication run)"
        )
    independent = independent_ratio(results)
    if independent is not None:
        table += (
            f"\nno communication: its epoch took {independent:.2f}x the "
            f"epoch of {args.workers} independent processes (steady epochs)"
        )
    paths = plot(results, target, out_dir)
    report = {
        "workers": args.workers,
        "link": link,
        "round_trip_seconds": round_trip,
        "workload": args.workload,
        "epochs": args.epochs,
        "target": target,
        "seconds": time.monotonic() - started,
        "rows": rows,
        "overlap_hidden": hidden,
        "nocomm_vs_independent": independent,
        "methods": [dataclasses.asdict(r) for r in results],
        "plots": paths,
        "arguments": vars(args),
    }
    with open(out_dir / "results.json", "w") as f:
        json.dump(report, f, indent=1, default=str)
    print_fn("")
    print_fn(table)
    print_fn(f"\nTarget accuracy {target:.4f}; plots and results.json in {out_dir}")
    return report


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)

    def stop(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)
    try:
        run(args)

    except KeyboardInterrupt:
        print("Interrupted; every worker process and network namespace was removed.")
        return 130
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
