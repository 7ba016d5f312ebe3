"""Tables and heat maps of the efficiency map, from its JSON results.

    python -m keras_skip.bench.efficiency.report KIND docs/results/efficiency.json
    python -m keras_skip.bench.efficiency.report refresh docs/efficiency.md
    python -m keras_skip.bench.efficiency.report heatmap RESULTS.json IMAGE.png

``KIND`` is one of:

- ``steps``: per cell (a row) and method (a column), the steps to the
  target, the mean over seeds, and its ratio to the best method of the cell;
- ``final``: the same for the final validation metric (accuracy, or for the
  language model loss), and its ratio to the best;
- ``detail``: a row per cell and method: seeds, steps to the target (mean
  and range), final metric (mean and range, perplexity for the language
  model), averages;
- ``coverage``: every cell of the full map, and how many of its runs the
  results hold;
- ``targets``: the map's targets, each with the ratio it is judged by and
  whether it is met (:func:`targets_table`);
- ``regimes``: which method for which data and inner optimizer, beside
  plain local SGD and DiLoCo in the cell that shows it
  (:func:`regimes_table`, printed in the guide);
- ``intervals``: on skewed shards, each method's final accuracy below
  synchronous training's, per interval, and the longest interval at which
  the default kept accuracy (:func:`intervals_table`, the adaptive
  interval's warning follows it);
- ``equal_bytes``: the default at each interval against averaged second
  moments (`skip/second`) at twice that interval, which sends as many bytes
  per step with AdamW (:func:`equal_bytes_table`).

Steps to the target are read from each run's curve on the cell's grid:
the first evaluation (all right after an average) at which the metric
reaches the workload's target. ``refresh`` prints again every table of a
page between its markers::

    <!-- generated: python -m keras_skip.bench.efficiency.report KIND FILE -->
    ...
    <!-- end of generated table -->

with the file named relative to the repository's root (the page's
grandparent directory).
"""

from __future__ import annotations

import pathlib
import sys
from collections.abc import Sequence
from dataclasses import replace

from keras_skip.bench.efficiency import cells as map_cells
from keras_skip.bench.efficiency.summary import load, methods_of, summarize
from keras_skip.bench.reports import pages

NOT_REACHED = "not reached"


def _label(cell: dict, result: dict) -> str:
    seeds = len(cell["seeds"])
    return f"`{cell['id']}` ({seeds} seed{'s' if seeds > 1 else ''})"


def _matrix(result: dict, entry) -> str:
    methods = methods_of(result)
    lines = [
        "| cell | target | " + " | ".join(methods) + " |",
        "|---|---|" + "---|" * len(methods),
    ]
    for cell in result["cells"]:
        summary = summarize(result, cell)
        if not summary:
            continue
        spec = result["workloads"][cell["workload"]]
        sign = ">=" if spec["metric"] == "accuracy" else "<="
        target = f"{spec['metric']} {sign} {spec['target']:g}"
        row = [entry(summary[m]) if m in summary else "" for m in methods]
        lines.append(f"| {_label(cell, result)} | {target} | " + " | ".join(row) + " |")
    return "\n".join(lines) + "\n"


def steps_table(result: dict) -> str:
    """Steps to the target per cell and method, and ratio to the best."""

    def entry(m):
        if m["mean_steps"] is None:
            return NOT_REACHED
        return f"{m['mean_steps']:.0f} ({m['steps_vs_best']:.2f}x)"

    return _matrix(result, entry)


def final_table(result: dict) -> str:
    """Final validation metric per cell and method, and ratio to the best."""
    return _matrix(
        result, lambda m: f"{m['mean_final']:.4f} ({m['final_vs_best']:.3f}x)"
    )


def detail_table(result: dict) -> str:
    """A row per cell and method, every seed."""
    lines = [
        "| cell | method | seeds | steps to target (range) | vs best "
        "| final metric (range) | vs best | perplexity | averages |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for cell in result["cells"]:
        summary = summarize(result, cell)
        for method in map_cells.METHODS:
            if method not in summary:
                continue
            m = summary[method]
            steps = [s for s in m["steps"] if s is not None]
            if m["mean_steps"] is None:
                shown = f"{NOT_REACHED} ({len(steps)} of {m['seeds']} seeds)"
                ratio = ""
            else:
                shown = f"{m['mean_steps']:.0f} ({min(steps)}-{max(steps)})"
                ratio = f"{m['steps_vs_best']:.2f}x"
            final = (
                f"{m['mean_final']:.4f} ({min(m['finals']):.4f}-{max(m['finals']):.4f})"
            )
            perplexity = "" if m["perplexity"] is None else f"{m['perplexity']:.2f}"
            if result["workloads"][cell["workload"]]["metric"] == "accuracy":
                perplexity = ""
            lines.append(
                f"| `{cell['id']}` | {map_cells.METHODS[method].label} | {m['seeds']} "
                f"| {shown} | {ratio} | {final} | {m['final_vs_best']:.3f}x "
                f"| {perplexity} | {m['averages']} |"
            )
    return "\n".join(lines) + "\n"


def coverage_table(result: dict) -> str:
    """Every cell of the full map: the runs it needs and those done."""
    done = {r["key"] for r in result["runs"]}
    lines = ["| cell | methods | seeds | runs done |", "|---|---|---|---|"]
    for cell in map_cells.full_map():
        keys = {r.key for r in map_cells.runs_of([cell])}
        lines.append(
            f"| `{cell.id}` | {len(cell.methods)} | {len(cell.seeds)} "
            f"| {len(keys & done)} of {len(keys)} |"
        )
    return "\n".join(lines) + "\n"


#: The advice of the guide's "which method" table: ``(data, inner
#: optimizer, what to use, the cell that shows it, its method there)``.
REGIMES = (
    (
        "shuffled (IID)",
        "AdamW",
        "the defaults",
        "cnn/adamw/iid/H128/r8",
        "skip",
    ),
    (
        "skewed (Dirichlet 0.1 labels)",
        "AdamW",
        '`optimizer_state="average_second_moments"`',
        "cnn/adamw/dirichlet0.1/H128/r8",
        "skip/second",
    ),
    (
        "skewed, with an outer step",
        "AdamW",
        "the same, with `SGD(0.7, momentum=0.5, nesterov=True)` as outer optimizer",
        "cnn/adamw/dirichlet0.1/H128/r8",
        "second+outer0.5",
    ),
    (
        "skewed (source files)",
        "AdamW",
        '`optimizer_state="average_second_moments"`',
        "lm/adamw/files/H128/r8",
        "skip/second",
    ),
    (
        "skewed (Dirichlet 0.1 labels)",
        "SGD with momentum",
        "the defaults",
        "cnn/sgdm/dirichlet0.1/H128/r8",
        "skip",
    ),
)


def regimes_table(result: dict) -> str:
    """Per regime of :data:`REGIMES`: the method to use, and in the cell
    that shows it its steps to the target and final metric, beside plain
    local SGD's and DiLoCo's (mean over the cell's seeds)."""
    cells = {c["id"]: c for c in result["cells"]}
    lines = [
        "| data | inner optimizer | use | cell (seeds) | steps to target: this, "
        "local SGD, DiLoCo | final metric: this, local SGD, DiLoCo |",
        "|---|---|---|---|---|---|",
    ]
    for data, inner, use, cell_id, method in REGIMES:
        cell = cells.get(cell_id)
        summary = summarize(result, cell) if cell else {}
        chosen = [summary.get(m) for m in (method, "local", "outer")]
        if chosen[0] is None:
            lines.append(f"| {data} | {inner} | {use} | `{cell_id}` | not run | |")
            continue

        def steps(m):
            if m is None:
                return "not run"
            return NOT_REACHED if m["mean_steps"] is None else f"{m['mean_steps']:.0f}"

        def final(m):
            return "not run" if m is None else f"{m['mean_final']:.4f}"

        lines.append(
            f"| {data} | {inner} | {use} | `{cell_id}` ({chosen[0]['seeds']}) "
            f"| {', '.join(map(steps, chosen))} | {', '.join(map(final, chosen))} |"
        )
    return "\n".join(lines) + "\n"


#: The default against local SGD and DiLoCo in a key cell: at most this
#: fraction of their steps to the target.
STEP_RATIO_TARGET = 0.8
#: The default on IID shards: a final metric within this fraction of the best.
IID_TOLERANCE = 0.05
#: The share of cells in which the default is the best method or within one
#: seed spread of it.
SHARE_TARGET = 0.8
#: The default, and the methods that communicate as often as it does.
DEFAULT = "skip"
#: The option the key cells also judge: averaged second moments.
OPTION = "skip/second"


def _better(final: float, other: float, higher: bool) -> bool:
    return final > other if higher else final < other


def _beats(ours: dict, other: dict, higher: bool) -> tuple[str, bool]:
    """``(ratio shown, met)``: a method's steps to the target against
    another's (met at <= :data:`STEP_RATIO_TARGET`, or if the other never
    reached it), or else its final metric at the same steps."""
    finals = f"final {ours['mean_final']:.4f} vs {other['mean_final']:.4f}"
    better = _better(ours["mean_final"], other["mean_final"], higher)
    if ours["mean_steps"] is None:
        return f"not reached; {finals}", better
    if other["mean_steps"] is None:
        return f"reached, the other not; {finals}", True
    ratio = ours["mean_steps"] / other["mean_steps"]
    return f"{ratio:.2f}x the steps; {finals}", ratio <= STEP_RATIO_TARGET or better


def _best(summary: dict, higher: bool) -> str:
    """The method with the best mean final metric, but synchronous training."""
    rivals = [n for n in summary if n != "sync"]
    pick = max if higher else min
    return pick(rivals, key=lambda n: summary[n]["mean_final"])


def _spread(summary: dict, names) -> float | None:
    """The larger range over seeds of the final metric of the methods
    `names`, of those run with several seeds; None if none was."""
    ranges = [
        max(summary[n]["finals"]) - min(summary[n]["finals"])
        for n in names
        if n in summary and summary[n]["seeds"] > 1
    ]
    return max(ranges, default=None)


def targets_table(result: dict) -> str:
    """The map's targets, from the runs the results hold.

    - In each key cell (AdamW, the skewed shards, interval 128, 8 replicas),
      the default against local SGD and against DiLoCo: at most
      :data:`STEP_RATIO_TARGET` of their steps to the target, or a better
      final metric at the same number of steps; and the same for
      :data:`OPTION` (second moments averaged).
    - On the key cell's IID twin: the default's (and :data:`OPTION`'s)
      final metric within :data:`IID_TOLERANCE` of the best method's that
      skips.
    - Over every cell that ran the default and another method: the share in
      which the default's final metric is the best, or within one seed
      spread of the best, among the methods that skip (synchronous training
      communicates at every step and is not a rival here). One seed spread
      is the larger range over seeds of the default's and the best method's
      final metric in the cell, or, in a cell of one seed, the largest such
      range in the cells of its workload run with several seeds (its key
      cell; the MLP's cell with 3 seeds), 0 where there is none.
    """
    cells = {c["id"]: c for c in result["cells"]}
    summaries = {i: summarize(result, c) for i, c in cells.items()}
    lines = ["| target | measured | met |", "|---|---|---|"]
    spreads: dict[str, float] = {}
    for cell_id, summary in summaries.items():
        workload = cells[cell_id]["workload"]
        higher = result["workloads"][workload]["metric"] == "accuracy"
        if DEFAULT in summary:
            spread = _spread(summary, (DEFAULT, _best(summary, higher)))
            if spread is not None:
                spreads[workload] = max(spreads.get(workload, 0.0), spread)
    for key in map_cells.full_map()[:2]:
        summary = summaries.get(key.id, {})
        higher = result["workloads"].get(key.workload, {}).get("metric") == "accuracy"
        for subject, name in ((DEFAULT, "default"), (OPTION, f"`{OPTION}`")):
            ours = summary.get(subject)
            for rival in ("local", "outer"):
                label = (
                    f"`{key.id}`: {name} vs {map_cells.METHODS[rival].label}, "
                    f"<= {STEP_RATIO_TARGET:g}x the steps"
                )
                if ours is None or rival not in summary:
                    lines.append(f"| {label} | not run | |")
                    continue
                seeds = min(ours["seeds"], summary[rival]["seeds"])
                shown, met = _beats(ours, summary[rival], higher)
                lines.append(
                    f"| {label} | {shown} ({seeds} seed{'s' * (seeds > 1)}) "
                    f"| {'yes' if met else 'no'} |"
                )
        twin = replace(key, shards="iid").id
        summary = summaries.get(twin, {})
        for subject, name in ((DEFAULT, "default"), (OPTION, f"`{OPTION}`")):
            label = (
                f"`{twin}`: {name} within {IID_TOLERANCE:.0%} of the best that skips"
            )
            if subject not in summary:
                lines.append(f"| {label} | not run | |")
                continue
            best = summary[_best(summary, higher)]["mean_final"]
            ratio = summary[subject]["mean_final"] / best
            met = ratio >= 1 - IID_TOLERANCE if higher else ratio <= 1 + IID_TOLERANCE
            lines.append(
                f"| {label} | final {ratio:.3f}x that best | {'yes' if met else 'no'} |"
            )
    counted, good = 0, []
    for cell_id, summary in summaries.items():
        rivals = {n: m for n, m in summary.items() if n != "sync"}
        if DEFAULT not in rivals or len(rivals) < 2:
            continue
        workload = cells[cell_id]["workload"]
        higher = result["workloads"][workload]["metric"] == "accuracy"
        best = _best(rivals, higher)
        spread = _spread(summary, (DEFAULT, best))
        spread = spreads.get(workload, 0.0) if spread is None else spread
        best = rivals[best]["mean_final"]
        counted += 1
        if abs(rivals[DEFAULT]["mean_final"] - best) <= spread:
            good.append(cell_id)
    label = f"default best or within one seed spread in >= {SHARE_TARGET:.0%} of cells"
    if counted:
        share = len(good) / counted
        met = "yes" if share >= SHARE_TARGET else "no"
        lines.append(
            f"| {label} | {len(good)} of {counted} cells ({share:.0%}) | {met} |"
        )
    else:
        lines.append(f"| {label} | no cell ran | |")
    return "\n".join(lines) + "\n"


#: The default "kept accuracy" at an interval when its final accuracy was at
#: most this fraction below synchronous training's in every skewed cell.
KEPT_LOSS = 0.10


def interval_losses(result: dict) -> dict[int, dict[str, list[tuple[str, float]]]]:
    """Per interval, per method: ``(cell id, loss)`` for every cell whose
    workload reports accuracy, on skewed shards, where the method and
    synchronous training both ran; ``loss = 1 - final / synchronous final``
    (mean over the cell's seeds)."""
    found: dict[int, dict[str, list[tuple[str, float]]]] = {}
    for cell in result["cells"]:
        spec = result["workloads"][cell["workload"]]
        if spec["metric"] != "accuracy" or cell["shards"] == "iid":
            continue
        summary = summarize(result, cell)
        sync = summary.get("sync")
        if sync is None:
            continue
        for method, m in summary.items():
            if method == "sync":
                continue
            loss = 1 - m["mean_final"] / sync["mean_final"]
            by_method = found.setdefault(cell["interval"], {})
            by_method.setdefault(method, []).append((cell["id"], loss))
    return dict(sorted(found.items()))


def longest_kept_interval(result: dict, method: str = DEFAULT) -> int | None:
    """The longest interval at which ``method`` ended at most
    :data:`KEPT_LOSS` below synchronous training in every skewed accuracy
    cell (``None`` if at none)."""
    kept = [
        interval
        for interval, by_method in interval_losses(result).items()
        if by_method.get(method)
        and max(loss for _, loss in by_method[method]) <= KEPT_LOSS
    ]
    return max(kept, default=None)


def intervals_table(result: dict) -> str:
    """Per interval (a row) and method (a column), on skewed shards: the
    range over cells of the final accuracy's loss against synchronous
    training, and the cells counted; then the longest kept interval."""
    losses = interval_losses(result)
    methods = [m for m in methods_of(result) if m != "sync"]
    methods = [m for m in methods if any(m in by for by in losses.values())]
    lines = [
        "| interval | cells | " + " | ".join(methods) + " |",
        "|---|---|" + "---|" * len(methods),
    ]
    for interval, by_method in losses.items():
        cells = sorted({c for pairs in by_method.values() for c, _ in pairs})
        row = []
        for method in methods:
            pairs = by_method.get(method)
            if not pairs:
                row.append("")
                continue
            low = min(loss for _, loss in pairs)
            high = max(loss for _, loss in pairs)
            span = f"{low:.1%}" if len(pairs) == 1 else f"{low:.1%} to {high:.1%}"
            row.append(f"{span} ({len(pairs)})")
        lines.append(f"| {interval} | {len(cells)} | " + " | ".join(row) + " |")
    kept = longest_kept_interval(result)
    lines.append("")
    lines.append(
        f"Longest interval at which the default ended at most {KEPT_LOSS:.0%} "
        f"below synchronous training in every skewed cell: {kept}."
    )
    return "\n".join(lines) + "\n"


def equal_bytes_table(result: dict) -> str:
    """The default at each interval of the map against `skip/second` at twice
    that interval, which sends as many bytes per step with AdamW (weights and
    second moments, half as often): per workload with AdamW on Dirichlet 0.1
    shards, steps to the target and final metric of both, and `skip/second`
    at the same interval, which sends twice the bytes."""
    cells = {c["id"]: c for c in result["cells"]}
    lines = [
        "| workload | interval H | default at H: steps, final | `skip/second` "
        "at 2H (equal bytes): steps, final | `skip/second` at H (twice the "
        "bytes): steps, final |",
        "|---|---|---|---|---|",
    ]

    def shown(cell_id: str, method: str) -> str:
        cell = cells.get(cell_id)
        m = summarize(result, cell).get(method) if cell else None
        if m is None:
            return "not run"
        steps = NOT_REACHED if m["mean_steps"] is None else f"{m['mean_steps']:.0f}"
        seeds = f" ({m['seeds']} seeds)" if m["seeds"] > 1 else ""
        return f"{steps}, {m['mean_final']:.4f}{seeds}"

    for workload in ("cnn", "mlp"):
        for half in map_cells.EQUAL_BYTES_INTERVALS:
            interval = half // 2
            at_h = f"{workload}/adamw/dirichlet0.1/H{interval}/r8"
            at_2h = f"{workload}/adamw/dirichlet0.1/H{half}/r8"
            lines.append(
                f"| {workload} | {interval} | {shown(at_h, DEFAULT)} "
                f"| {shown(at_2h, OPTION)} | {shown(at_h, OPTION)} |"
            )
    return "\n".join(lines) + "\n"


KINDS = {
    "steps": steps_table,
    "final": final_table,
    "detail": detail_table,
    "coverage": coverage_table,
    "targets": targets_table,
    "regimes": regimes_table,
    "intervals": intervals_table,
    "equal_bytes": equal_bytes_table,
}


def render(kind: str, path: str | pathlib.Path) -> str:
    """The table ``kind`` (one of :data:`KINDS`) of the results at ``path``."""
    if kind not in KINDS:
        raise ValueError(f"table kind {kind!r} is not one of {sorted(KINDS)}")
    return KINDS[kind](load(path))


GENERATED = pages.generated("keras_skip.bench.efficiency.report")


def refresh(page: str | pathlib.Path) -> int:
    """Prints again every generated table of ``page``; returns how many."""
    return pages.refresh(
        page, GENERATED, lambda kind, path, root: render(kind, root / path.strip())
    )


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    name = "python -m keras_skip.bench.efficiency.report"
    try:
        if len(argv) == 2 and argv[0] == "refresh":
            print(f"{refresh(argv[1])} tables printed again in {argv[1]}")
            return 0
        if len(argv) == 3 and argv[0] == "heatmap":
            from keras_skip.bench.efficiency import heat

            heat.heatmap(load(argv[1]), argv[2])
            return 0
        if len(argv) == 2 and argv[0] in KINDS:
            print(render(argv[0], argv[1]), end="")
            return 0
    except (ValueError, KeyError, OSError) as error:
        print(f"{name} {argv[0]}: {error}", file=sys.stderr)
        return 2
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
