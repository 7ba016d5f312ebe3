"""Where each delayed average's time went, read from every worker's trace.

    python -m keras_skip.bench.reports.traces DIR [DIR ...]

``DIR`` holds one method's ``worker-<i>.json`` traces (``keras-skip bench
--trace`` writes ``TRACE/<method>/``). A ring all-reduce moves no byte to
completion before every worker has started it, so for each delayed average
this reads, across the workers: how far apart they started it (``skew``),
how long it took from the last start to its end (``wire``: what the link
and the hosts needed once everyone was in), and what the last worker to
start did meanwhile: how many local steps it computed, in how long, before
it had to wait for the mean, and how long it waited. ``steps`` times a
step's seconds is all the computation there was to hide ``wire`` behind.
"""

from __future__ import annotations

import dataclasses
import pathlib
import statistics
import sys

from keras_skip import tracing


@dataclasses.dataclass(frozen=True)
class Flight:
    """One delayed average, across the workers (seconds)."""

    skew: float
    wire: float
    steps: int
    computed: float
    waited: float


def read_workers(directory: str | pathlib.Path) -> dict[int, list[dict]]:
    """Every worker's events in ``directory``, by worker index."""
    found = {}
    for path in sorted(pathlib.Path(directory).glob("worker-*.json")):
        index = int(path.stem.removeprefix("worker-"))
        found[index] = [e for e in tracing.read(path) if e.get("ph") != "M"]
    if not found:
        raise ValueError(f"No worker-<i>.json trace in {str(directory)!r}.")
    return found


def flights(workers: dict[int, list[dict]]) -> list[Flight]:
    """The delayed averages that every worker's trace holds, in order."""
    reduces = {
        w: [e for e in events if e["name"] == "all-reduce"]
        for w, events in workers.items()
    }
    result = []
    for k in range(min(len(r) for r in reduces.values())):
        starts = {w: r[k]["ts"] for w, r in reduces.items()}
        last = max(starts, key=starts.get)
        end = max(r[k]["ts"] + r[k]["dur"] for r in reduces.values())
        events = workers[last]
        begin = starts[last]
        wait = next(
            (e for e in events if e["name"] == "wait" and e["ts"] >= begin), None
        )
        until = end if wait is None else wait["ts"]
        steps = [
            e
            for e in events
            if e["name"] == "execution"
            and e["ts"] >= begin
            and e["ts"] + e["dur"] <= until
        ]
        result.append(
            Flight(
                skew=(begin - min(starts.values())) / 1e6,
                wire=(end - begin) / 1e6,
                steps=sum(e["args"].get("steps", 1) for e in steps),
                computed=sum(e["dur"] for e in steps) / 1e6,
                waited=0.0 if wait is None else wait["dur"] / 1e6,
            )
        )
    return result


def describe(directory: str | pathlib.Path) -> str:
    """The medians over a method's delayed averages, in one line."""
    found = flights(read_workers(directory))
    if not found:
        return f"{directory}: no delayed average in the traces"

    def median(name):
        return statistics.median(getattr(f, name) for f in found)

    return (
        f"{directory}: {len(found)} delayed averages; medians: the workers "
        f"started each {median('skew'):.3f} s apart, it took {median('wire'):.3f} s "
        f"from the last start to its end, and the last worker to start "
        f"computed {median('steps'):g} local steps in {median('computed'):.3f} s "
        f"beside it, then waited {median('waited'):.3f} s"
    )


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv:
        print(__doc__, file=sys.stderr)
        return 2
    for directory in argv:
        try:
            print(describe(directory))
        except ValueError as error:
            print(f"keras_skip.bench.reports.traces: {error}", file=sys.stderr)
            return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
