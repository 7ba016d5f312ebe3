"""Benchmark tables for the docs, generated from ``results.json`` files.

The tables of ``docs/benchmarks.md`` that come from runs kept in
``docs/results/`` are printed by this module, not typed, and a test checks
that the page shows what it prints::

    python -m keras_skip.bench.tables publish RUN/results.json docs/results/NAME.json
    python -m keras_skip.bench.tables latency docs/results/latency-*.json
    python -m keras_skip.bench.tables run docs/results/demo.json

``publish`` copies a run's results without the paths of the machine that
made them (its output directory and plots).
"""

from __future__ import annotations

import json
import pathlib
import sys
from collections.abc import Sequence

from keras_skip.bench.relay import parse_duration

SYNC = "synchronous SGD"
SKIP = "skip+correction (interval"
ADAPTIVE = "skip+correction, adaptive"
OUTER = "skip+correction, Nesterov outer"
BOUND = "no communication (bound)"
SOLO = "independent processes"


def load(path: str | pathlib.Path) -> dict:
    return json.loads(pathlib.Path(path).read_text())


def publishable(result: dict) -> dict:
    """``result`` without the machine's paths."""
    result = dict(result)
    result.pop("plots", None)
    arguments = dict(result.get("arguments", {}))
    arguments.pop("out", None)
    result["arguments"] = arguments
    return result


def row(result: dict, prefix: str) -> dict:
    """The row of ``result`` whose method starts with (or, for ``SOLO``,
    contains) ``prefix``."""
    for entry in result["rows"]:
        name = entry["method"]
        if name.startswith(prefix) or (prefix == SOLO and SOLO in name):
            return entry
    raise KeyError(f"no row {prefix!r} in {[r['method'] for r in result['rows']]}")


def _time(entry: dict, sync: dict) -> str:
    seconds = entry.get("time_to_target")
    if seconds is None:
        return "not reached"
    return f"{seconds:.1f} s ({seconds / sync['time_to_target']:.3f}x)"


def latency_table(results: Sequence[dict]) -> str:
    """One row per run, by one-way latency: each method's time to the target
    (ratio to synchronous SGD), and the epochs of the no-communication run
    and of independent processes."""
    header = (
        "| one-way latency (measured round trip) | synchronous SGD "
        "| skip+correction (interval 32) | adaptive (interval chosen) "
        "| outer + bfloat16 (interval 32) | no communication, s / epoch "
        "| independent processes, s / epoch |\n"
        "|---|---|---|---|---|---|---|\n"
    )
    lines = []
    ordered = sorted(results, key=lambda r: parse_duration(r["arguments"]["latency"]))
    for result in ordered:
        sync, skip = row(result, SYNC), row(result, SKIP)
        adaptive, outer = row(result, ADAPTIVE), row(result, OUTER)
        latency = result["arguments"]["latency"].replace("ms", " ms")
        lines.append(
            f"| {latency} ({result['round_trip_seconds'] * 1e3:.1f} ms) "
            f"| {sync['time_to_target']:.1f} s, {sync['epoch_seconds']:.2f} s / epoch "
            f"| {_time(skip, sync)}, {skip['epoch_seconds']:.2f} s / epoch "
            f"| {_time(adaptive, sync)}, interval {adaptive['interval']} "
            f"| {_time(outer, sync)}, {outer['epoch_seconds']:.2f} s / epoch "
            f"| {row(result, BOUND)['epoch_seconds']:.2f} "
            f"| {row(result, SOLO)['epoch_seconds']:.2f} |"
        )
    return header + "\n".join(lines) + "\n"


def cells(entry: dict, megabytes: str = ",.0f") -> tuple[str, ...]:
    """A results row's cells, as the run tables show them (``-`` where a
    method has no value); ``megabytes`` formats the MB sent."""

    def cell(value, spec, suffix=""):
        return "-" if value is None else f"{value:{spec}}{suffix}"

    wire = entry.get("wire_mb")
    return (
        entry["method"],
        cell(entry.get("time_to_target"), ".1f", " s"),
        cell(entry.get("epochs_to_target"), "d"),
        cell(entry.get("vs_sync"), ".3f", "x"),
        cell(entry.get("vs_bound"), ".2f", "x"),
        cell(entry.get("final_accuracy"), ".4f"),
        cell(entry.get("epoch_seconds"), ".2f"),
        cell(entry.get("utilization"), ".0%"),
        cell(entry.get("synchronizations"), "d"),
        cell(wire if wire is not None else entry.get("payload_mb"), megabytes),
        str(entry.get("interval", "-")),
    )


def run_table(result: dict) -> str:
    """The table of one run, a row per method, as the benchmarks page shows
    it (the terminal's table of ``keras-skip bench`` in Markdown)."""
    stopped = result.get("arguments", {}).get("stop_at_target")
    final = (
        "accuracy at the stop"
        if stopped
        else f"accuracy after {result['epochs']} epochs"
    )
    lines = [
        f"| method | time to {result['target']:.2f} | epochs | vs sync | vs bound "
        f"| {final} | s / epoch | compute | syncs | MB sent (wire) | interval |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    lines += [
        "| " + " | ".join(cells(entry)) + " |"
        for entry in result["rows"]
        if SOLO not in entry["method"]
    ]
    return "\n".join(lines) + "\n"


def headline(result: dict) -> dict:
    """The README's numbers: synchronous SGD against the fastest
    skip+correction method of ``result``, to its target."""
    sync = row(result, SYNC)
    reached = [
        r
        for r in result["rows"]
        if r["method"].startswith("skip+correction") and r.get("time_to_target")
    ]
    best = min(reached, key=lambda r: r["time_to_target"])
    return {
        "workers": result["workers"],
        "target": result["target"],
        "sync_seconds": round(sync["time_to_target"], 1),
        "best_method": best["method"],
        "best_seconds": round(best["time_to_target"], 1),
        "best_vs_sync": round(best["time_to_target"] / sync["time_to_target"], 3),
        "sync_accuracy": round(sync["final_accuracy"], 3),
        "best_accuracy": round(best["final_accuracy"], 3),
        "bound_seconds": round(row(result, BOUND)["time_to_target"], 1),
    }


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) == 3 and argv[0] == "publish":
        result = publishable(load(argv[1]))
        pathlib.Path(argv[2]).write_text(json.dumps(result, indent=1) + "\n")
        return 0
    if len(argv) >= 2 and argv[0] == "latency":
        print(latency_table([load(path) for path in argv[1:]]), end="")
        return 0
    if len(argv) == 2 and argv[0] == "run":
        print(run_table(load(argv[1])), end="")
        return 0
    if len(argv) == 2 and argv[0] == "headline":
        print(json.dumps(headline(load(argv[1])), indent=1))
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
