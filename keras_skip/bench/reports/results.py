"""What one method's run measured, read from its workers' result files."""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import pathlib


@dataclasses.dataclass
class MethodResult:
    name: str
    label: str
    epochs: list[dict]
    synchronizations: int
    payload_bytes: int
    wire_bytes: int | None
    intervals: list[int]
    decision: dict | None
    seconds: float
    #: Every worker's `keras_skip.tracing.summary`, with `--trace`.
    traces: list[dict] | None = None

    def time_to(self, target: float) -> tuple[float | None, int | None]:
        """Training time (validation excluded) and epochs until the end of
        the first epoch whose validation accuracy reaches ``target``."""
        for record in self.epochs:
            accuracy = record.get("val_accuracy")
            if accuracy is not None and accuracy >= target:
                return training_seconds(record), record["epoch"]
        return None, None

    def seconds_at(self, epochs: int) -> float:
        """Training time (validation excluded) at the end of epoch ``epochs``,
        first epoch and its tracing included: as measured, or past the last
        measured epoch extended by the steady epoch time."""
        if not self.epochs:
            return math.nan
        measured = min(epochs, len(self.epochs))
        extra = epochs - measured
        return training_seconds(self.epochs[measured - 1]) + extra * self.epoch_seconds

    @property
    def final_accuracy(self) -> float | None:
        return self.epochs[-1].get("val_accuracy") if self.epochs else None

    @property
    def epoch_seconds(self) -> float:
        """Median training time (validation excluded) of the epochs after the
        first, which includes tracing."""
        return steady_epoch_seconds(self.epochs)


def steady_epoch_seconds(epochs: list[dict]) -> float:
    """Median training time of the epochs after the first (or the first
    epoch's, if it is the only one)."""
    times = [training_seconds(r) for r in epochs]
    steady = sorted(b - a for a, b in itertools.pairwise(times))
    if not steady:
        return times[0] if times else math.nan
    return steady[len(steady) // 2]


def training_seconds(record: dict) -> float:
    """Wall time since the start of ``fit`` at the end of an epoch, minus the
    time spent on validation, which costs every method the same and only
    measures progress."""
    return record["seconds"] - record.get("validation_seconds", 0.0)


def read_worker_measurements(
    directory: pathlib.Path, workers: int, slowest: bool = False
) -> dict:
    """Worker 0's ``worker-0.json`` in ``directory``; with ``slowest``, with
    the epochs of the worker whose steady epoch was the slowest instead."""
    with open(directory / "worker-0.json") as f:
        measurements = json.load(f)
    if slowest:
        # Independent processes end their epochs apart: the slowest one's
        # epoch is what a cluster's epoch would compare with.
        every = []
        for i in range(workers):
            with open(directory / f"worker-{i}.json") as f:
                every.append(json.load(f)["epochs"])
        measurements["epochs"] = max(
            every, key=lambda epochs: steady_epoch_seconds(epochs)
        )
    return measurements


def method_result(
    name: str,
    label: str,
    measurements: dict,
    wire_bytes: int | None,
    seconds: float,
    traces: list[dict] | None = None,
) -> MethodResult:
    """The :class:`MethodResult` of a method from its worker's measurements."""
    return MethodResult(
        name,
        label,
        measurements["epochs"],
        measurements["synchronizations"],
        measurements["payload_bytes"],
        wire_bytes,
        measurements["intervals"],
        measurements["decision"],
        seconds,
        traces,
    )
