"""The PNG plots of one run: accuracy against time and epochs, epoch time, drift."""

from __future__ import annotations

import pathlib
from collections.abc import Callable, Sequence

from keras_skip.bench.reports.results import MethodResult, training_seconds


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
    fig = _accuracy_plot(
        plt,
        trained,
        target,
        training_seconds,
        "training time (s, validation excluded, log scale)",
        log=True,
    )
    paths.append(_save(plt, fig, out_dir / "accuracy_vs_time.png"))
    nocomm = next((r for r in results if r.name == "nocomm"), None)
    if nocomm is not None:
        fig = _epoch_time_plot(plt, trained, nocomm.epoch_seconds)
        paths.append(_save(plt, fig, out_dir / "epoch_time.png"))
    fig = _accuracy_plot(plt, trained, target, lambda e: e["epoch"], "epoch")
    paths.append(_save(plt, fig, out_dir / "accuracy_vs_epoch.png"))
    drifting = [r for r in trained if any(e.get("drift") for e in r.epochs)]
    if drifting:
        fig = _drift_plot(plt, drifting)
        paths.append(_save(plt, fig, out_dir / "drift_vs_epoch.png"))
    return paths


def _save(plt, fig, path: pathlib.Path) -> str:
    fig.tight_layout()
    fig.savefig(str(path), dpi=120)
    plt.close(fig)
    return str(path)


def _accuracy_plot(
    plt,
    trained: Sequence[MethodResult],
    target: float,
    x_of: Callable[[dict], float],
    xlabel: str,
    log: bool = False,
):
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
    return fig


def _epoch_time_plot(plt, trained: Sequence[MethodResult], compute: float):
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
    return fig


def _drift_plot(plt, drifting: Sequence[MethodResult]):
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
    return fig
