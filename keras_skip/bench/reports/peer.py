"""One table for keras-skip and a peer framework run on the same links.

``keras-skip bench --peer torch`` runs the Keras methods, then
``benchmarks/torch_peer.py`` on the same links, and keeps the peer's results
in ``results.json`` under ``"peer"``: ``framework``, ``methods`` (each in
the layout of :class:`~keras_skip.bench.reports.results.MethodResult`) and
the command that ran it. This module makes the rows of both frameworks, the
ratios the comparison is about and the table, for the terminal and for the
docs (``python -m keras_skip.bench.reports.tables peer FILE``).
"""

from __future__ import annotations

import dataclasses

from keras_skip.bench.reports.results import MethodResult

#: keras-skip's methods whose averages travel beside the steps.
STREAMING = "overlapped"
#: Labels of the methods of keras-skip (not synchronous SGD, not the bound).
KERAS_SKIP = ("skip+correction", "local SGD", "AdaComm")


def method_of(entry: dict) -> MethodResult:
    """A :class:`MethodResult` from its ``results.json`` form."""
    names = {field.name for field in dataclasses.fields(MethodResult)}
    return MethodResult(**{k: v for k, v in entry.items() if k in names})


def steps_of(method: MethodResult) -> int | None:
    """Training steps the method ran (its last epoch's iteration count)."""
    if not method.epochs:
        return None
    return method.epochs[-1].get("iterations")


def _row(framework: str, method: MethodResult, target: float) -> dict:
    seconds, epochs = method.time_to(target)
    steps = steps_of(method)
    wire = method.wire_bytes
    return {
        "framework": framework,
        "method": method.label,
        "time_to_target": seconds,
        "epochs_to_target": epochs,
        "epochs_run": len(method.epochs),
        "epoch_seconds": method.epoch_seconds,
        "final_accuracy": method.final_accuracy,
        "synchronizations": method.synchronizations,
        "wire_mb_per_step": None if wire is None or not steps else wire / steps / 1e6,
        "payload_mb_per_step": (method.payload_bytes / steps / 1e6 if steps else None),
    }


def peer_rows(report: dict) -> list[dict]:
    """Every trained method of both frameworks, Keras first, as rows: time
    and epochs to the report's target, steady seconds per epoch, final
    accuracy, synchronizations and the bytes per training step (the most
    one worker's link carried over the steps it ran)."""
    target = report["target"]
    rows = [
        _row("Keras", method_of(m), target)
        for m in report["methods"]
        if m["name"] not in ("nocomm", "solo")
    ]
    peer = report.get("peer") or {}
    rows += [
        _row(peer.get("framework", "peer"), method_of(m), target)
        for m in peer.get("methods", [])
    ]
    return rows


def _fastest(rows: list[dict]) -> dict | None:
    reached = [r for r in rows if r["time_to_target"] is not None]
    return min(reached, key=lambda r: r["time_to_target"]) if reached else None


def ratios(rows: list[dict]) -> dict:
    """keras-skip's fastest method against the peer's fastest, and
    keras-skip's fastest overlapped (streaming) method against the peer's
    streaming DiLoCo: ``peer seconds / keras-skip seconds`` to the target
    (above 1: keras-skip was faster), None where either did not reach it."""
    ours = [
        r
        for r in rows
        if r["framework"] == "Keras" and r["method"].startswith(KERAS_SKIP)
    ]
    theirs = [r for r in rows if r["framework"] != "Keras"]
    pairs = {
        "best": (ours, theirs),
        "streaming": (
            [r for r in ours if STREAMING in r["method"]],
            [r for r in theirs if "DiLoCo" in r["method"]],
        ),
    }
    found = {}
    for name, (mine, peer) in pairs.items():
        if not mine or not peer:
            continue
        a, b = _fastest(mine), _fastest(peer)
        found[name] = {
            "keras_skip": a["method"] if a else None,
            "peer": b["method"] if b else None,
            "ratio": b["time_to_target"] / a["time_to_target"] if a and b else None,
        }
    return found


def _cell(value, spec: str, suffix: str = "") -> str:
    return "-" if value is None else f"{value:{spec}}{suffix}"


def _cells(row: dict) -> tuple[str, ...]:
    return (
        row["framework"],
        row["method"],
        _cell(row["time_to_target"], ".1f", " s")
        if row["time_to_target"] is not None
        else f"not reached in {row['epochs_run']} epochs",
        _cell(row["epochs_to_target"], "d"),
        _cell(row["epoch_seconds"], ".2f"),
        _cell(row["final_accuracy"], ".4f"),
        _cell(row["synchronizations"], "d"),
        _cell(row["wire_mb_per_step"], ".3f"),
    )


HEADER = (
    "framework",
    "method",
    "time to {target:.2f}",
    "epochs",
    "s / epoch",
    "final accuracy",
    "syncs",
    "MB / step (wire)",
)


def ratio_notes(found: dict, framework: str) -> str:
    """The sentences under the table: the two ratios, or why one is missing."""
    what = {
        "best": "fastest method",
        "streaming": "fastest overlapped method against streaming DiLoCo",
    }
    lines = []
    for name, r in found.items():
        if r["ratio"] is None:
            missing = "keras-skip" if r["keras_skip"] is None else framework
            lines.append(
                f"keras-skip's {what[name]}: no ratio, {missing} did not reach "
                "the target."
            )
        else:
            lines.append(
                f"keras-skip's {what[name]}: {r['keras_skip']} reached the target "
                f"{r['ratio']:.2f}x as fast as {framework}'s {r['peer']}."
            )
    return "\n".join(lines)


def markdown_table(report: dict) -> str:
    """The Markdown table of both frameworks, and the ratios under it."""
    rows = peer_rows(report)
    header = [h.format(target=report["target"]) for h in HEADER]
    lines = ["| " + " | ".join(header) + " |", "|---" * len(header) + "|"]
    lines += ["| " + " | ".join(_cells(r)) + " |" for r in rows]
    framework = (report.get("peer") or {}).get("framework", "the peer")
    notes = ratio_notes(ratios(rows), framework)
    return "\n".join(lines) + "\n" + (f"\n{notes}\n" if notes else "")


def text_table(report: dict) -> str:
    """The same table for the terminal, in aligned columns."""
    rows = peer_rows(report)
    header = tuple(h.format(target=report["target"]) for h in HEADER)
    lines = [header, *(_cells(r) for r in rows)]
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    text = [
        "  ".join(c.ljust(w) for c, w in zip(line, widths, strict=True)).rstrip()
        for line in lines
    ]
    text.insert(1, "  ".join("-" * w for w in widths))
    framework = (report.get("peer") or {}).get("framework", "the peer")
    notes = ratio_notes(ratios(rows), framework)
    return "\n".join(text) + (f"\n{notes}" if notes else "")
