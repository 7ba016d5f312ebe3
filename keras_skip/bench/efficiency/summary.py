"""Reading the efficiency map's results: a run's steps to the target, and
per cell each method's steps and final metric against the cell's best.

The report's tables (:mod:`keras_skip.bench.efficiency.report`) and its
heat map (:mod:`keras_skip.bench.efficiency.heat`) are both made from these.
"""

from __future__ import annotations

import json
import pathlib
import statistics

from keras_skip.bench.efficiency import cells as map_cells


def load(path: str | pathlib.Path) -> dict:
    """The results file at ``path``."""
    return json.loads(pathlib.Path(path).read_text())


def steps_to_target(
    curve: list, target: float, higher_is_better: bool, grid: int
) -> int | None:
    """The first step of ``curve`` (``[step, loss, accuracy]`` rows) on the
    ``grid`` (or the last step) whose metric reaches ``target``."""
    last = curve[-1][0]
    for step, loss, accuracy in curve:
        if step == 0 or (step % grid and step != last):
            continue
        value = accuracy if higher_is_better else loss
        if (value >= target) if higher_is_better else (value <= target):
            return int(step)
    return None


def run_key(cell: dict, method: str, seed: int) -> str:
    cell_ = map_cells.Cell(
        cell["workload"],
        cell["inner"],
        cell["shards"],
        cell["interval"],
        cell["replicas"],
    )
    return map_cells.Run(cell_, method, seed).key


def summarize(result: dict, cell: dict) -> dict[str, dict]:
    """Per method of ``cell`` with runs in ``result``: the steps to the
    target and final metric of each seed, their means, and ratios to the
    best method of the cell (``None`` where no seed reached the target)."""
    spec = result["workloads"][cell["workload"]]
    higher = spec["metric"] == "accuracy"
    runs = {r["key"]: r for r in result["runs"]}
    found: dict[str, dict] = {}
    for method in cell["methods"]:
        steps, finals, perplexities, averages = [], [], [], []
        for seed in cell["seeds"]:
            run = runs.get(run_key(cell, method, seed))
            if run is None:
                continue
            steps.append(
                steps_to_target(run["curve"], spec["target"], higher, cell["grid"])
            )
            finals.append(run["final_accuracy"] if higher else run["final_loss"])
            perplexities.append(run.get("final_perplexity"))
            averages.append(run["averages"])
        if not finals:
            continue
        reached = [s for s in steps if s is not None]
        found[method] = {
            "seeds": len(finals),
            "steps": steps,
            # A seed that never reached the target counts as not reached.
            "mean_steps": statistics.mean(reached)
            if len(reached) == len(steps)
            else None,
            "finals": finals,
            "mean_final": statistics.mean(finals),
            "perplexity": (
                statistics.mean(perplexities) if None not in perplexities else None
            ),
            "averages": max(averages),
        }
    reached = [m["mean_steps"] for m in found.values() if m["mean_steps"] is not None]
    best_steps = min(reached, default=None)
    best_final = (
        (max if higher else min)(m["mean_final"] for m in found.values())
        if found
        else None
    )
    for m in found.values():
        m["steps_vs_best"] = (
            m["mean_steps"] / best_steps if m["mean_steps"] is not None else None
        )
        m["final_vs_best"] = m["mean_final"] / best_final if best_final else None
    return found


def methods_of(result: dict) -> list[str]:
    """The methods of the map that ``result``'s cells name, in the map's order."""
    present = {m for cell in result["cells"] for m in cell["methods"]}
    return [m for m in map_cells.METHODS if m in present]
