"""Tables of the benchmarks that are scripts of their own, not
``keras-skip bench`` runs: the wrapper on a local step
(``python -m keras_skip.bench.step_overhead``), a first fit against Keras'
own (``python -m keras_skip.bench.first_fit_scale``), the cost of choosing the
interval (``python -m keras_skip.bench.overhead``), the slot policies
(``benchmarks/optimizer_state.py``) and an average spread over several steps
(``benchmarks/overlap_span.py``). :mod:`keras_skip.bench.reports.tables` prints them.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence


def wrapper_table(rows: list[dict]) -> str:
    """The wrapper's cost on a local step: median ratio and extremes of the
    interleaved pairs, in wall time and CPU time."""
    lines = [
        "| `steps_per_execution` | SGD ms / step | wrapped ms / step "
        "| wrapped / SGD, wall time | wrapped / SGD, CPU time |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['steps_per_execution']} | {r['bare_ms_per_step']:.2f} "
            f"| {r['wrapped_ms_per_step']:.2f} "
            f"| {r['ratio']:.3f} ({r['ratio_min']:.2f}-{r['ratio_max']:.2f}) "
            f"| {r['cpu_ratio']:.3f} "
            f"({r['cpu_ratio_min']:.2f}-{r['cpu_ratio_max']:.2f}) |"
        )
    return "\n".join(lines) + "\n"


def first_fit_table(rows: list[dict]) -> str:
    """A first fit's CPU time with one step branch against the condition at
    every step: medians, and the ratio's median and extremes."""
    lines = [
        "| inner | interval | fragments, overlap | CPU s, one branch "
        "| CPU s, condition | one branch / condition, CPU time | wall time "
        "| same weights |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['inner']} | {r['interval']} "
            f"| {r.get('fragments', 1)}, {r.get('overlap', 0)} "
            f"| {r['one_branch_cpu_seconds']:.2f} | {r['condition_cpu_seconds']:.2f} "
            f"| {r['cpu_ratio']:.3f} "
            f"({r['cpu_ratio_min']:.2f}-{r['cpu_ratio_max']:.2f}) "
            f"| {r['wall_ratio']:.3f} "
            f"({r['wall_ratio_min']:.2f}-{r['wall_ratio_max']:.2f}) "
            f"| {'yes' if r['same_weights'] else 'no'} |"
        )
    return "\n".join(lines) + "\n"


def first_fit_scale_table(rows: list[dict]) -> str:
    """A first fit against Keras' own, per depth of the model: the medians'
    wall time, and the ratios' median and extremes in wall and CPU time."""
    lines = [
        "| hidden layers | variables | Keras s | skip s | streaming s "
        "| skip / Keras | streaming / Keras | streaming / Keras, CPU time |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        ratios = [
            f"{r[name]:.2f}x ({r[name + '_min']:.2f}-{r[name + '_max']:.2f})"
            for name in ("skip_ratio", "streaming_ratio", "streaming_cpu_ratio")
        ]
        lines.append(
            f"| {r['layers']} | {r['variables']} | {r['keras_seconds']:.2f} "
            f"| {r['skip_seconds']:.2f} | {r['streaming_seconds']:.2f} "
            f"| {' | '.join(ratios)} |"
        )
    return "\n".join(lines) + "\n"


def interval_table(rows: list[dict]) -> str:
    """What each way of choosing the interval spent on choosing, against
    :class:`~keras_skip.AdaptiveIntervalCallback` (the first row)."""
    ours = rows[0]["choosing_seconds"]
    lines = [
        "| strategy | interval | choosing: wall time | of which tracing "
        "| collectives | bytes / replica | x ours | total training | val accuracy |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        tracing = r["tracing_seconds"]
        lines.append(
            f"| {r['strategy']} | {r['interval']} "
            f"| {r['choosing_seconds'] * 1e3:,.1f} ms "
            f"| {'in trials' if tracing is None else f'{tracing * 1e3:.1f} ms'} "
            f"| {r['collectives']} | {r['bytes_sent']:,} "
            f"| {r['choosing_seconds'] / ours:,.0f}x | {r['total_seconds']:.1f} s "
            f"| {r['val_accuracy']:.4f} |"
        )
    return "\n".join(lines) + "\n"


def slots_table(rows: list[dict]) -> str:
    """Per inner optimizer and ``optimizer_state``: the mean validation
    accuracy over the seeds (their range) and the megabytes per average."""
    seeds = len(rows[0]["seeds"])
    lines = [
        "| inner optimizer | `optimizer_state` "
        f"| val accuracy, mean of {seeds} seeds (range) | MB per average |",
        "|---|---|---|---|",
    ]
    for r in rows:
        accuracies = r["val_accuracy"]
        mean = sum(accuracies) / len(accuracies)
        spread = max(accuracies) - min(accuracies)
        lines.append(
            f"| {r['inner']} | {r['optimizer_state']} | {mean:.4f} ({spread:.4f}) "
            f"| {r['megabytes_per_average']:.2f} |"
        )
    return "\n".join(lines) + "\n"


def span_table(results: Sequence[dict]) -> str:
    """One row per run: the workers' medians of local steps, one all-reduce,
    the two one after the other and together (the median over workers, and
    their range), and the share of the shorter one hidden."""
    lines = [
        "| workers, one-way latency | local steps | one all-reduce "
        "| one after the other | together | hidden |",
        "|---|---|---|---|---|---|",
    ]

    def seconds(values):
        return (
            f"{statistics.median(values):.2f} s ({min(values):.2f}-{max(values):.2f})"
        )

    for result in results:
        workers, arguments = result["workers"], result["arguments"]
        column = {key: [w[key] for w in workers] for key in workers[0]}
        hidden = column["hidden"]
        lines.append(
            f"| {arguments['workers']}, {arguments['latency'].replace('ms', ' ms')} "
            f"| {arguments['steps']} in {seconds(column['steps'])} "
            f"| {seconds(column['all_reduce'])} | {seconds(column['sequential'])} "
            f"| {seconds(column['together'])} "
            f"| {statistics.median(hidden):.0%} ({min(hidden):.0%}-{max(hidden):.0%}) |"
        )
    return "\n".join(lines) + "\n"
