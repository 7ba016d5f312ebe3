"""Benchmark tables for the docs, generated from ``results.json`` files.

Every table of ``docs/benchmarks.md`` is printed by this module from the
results kept in ``docs/results/``, not typed, and a test checks that the page
shows what it prints::

    python -m keras_skip.bench.reports.tables publish RUN/results.json
        docs/results/NAME.json
    python -m keras_skip.bench.reports.tables KIND docs/results/NAME.json [...]

``KIND`` is one of:

- ``run``: a ``keras-skip bench`` run, a row per method (all columns);
- ``options``: the same with the payload and the wire's bytes, fewer columns;
- ``overlap``: ``options``, and the share of communication overlap hid;
- ``latency``: several ``keras-skip bench`` runs, a row per latency;
- ``pairs``: pairs of runs, with and without latency, a row per pair;
- ``drift``: the drift and accuracy per epoch of a ``--measure-drift`` run;
- ``wrapper``: ``python -m keras_skip.bench.step_overhead --json``;
- ``first_fit``: ``python -m keras_skip.bench.first_fit --json``;
- ``first_fit_scale``: ``python -m keras_skip.bench.first_fit_scale --json``;
- ``interval``: ``python -m keras_skip.bench.overhead --json``;
- ``slots``: ``python benchmarks/optimizer_state.py --json``;
- ``span``: ``python benchmarks/overlap_span.py --json`` runs, a row per run;
- ``peer``: a ``keras-skip bench --peer torch`` run, a row per method of
  both frameworks, and the ratios (:mod:`keras_skip.bench.reports.peer`).

``publish`` copies results without the paths of the machine that made them
(a run's output directory and plots). ``refresh docs/benchmarks.md`` prints
again every table of the page between its markers::

    <!-- generated: python -m keras_skip.bench.reports.tables KIND FILE... -->
    ...
    <!-- end of generated table -->

with the files named relative to the repository's root (the page's
grandparent directory).
"""

from __future__ import annotations

import json
import pathlib
import statistics
import sys
from collections.abc import Sequence

from keras_skip._units import parse_duration
from keras_skip.bench.reports import pages, peer
from keras_skip.bench.reports.script_tables import (
    first_fit_scale_table,
    first_fit_table,
    interval_table,
    slots_table,
    span_table,
    wrapper_table,
)

SYNC = "synchronous SGD"
SKIP = "skip+correction (interval"
ADAPTIVE = "skip+correction, adaptive"
OUTER = "skip+correction, Nesterov outer"
BOUND = "no communication (bound)"
SOLO = "independent processes"


def load(path: str | pathlib.Path) -> dict:
    return json.loads(pathlib.Path(path).read_text())


def publishable(result: dict | list) -> dict | list:
    """``result`` without the machine's paths."""
    if isinstance(result, list):
        return result
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
        # A line break inside a cell keeps the seven columns narrow enough
        # for the page.
        lines.append(
            f"| {latency} ({result['round_trip_seconds'] * 1e3:.1f} ms) "
            f"| {sync['time_to_target']:.1f} s"
            f"<br>{sync['epoch_seconds']:.2f} s / epoch "
            f"| {_time(skip, sync)}<br>{skip['epoch_seconds']:.2f} s / epoch "
            f"| {_time(adaptive, sync)}<br>interval {adaptive['interval']} "
            f"| {_time(outer, sync)}<br>{outer['epoch_seconds']:.2f} s / epoch "
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


def pairs_table(results: Sequence[dict]) -> str:
    """Pairs of runs of the same method, each with latency then without (in
    that order in ``results``), run back to back: a row per pair with the
    ratio of their times to the target, and the median ratio."""
    if len(results) % 2:
        raise ValueError(f"pairs need an even number of runs, not {len(results)}")
    pairs = list(zip(results[0::2], results[1::2], strict=True))
    latency = results[0]["arguments"]["latency"].replace("ms", " ms")
    for slow, fast in pairs:
        if parse_duration(fast["arguments"]["latency"]) != 0:
            raise ValueError("the second run of each pair must have no latency")
        if slow["arguments"]["latency"] != results[0]["arguments"]["latency"]:
            raise ValueError("the first runs of the pairs differ in latency")
    lines = [
        f"| pair | round trip at {latency} | time to {results[0]['target']:.2f} "
        f"at {latency} | at 0 ms | {latency} / 0 ms | s / epoch at {latency} "
        "| at 0 ms |",
        "|---|---|---|---|---|---|---|",
    ]
    ratios = []
    for number, (slow, fast) in enumerate(pairs, 1):
        a, b = row(slow, SKIP), row(fast, SKIP)
        ratios.append(a["time_to_target"] / b["time_to_target"])
        lines.append(
            f"| {number} | {slow['round_trip_seconds'] * 1e3:.1f} ms "
            f"| {a['time_to_target']:.1f} s | {b['time_to_target']:.1f} s "
            f"| {ratios[-1]:.2f}x | {a['epoch_seconds']:.2f} "
            f"| {b['epoch_seconds']:.2f} |"
        )
    median = statistics.median(ratios)
    lines.append(f"\nMedian of the pairs' ratios: **{median:.2f}x**.")
    return "\n".join(lines) + "\n"


def options_table(result: dict) -> str:
    """A run's table with the payload of an average beside the bytes the links
    carried, for comparing options that change what an average sends."""
    final = f"accuracy after {result['epochs']} epochs"
    lines = [
        f"| method | time to {result['target']:.2f} | epochs | vs sync | vs bound "
        f"| {final} | s / epoch | syncs | payload MB | MB sent (wire) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for entry in result["rows"]:
        if SOLO in entry["method"]:
            continue
        shown = cells(entry)[:7] + cells(entry)[8:9]
        payload = entry.get("payload_mb")
        wire = entry.get("wire_mb")
        shown += (
            "-" if payload is None else f"{payload:,.1f}",
            "-" if wire is None else f"{wire:,.0f}",
        )
        lines.append("| " + " | ".join(shown) + " |")
    return "\n".join(lines) + "\n"


def overlap_table(result: dict) -> str:
    """:func:`options_table`, and the share of the communication time per
    epoch that overlapped averages hid in the same run."""
    lines = [options_table(result)]
    for method, share in result.get("overlap_hidden", {}).items():
        effect = "hid" if share >= 0 else "added"
        lines.append(
            f"\nOverlapped averages (`{method}`) {effect} **{abs(share):.1%}** "
            f"{'of' if share >= 0 else 'to'} the communication time per epoch: "
            "`(without - with) / (without - no communication)`, from the steady "
            "epoch times of this run.\n"
        )
    return "".join(lines)


def drift_table(result: dict) -> str:
    """Epoch by epoch, each method's mean drift at an average and its
    validation accuracy."""
    measured = [
        m for m in result["methods"] if any(e.get("drift") for e in m["epochs"])
    ]
    if not measured:
        raise ValueError(
            "no method of this run measured drift: run it with --measure-drift"
        )
    epochs = [e["epoch"] for e in measured[0]["epochs"]]
    lines = [
        "| epoch | " + " | ".join(str(e) for e in epochs) + " |",
        "|---" * (len(epochs) + 1) + "|",
    ]
    for key, what in (("drift", "drift"), ("val_accuracy", "accuracy")):
        for method in measured:
            values = [e.get(key) for e in method["epochs"]]
            shown = ["-" if v is None else f"{v:.3f}" for v in values]
            lines.append(f"| {what}, {method['label']} | " + " | ".join(shown) + " |")
    return "\n".join(lines) + "\n"


def _one(table):
    def render(results: Sequence) -> str:
        if len(results) != 1:
            raise ValueError(f"this table is made from one file, not {len(results)}")
        return table(results[0])

    render.__doc__ = table.__doc__
    return render


KINDS = {
    "run": _one(run_table),
    "options": _one(options_table),
    "overlap": _one(overlap_table),
    "latency": latency_table,
    "pairs": pairs_table,
    "drift": _one(drift_table),
    "wrapper": _one(wrapper_table),
    "first_fit": _one(first_fit_table),
    "first_fit_scale": _one(first_fit_scale_table),
    "interval": _one(interval_table),
    "slots": _one(slots_table),
    "span": span_table,
    "peer": _one(peer.markdown_table),
}


def render(kind: str, paths: Sequence[str | pathlib.Path]) -> str:
    """The table ``kind`` (one of :data:`KINDS`) made from the files ``paths``."""
    if kind not in KINDS:
        raise ValueError(f"table kind {kind!r} is not one of {sorted(KINDS)}")
    return KINDS[kind]([load(path) for path in paths])


GENERATED = pages.generated("keras_skip.bench.reports.tables")


def refresh(page: str | pathlib.Path) -> int:
    """Prints again every generated table of the Markdown file ``page`` from
    the results it names; returns how many tables it holds."""
    return pages.refresh(
        page,
        GENERATED,
        lambda kind, paths, root: render(kind, [root / p for p in paths.split()]),
    )


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) == 3 and argv[0] == "publish":
        result = publishable(load(argv[1]))
        pathlib.Path(argv[2]).write_text(json.dumps(result, indent=1) + "\n")
        return 0
    if len(argv) == 2 and argv[0] == "refresh":
        print(f"{refresh(argv[1])} tables printed again in {argv[1]}")
        return 0
    if len(argv) == 2 and argv[0] == "headline":
        print(json.dumps(headline(load(argv[1])), indent=1))
        return 0
    if len(argv) >= 2 and argv[0] in KINDS:
        try:
            print(render(argv[0], argv[1:]), end="")
        except (ValueError, KeyError) as error:
            print(
                f"keras_skip.bench.reports.tables {argv[0]}: {error}", file=sys.stderr
            )
            return 2
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
