"""Where the time goes: host-side events in the Chrome trace-event format.

While a :class:`Trace` is active (`keras_skip.TraceCallback` activates one
during `model.fit`), the parts of keras-skip that wait or exchange record
what they do on the host's clock: each execution of the train function
(its local steps, and how many averages it took inside), each boundary
average, validation, and each delayed average's copy, all-reduce (on its
own thread when it runs beside the steps), wait and landing. Nothing is
recorded, and almost nothing is spent, while no trace is active.

The file a trace writes opens in https://ui.perfetto.dev or
``chrome://tracing``: one process per worker, one track per thread, on the
wall clock, so the workers of one machine share a time axis.
:func:`summary` reads the numbers back: how long the all-reduces of
delayed averages took, how much of that the host waited for, and what
share hid behind local steps.

Framework-free: it imports neither TensorFlow nor Keras.
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import statistics
import threading
import time
from collections.abc import Iterator

#: Track of the training thread, and of the thread a delayed average's
#: all-reduce runs in.
STEPS = "steps"
ALL_REDUCE = "all-reduce"

_active: Trace | None = None


class Trace:
    """Events of one worker, in the trace-event format's ``X`` (complete)
    and ``i`` (instant) phases, with microseconds on the wall clock.

    Args:
        worker: This worker's index: the trace's process id and name.
    """

    def __init__(self, worker: int = 0):
        self.worker = worker
        self._events: list[dict] = []
        self._lock = threading.Lock()
        self._tracks: dict[str, int] = {}
        # Wall-clock microseconds, advanced by the monotonic clock.
        self._wall = time.time() * 1e6
        self._origin = time.perf_counter()

    def now(self) -> float:
        """Microseconds on this trace's clock."""
        return self._wall + (time.perf_counter() - self._origin) * 1e6

    def _track(self, name: str) -> int:
        if name not in self._tracks:
            self._tracks[name] = len(self._tracks) + 1
        return self._tracks[name]

    def complete(
        self,
        name: str,
        category: str,
        start: float,
        end: float,
        track: str = STEPS,
        **args,
    ) -> None:
        """An event from ``start`` to ``end`` (microseconds of :meth:`now`)."""
        with self._lock:
            self._events.append(
                {
                    "name": name,
                    "cat": category,
                    "ph": "X",
                    "ts": start,
                    "dur": max(end - start, 0.0),
                    "pid": self.worker,
                    "tid": self._track(track),
                    "args": args,
                }
            )

    def instant(self, name: str, category: str, track: str = STEPS, **args) -> None:
        with self._lock:
            self._events.append(
                {
                    "name": name,
                    "cat": category,
                    "ph": "i",
                    "s": "t",
                    "ts": self.now(),
                    "pid": self.worker,
                    "tid": self._track(track),
                    "args": args,
                }
            )

    @property
    def events(self) -> list[dict]:
        """The recorded events (a copy), oldest first."""
        with self._lock:
            return sorted(self._events, key=lambda e: e["ts"])

    def to_json(self) -> dict:
        """The trace-event document: the events, and the names of this
        worker's process and tracks."""
        meta = [
            {
                "name": "process_name",
                "ph": "M",
                "pid": self.worker,
                "args": {"name": f"worker {self.worker}"},
            }
        ]
        with self._lock:
            tracks = dict(self._tracks)
        meta += [
            {
                "name": "thread_name",
                "ph": "M",
                "pid": self.worker,
                "tid": tid,
                "args": {"name": name},
            }
            for name, tid in tracks.items()
        ]
        return {"traceEvents": meta + self.events, "displayTimeUnit": "ms"}

    def write(self, path: str | os.PathLike) -> pathlib.Path:
        """Writes the trace to ``path`` whole (a reader never sees half)."""
        path = pathlib.Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(path.name + ".partial")
        partial.write_text(json.dumps(self.to_json()))
        os.replace(partial, path)
        return path


def active() -> Trace | None:
    """The trace being recorded in this process, if any."""
    return _active


@contextlib.contextmanager
def recording(trace: Trace) -> Iterator[Trace]:
    """Makes ``trace`` the active one for the duration of the block."""
    global _active
    previous, _active = _active, trace
    try:
        yield trace
    finally:
        _active = previous


@contextlib.contextmanager
def span(name: str, category: str, track: str = STEPS, **args) -> Iterator[dict]:
    """Records the block as one event of the active trace (nothing when none
    is active). The yielded dict takes more ``args`` while the block runs."""
    trace = _active
    if trace is None:
        yield args
        return
    start = trace.now()
    try:
        yield args
    finally:
        trace.complete(name, category, start, trace.now(), track, **args)


def instant(name: str, category: str, track: str = STEPS, **args) -> None:
    """An instant event of the active trace, if any."""
    trace = _active
    if trace is not None:
        trace.instant(name, category, track, **args)


def summary(events: list[dict]) -> dict:
    """What a worker's trace says, in seconds.

    - ``executions``: time in executions of the train function (their local
      steps, and the averages inside them); ``boundary_averages``: time in
      boundary averages; ``validation``: time validating.
    - ``all_reduce``: time the delayed averages' all-reduces took, wherever
      they ran; ``beside``: the part that ran in a thread beside the steps;
      ``waited``: time the training thread then waited for them before
      landing; ``hidden``: the share of ``all_reduce`` that did not keep the
      training thread waiting, ``(beside - waited) / all_reduce`` (None
      without delayed averages); ``delayed_averages``: how many landed.
    - ``step_seconds``: the median seconds of a local step in executions
      that took no average inside (but the first, which traces), ``alone``
      while no all-reduce ran beside them and ``beside`` while one did
      (None where there were none): what an all-reduce beside the steps
      costs them.

    An all-reduce beside the steps lasts from this worker's start to the
    end of the collective, so it includes the time its peers took to reach
    their copy: ``hidden`` is the share of that time this worker computed
    through, not a share of wire time.
    """
    spans = [e for e in events if e.get("ph") == "X"]
    totals: dict[str, float] = {}
    counts: dict[str, int] = {}
    for event in spans:
        totals[event["name"]] = totals.get(event["name"], 0.0) + event["dur"] / 1e6
        counts[event["name"]] = counts.get(event["name"], 0) + 1
    reduces = [e for e in spans if e["name"] == "all-reduce"]
    beside = [e for e in reduces if e["args"].get("beside")]
    all_reduce = totals.get("all-reduce", 0.0)
    beside_seconds = sum(e["dur"] for e in beside) / 1e6
    waited = totals.get("wait", 0.0)
    per_step: dict[str, list[float]] = {"alone": [], "beside": []}
    executions = [e for e in spans if e["name"] == "execution"]
    for e in executions[1:]:  # the first traces the train function
        if e["args"].get("averages"):
            continue
        end = e["ts"] + e["dur"]
        overlaps = any(r["ts"] < end and e["ts"] < r["ts"] + r["dur"] for r in beside)
        per_step["beside" if overlaps else "alone"].append(
            e["dur"] / 1e6 / e["args"].get("steps", 1)
        )
    return {
        "executions": totals.get("execution", 0.0),
        "boundary_averages": totals.get("boundary average", 0.0),
        "validation": totals.get("validation", 0.0),
        "all_reduce": all_reduce,
        "beside": beside_seconds,
        "waited": waited,
        "hidden": (
            None if all_reduce == 0 else max(0.0, beside_seconds - waited) / all_reduce
        ),
        "delayed_averages": counts.get("land", 0),
        "step_seconds": {
            k: (statistics.median(v) if v else None) for k, v in per_step.items()
        },
    }


def read(path: str | os.PathLike) -> list[dict]:
    """The events of a trace file :meth:`Trace.write` wrote."""
    with open(path) as f:
        return json.load(f)["traceEvents"]
