"""The efficiency map's heat map: cells by methods, against each cell's best.

    python -m keras_skip.bench.efficiency.report heatmap RESULTS.json IMAGE.png

Needs matplotlib (the ``test`` and ``demo`` extras install it).
"""

from __future__ import annotations

import pathlib

from keras_skip.bench.efficiency.summary import methods_of, summarize


def heat_values(result: dict):
    """The heat map's matrices: ``(methods, rows, steps, finals,
    not_reached)``, rows ``(cell, summary)``; ``steps`` the ratio of steps
    to the cell's best (NaN where not run or not reached, which
    ``not_reached`` marks), ``finals`` the quality against the best, 1 for
    the best and lower for worse (accuracy / best accuracy, best loss /
    loss)."""
    import numpy as np

    methods = methods_of(result)
    rows = [(c, summarize(result, c)) for c in result["cells"]]
    rows = [(c, s) for c, s in rows if s]
    shape = (len(rows), len(methods))
    steps, finals = np.full(shape, np.nan), np.full(shape, np.nan)
    not_reached = np.zeros(shape, dtype=bool)
    for i, (cell, summary) in enumerate(rows):
        higher = result["workloads"][cell["workload"]]["metric"] == "accuracy"
        for j, method in enumerate(methods):
            m = summary.get(method)
            if m is None:
                continue
            if m["steps_vs_best"] is None:
                not_reached[i, j] = True
            else:
                steps[i, j] = m["steps_vs_best"]
            ratio = m["final_vs_best"]
            finals[i, j] = ratio if higher else 1 / ratio
    return methods, rows, steps, finals, not_reached


def heatmap(result: dict, image: str | pathlib.Path) -> None:
    """Cells (rows) by methods (columns), yellow the best of each cell on
    both sides: steps to the target against the best of the cell (left;
    grey, "n.r.", where it was not reached), and the final metric's quality
    against the best (right: accuracy / best accuracy, or best loss / loss,
    so 1 is the best and lower is worse for every workload), as a PNG.
    Needs matplotlib."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    methods, rows, steps, finals, not_reached = heat_values(result)
    figure, axes = plt.subplots(1, 2, figsize=(12, 1.2 + 0.4 * len(rows)))
    panels = (
        (steps, "viridis_r", "steps to target / best (grey: not reached)"),
        (finals, "viridis", "final metric vs best (accuracy / best; best loss / loss)"),
    )
    for axis, (values, colours, title) in zip(axes, panels, strict=True):
        shown = axis.imshow(values, cmap=colours, aspect="auto")
        if values is steps:
            grey = np.where(not_reached, 1.0, np.nan)
            axis.imshow(grey, cmap="Greys", vmin=0, vmax=4, aspect="auto")
        axis.set_xticks(range(len(methods)), methods, rotation=30, ha="right")
        axis.set_yticks(range(len(rows)), [c["id"] for c, _ in rows], fontsize=7)
        axis.set_title(title, fontsize=9)
        for (i, j), value in np.ndenumerate(values):
            if values is steps and not_reached[i, j]:
                axis.text(j, i, "n.r.", ha="center", va="center", fontsize=7)
            elif not np.isnan(value):
                axis.text(j, i, f"{value:.2f}", ha="center", va="center", fontsize=7)
        figure.colorbar(shown, ax=axis)
    figure.tight_layout()
    figure.savefig(image, dpi=110)
    plt.close(figure)
