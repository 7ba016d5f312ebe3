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
import json
import pathlib
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence

from keras_skip import tracing
from keras_skip.bench import links
from keras_skip.bench.methods import method_plan
from keras_skip.bench.parser import build_parser
from keras_skip.bench.reports import peer as peer_tables
from keras_skip.bench.reports import traces
from keras_skip.bench.reports.plot import plot
from keras_skip.bench.reports.results import (
    MethodResult,
    method_result,
    read_worker_measurements,
)
from keras_skip.bench.reports.summary import (
    default_target,
    format_table,
    independent_ratio,
    overlap_hidden,
    summary_rows,
    table_notes,
    trace_hidden,
    trace_notes,
)
from keras_skip.bench.workers import launcher
from keras_skip.bench.workers import peer as peer_run

#: ``progress(method, worker, line)``: called with every line of every log.
Progress = Callable[[str, int, str], None]


def run(args: argparse.Namespace, print_fn: Callable[[str], None] = print) -> dict:
    """Runs every method of ``args``, prints the table and writes
    ``results.json`` and the plots; returns what ``results.json`` holds."""
    _apply_quick(args)
    mechanism, note = _choose_links(args)
    out_dir = pathlib.Path(args.out or tempfile.mkdtemp(prefix="keras-skip-bench-"))
    out_dir.mkdir(parents=True, exist_ok=True)
    base = _worker_config(args)
    if args.peer:
        # Worker 0 of every method writes the model's initial weights, the
        # same for all: the peer starts from them.
        base["initial_weights"] = str(out_dir / "initial-weights.npz")
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
    started = time.monotonic()
    results, round_trip, peer = _run_methods(args, base, network, out_dir, print_fn)
    report = _report(args, results, link, round_trip, started, out_dir)
    if peer is not None:
        report["peer"] = peer
        report["peer_rows"] = peer_tables.peer_rows(report)
        report["peer_ratios"] = peer_tables.ratios(report["peer_rows"])
    with open(out_dir / "results.json", "w") as f:
        json.dump(report, f, indent=1, default=str)
    print_fn("")
    print_fn(_table(report, args.workers))
    target = report["target"]
    print_fn(f"\nTarget accuracy {target:.4f}; plots and results.json in {out_dir}")
    return report


def _apply_quick(args: argparse.Namespace) -> None:
    """``--quick``: a small run on loopback, whatever the other options say."""
    if args.quick:
        args.workers, args.bandwidth, args.hidden, args.epochs = 2, None, [64], 2
        args.latency = "0ms"
        args.interval, args.nocomm_epochs = 8, 2


def _choose_links(args: argparse.Namespace) -> tuple[str | None, str | None]:
    """The links' mechanism and the note on it; what cannot run ends the run
    here, before anything is created."""
    if args.stop_at_target and args.target is None:
        raise SystemExit("--stop-at-target needs --target.")
    try:
        chosen = links.choose(args.bandwidth, args.latency, args.links)
    except RuntimeError as error:
        raise SystemExit(str(error)) from error
    peer_run.check(args, chosen[0])
    return chosen


def _worker_config(args: argparse.Namespace) -> dict:
    """The worker configuration every method shares."""
    return {
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
        "overlap_steps": args.overlap_steps,
        "fragments": args.fragments,
    }


def _run_methods(
    args: argparse.Namespace,
    base: dict,
    network: links.SlowLinks | None,
    out_dir: pathlib.Path,
    print_fn: Callable[[str], None],
) -> tuple[list[MethodResult], float | None, dict | None]:
    """Every method's result, the round trip measured over the links first,
    and with ``--peer`` what the peer measured after the Keras methods on
    the same links; the links are removed after the last method, or on any
    error."""

    def progress(name, worker, line):
        if worker == 0 and line.startswith("PROGRESS"):
            print_fn(f"[{name}] {line.removeprefix('PROGRESS ').strip()}")

    results = []
    round_trip = peer = None
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
        if args.peer:
            weights = pathlib.Path(base["initial_weights"])
            peer = peer_run.run(args, weights, out_dir, network, print_fn)
    finally:
        if network:
            network.close()
    return results, round_trip, peer


def run_method(
    name: str,
    label: str,
    overrides: dict,
    base: dict,
    args: argparse.Namespace,
    network: links.SlowLinks | None,
    out_dir: pathlib.Path,
    progress: Progress,
) -> MethodResult:
    """Runs one method's workers with ``base`` and ``overrides`` as their
    configuration, and returns what they measured."""
    directory = out_dir / name
    directory.mkdir(parents=True, exist_ok=True)
    config = {**base, **overrides, "out": str(directory)}
    if args.trace:
        config["trace"] = str(pathlib.Path(args.trace) / name)
    before = network.transmitted_bytes() if network else None
    start = time.monotonic()
    result = launcher.launch(
        [sys.executable, "-m", "keras_skip.bench.workers.worker", json.dumps(config)],
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
    measurements = read_worker_measurements(
        directory, args.workers, slowest=name == "solo"
    )
    wire = (
        None
        if before is None
        else max(a - b for a, b in zip(after, before, strict=True))
    )
    traces = None
    if args.trace:
        traces = [
            tracing.summary(
                tracing.read(pathlib.Path(config["trace"]) / f"worker-{i}.json")
            )
            for i in range(args.workers)
        ]
    return method_result(name, label, measurements, wire, seconds, traces)


def _report(
    args: argparse.Namespace,
    results: list[MethodResult],
    link: str,
    round_trip: float | None,
    started: float,
    out_dir: pathlib.Path,
) -> dict:
    """What ``results.json`` holds: the summary rows, the measurements of
    every method and the paths of the plots, which this writes."""
    target = default_target(results) if args.target is None else args.target
    rows = summary_rows(results, target)
    paths = plot(results, target, out_dir)
    return {
        "workers": args.workers,
        "link": link,
        "round_trip_seconds": round_trip,
        "workload": args.workload,
        "epochs": args.epochs,
        "target": target,
        "seconds": time.monotonic() - started,
        "rows": rows,
        "overlap_hidden": overlap_hidden(results),
        "trace_hidden": trace_hidden(results),
        "trace_flights": _trace_flights(args, results),
        "nocomm_vs_independent": independent_ratio(results),
        "methods": [dataclasses.asdict(r) for r in results],
        "plots": paths,
        "arguments": vars(args),
    }


def _trace_flights(args: argparse.Namespace, results: list[MethodResult]) -> dict:
    """With ``--trace``, the medians over each method's delayed averages of
    what :mod:`keras_skip.bench.reports.traces` reads across the workers."""
    if not args.trace:
        return {}
    found = {}
    for r in results:
        flights = traces.flights(traces.read_workers(pathlib.Path(args.trace) / r.name))
        if flights:
            found[r.name] = {
                field.name: statistics.median(getattr(f, field.name) for f in flights)
                for field in dataclasses.fields(traces.Flight)
            }
    return found


def _table(report: dict, workers: int) -> str:
    """The summary table, with the notes on overlapping and on the
    independent processes under it."""
    main_table = (
        peer_tables.text_table(report)
        if report.get("peer")
        else format_table(report["rows"], report["target"])
    )
    return (
        main_table
        + table_notes(
            report["overlap_hidden"], report["nocomm_vs_independent"], workers
        )
        + trace_notes(report.get("trace_hidden") or {})
        + "".join(
            f"\n{name} (traces, medians over its delayed averages): the workers "
            f"started each {f['skew']:.3f} s apart; {f['wire']:.3f} s from the last "
            f"start to the end; the last to start computed {f['steps']:g} steps "
            f"({f['computed']:.3f} s) beside it, then waited {f['waited']:.3f} s"
            for name, f in (report.get("trace_flights") or {}).items()
        )
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    delayed_streams = [m for m in args.methods if "stream" in m and "overlap" in m]
    if delayed_streams and args.overlap_steps < 2:
        parser.error(
            f"--overlap-steps must be at least 2 with {', '.join(delayed_streams)}: "
            "a fragment's average is delayed over the next steps (the "
            f"average alongside one step does not take fragments). Received: "
            f"--overlap-steps {args.overlap_steps}"
        )

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
