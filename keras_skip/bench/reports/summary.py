"""The comparison of the methods of one run: its rows, ratios and table."""

from __future__ import annotations

from collections.abc import Sequence

from keras_skip.bench.reports import tables
from keras_skip.bench.reports.results import MethodResult


def default_target(results: Sequence[MethodResult]) -> float:
    """What synchronous SGD reached after the epoch budget, or without it the
    best final accuracy of any method."""
    sync = next((r for r in results if r.name == "sync"), None)
    if sync:
        return sync.final_accuracy
    return max((r.final_accuracy or 0 for r in results), default=0)


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
        elif r.name == "solo":
            rows.append({"method": r.label, "epoch_seconds": r.epoch_seconds})
        else:
            rows.append(_trained_row(r, target, sync_time, bound, nocomm))
    return rows


def _trained_row(
    r: MethodResult,
    target: float,
    sync_time: float | None,
    bound: float | None,
    nocomm: MethodResult | None,
) -> dict:
    seconds, epochs = r.time_to(target)
    return {
        "method": r.label,
        "time_to_target": seconds,
        "epochs_to_target": epochs,
        "vs_sync": None if seconds is None or not sync_time else seconds / sync_time,
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
            name.replace("-overlap", "") if name != "overlap" else "skip"
        )
        if base is None or base is r:
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


def table_notes(
    hidden: dict[str, float], independent: float | None, workers: int
) -> str:
    """The lines printed under the table: what overlapping hid, and what the
    cluster costs where nothing is averaged."""
    text = ""
    for name, share in hidden.items():
        text += (
            f"\n{name}: overlapping hid {share:.1%} of the communication time "
            "per epoch (steady epochs, against the same method without it "
            "and the no-communication run)"
        )
    if independent is not None:
        text += (
            f"\nno communication: its epoch took {independent:.2f}x the "
            f"epoch of {workers} independent processes (steady epochs)"
        )
    return text


def trace_hidden(results: Sequence[MethodResult]) -> dict[str, dict]:
    """For each traced method with delayed averages, from its workers'
    traces: the seconds its all-reduces took, ran beside the steps and kept
    the training thread waiting, the share hidden (the smallest over the
    workers, since an average waits for the slowest), and a local step's
    mean seconds alone and with an all-reduce beside it (the worst over the
    workers)."""
    shares = {}
    for r in results:
        traced = [t for t in r.traces or [] if t["hidden"] is not None]
        if not traced:
            continue

        shares[r.name] = {
            "hidden": min(t["hidden"] for t in traced),
            "all_reduce": max(t["all_reduce"] for t in traced),
            "beside": max(t["beside"] for t in traced),
            "waited": max(t["waited"] for t in traced),
            "step_alone": _worst_step(traced, "alone"),
            "step_beside": _worst_step(traced, "beside"),
        }
    return shares


def _worst_step(traced: list[dict], key: str) -> float | None:
    values = [t["step_seconds"][key] for t in traced]
    values = [v for v in values if v is not None]
    return max(values) if values else None


def trace_notes(shares: dict[str, dict]) -> str:
    """The traces' lines under the table."""
    text = ""
    for name, s in shares.items():
        steps = ""
        if s["step_alone"] is not None and s["step_beside"] is not None:
            steps = (
                f"; a local step took {s['step_alone'] * 1e3:.1f} ms alone and "
                f"{s['step_beside'] * 1e3:.1f} ms with an all-reduce beside it"
            )
        text += (
            f"\n{name} (traces): all-reduces {s['all_reduce']:.2f} s, "
            f"{s['beside']:.2f} s of them beside the steps, waited for "
            f"{s['waited']:.2f} s: {s['hidden']:.1%} hidden{steps}"
        )
    return text
