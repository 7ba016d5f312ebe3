"""The methods the benchmark compares: their names, labels and worker settings."""

from __future__ import annotations

import argparse

from keras_skip.bench.workers.worker import OPTION_METHODS

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


def method_plan(args: argparse.Namespace) -> list[tuple[str, str, dict]]:
    """``(name, label, worker config overrides)`` for every method to run."""
    plan = []
    for method in args.methods:
        plan.extend(_runs_of(method, args))
    return plan


def _runs_of(method: str, args: argparse.Namespace) -> list[tuple[str, str, dict]]:
    if method == "sync":
        return [("sync", "synchronous SGD", {"method": "sync"})]
    if method == "local":
        label = f"local SGD (interval {args.interval})"
        return [("local", label, {"method": "local"})]
    if method == "skip":
        label = f"skip+correction (interval {args.interval})"
        return [("skip", label, {"method": "skip"})]
    if method == "adaptive":
        return _adaptive_runs(args)
    if method == "adacomm":
        return [("adacomm", "AdaComm-style local SGD", {"method": "adacomm"})]
    if method in OPTION_METHODS:
        return [(method, _option_label(method, args), {"method": method})]
    if method in ("nocomm", "solo"):
        return [_unaveraged_run(method, args)]
    return []


def _adaptive_runs(args: argparse.Namespace) -> list[tuple[str, str, dict]]:
    """One run per target ratio, named by it when there are several."""
    runs = []
    for ratio in args.target_ratios:
        name = "adaptive" if len(args.target_ratios) == 1 else f"adaptive@{ratio:g}"
        runs.append(
            (
                name,
                f"skip+correction, adaptive (target_ratio {ratio:g})",
                {"method": "adaptive", "target_ratio": ratio},
            )
        )
    return runs


def _option_label(method: str, args: argparse.Namespace) -> str:
    parts = []
    if "outer" in method:
        parts.append(f"Nesterov outer {args.outer_learning_rate:g}")
    if "compress" in method:
        parts.append(f"{args.compression} averages")
    if "overlap" in method:
        steps = getattr(args, "overlap_steps", 1)
        parts.append(
            "overlapped averages"
            if steps == 1
            else f"averages overlapped over {steps} steps"
        )
    if "stream" in method:
        parts.append(f"{getattr(args, 'fragments', 2)} fragments")
    if method.endswith("-latest"):
        parts.append("latest averages at epoch ends")
    return f"skip+correction, {', '.join(parts)} (interval {args.interval})"


def _unaveraged_run(method: str, args: argparse.Namespace) -> tuple[str, str, dict]:
    """The no-communication bound or the independent processes: their own
    epoch budget, and no stop at the target."""
    label = (
        "no communication (bound)"
        if method == "nocomm"
        else f"{args.workers} independent processes (no cluster)"
    )
    return (
        method,
        label,
        {"method": method, "epochs": args.nocomm_epochs, "stop_at": None},
    )
