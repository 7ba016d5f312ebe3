"""The planner against the benchmark's committed runs: predicted and measured
time per steady epoch, per run and method.

Each run's inputs are what a user would give ``keras-skip plan``: the
workers, the link's rate and latency, the model's size (from the run's
payload), the steps of an epoch, and the step time, which is the run's own
no-communication epoch over its steps (or, for a run without one, the median
of that of the runs of the same workload and number of workers).

    python -m keras_skip.bench.planner.check [RESULTS_DIR]
"""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib
import statistics
import sys

from keras_skip import planner
from keras_skip.bench.reports.results import steady_epoch_seconds

#: Runs that measure the inputs, not a method the planner predicts.
_INPUTS = ("nocomm", "solo")


@dataclasses.dataclass(frozen=True)
class Check:
    """One method of one committed run, predicted and measured."""

    run: str
    method: str
    workers: int
    bandwidth: str
    latency: str
    interval: int
    step_time: float
    step_time_source: str
    predicted: float
    measured: float

    @property
    def error(self) -> float:
        """Relative error of the prediction: ``predicted / measured - 1``."""
        return self.predicted / self.measured - 1


def measured_epoch_seconds(method: dict) -> float:
    """The method's steady epoch time: the median of its epochs after the
    first (which traces); for an adaptive run, after the second, since the
    decision's epoch can include part of the probe."""
    epochs = method["epochs"]
    if method.get("decision"):
        epochs = epochs[1:]
    return steady_epoch_seconds(epochs)


def _step_time(run: dict) -> float | None:
    for method in run["methods"]:
        if method["name"] == "nocomm":
            return steady_epoch_seconds(method["epochs"]) / _steps(method)
    return None


def _steps(method: dict) -> int:
    return method["epochs"][0]["iterations"]


def _params(run: dict) -> int:
    """The model's trainable values: the payload of an average of the whole
    model (a method without fragments), in its wire type."""
    for method in run["methods"]:
        if method["synchronizations"] and "stream" not in method["name"]:
            width = 2 if "compress" in method["name"] else 4
            return method["payload_bytes"] // method["synchronizations"] // width
    raise ValueError("a run needs a method that averages the whole model")


def _family(run: dict) -> tuple[str, int]:
    return run["workload"].removesuffix("-noniid"), run["workers"]


def load_runs(directory: str | pathlib.Path) -> dict[str, dict]:
    """Every committed benchmark run (``results.json`` of ``keras-skip
    bench``) in ``directory``, by file name."""
    runs = {}
    for path in sorted(pathlib.Path(directory).glob("*.json")):
        with open(path) as f:
            run = json.load(f)
        if isinstance(run, dict) and "methods" in run and "arguments" in run:
            runs[path.name] = run
    return runs


def checks(directory: str | pathlib.Path, **constants) -> list[Check]:
    """A :class:`Check` for every method of every committed run in
    ``directory``; ``constants`` override :class:`keras_skip.planner.Link`'s
    and ``overlap_share``."""
    runs = load_runs(directory)
    overlap_share = constants.pop("overlap_share", planner.OVERLAP_SHARE)
    by_family: dict[tuple[str, int], list[float]] = {}
    for run in runs.values():
        step_time = _step_time(run)
        if step_time is not None:
            by_family.setdefault(_family(run), []).append(step_time)
    result = []
    for name, run in runs.items():
        step_time, source = _step_time(run), "the run's"
        if step_time is None:
            step_time = statistics.median(by_family[_family(run)])
            source = "median of the workload's runs"
        arguments = run["arguments"]
        link = planner.Link.from_text(
            arguments["bandwidth"], arguments["latency"], **constants
        )
        for method in run["methods"]:
            label = method["name"]
            if label in _INPUTS:
                continue
            compressed = "compress" in method["name"]
            workload = planner.Workload(
                params=_params(run),
                step_time=step_time,
                steps_per_epoch=_steps(method),
            )
            if method["name"] == "sync":
                prediction = planner.synchronous(workload, run["workers"], link)
            else:
                overlap = "overlap" in method["name"]
                prediction = planner.skip(
                    workload,
                    run["workers"],
                    link,
                    interval=method["intervals"][-1],
                    compression=arguments.get("compression") if compressed else None,
                    overlap=(arguments.get("overlap_steps") or 1) if overlap else 0,
                    overlap_share=overlap_share,
                    fragments=arguments["fragments"] if "stream" in label else 1,
                    boundary="latest" if label.endswith("-latest") else "full",
                )
            result.append(
                Check(
                    run=name,
                    method=method["name"],
                    workers=run["workers"],
                    bandwidth=arguments["bandwidth"],
                    latency=arguments["latency"],
                    interval=prediction.interval,
                    step_time=step_time,
                    step_time_source=source,
                    predicted=prediction.epoch_seconds,
                    measured=measured_epoch_seconds(method),
                )
            )
    return result


def markdown_table(found: list[Check]) -> str:
    """The checks as a Markdown table, one row per run and method."""
    lines = [
        "| run | method | workers | link | interval | step (ms) | predicted (s) "
        "| measured (s) | error |",
        "|---|---|---:|---|---:|---:|---:|---:|---:|",
    ]
    for c in found:
        step = f"{c.step_time * 1e3:.1f}" + (
            "" if c.step_time_source == "the run's" else "*"
        )
        lines.append(
            f"| {c.run.removesuffix('.json')} | {c.method} | {c.workers} "
            f"| {c.bandwidth}, {c.latency} | {c.interval} | {step} "
            f"| {c.predicted:.2f} | {c.measured:.2f} | {c.error:+.0%} |"
        )
    return "\n".join(lines)


def summary(found: list[Check]) -> str:
    errors = [abs(c.error) for c in found]
    return (
        f"{len(found)} methods of {len({c.run for c in found})} runs: median "
        f"|error| {statistics.median(errors):.0%}, largest {max(errors):.0%}, "
        f"{sum(e <= 0.25 for e in errors)} within 25%"
    )


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    directory = argv[0] if argv else "docs/results"
    found = checks(directory)
    if not found:
        print(f"No benchmark runs in {directory}.", file=sys.stderr)
        return 1
    print(markdown_table(found))
    print()
    print(summary(found))
    return 0 if all(math.isfinite(c.error) for c in found) else 1


if __name__ == "__main__":
    raise SystemExit(main())
