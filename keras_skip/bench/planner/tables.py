"""The planner's tables for ``docs/planner.md``, printed, not typed.

    python -m keras_skip.bench.planner.tables check docs/results
    python -m keras_skip.bench.planner.tables scale MODEL/HOSTS
    python -m keras_skip.bench.planner.tables refresh docs/planner.md

``check`` compares the planner with every committed benchmark run
(:mod:`keras_skip.bench.planner.check`); ``scale`` predicts one of
:data:`MODELS` from 8 to 1,024 workers, 1 to 100 Gbit/s and 0.1 to 100 ms.
``refresh`` prints again every table of a page between its markers::

    <!-- generated: python -m keras_skip.bench.planner.tables KIND ARGUMENT -->
    ...
    <!-- end of generated table -->
"""

from __future__ import annotations

import pathlib
import sys

from keras_skip import planner
from keras_skip.bench.planner import check
from keras_skip.bench.reports import pages

#: The scale page's models: trainable values, seconds of one local step on
#: one worker, and steps an epoch (see docs/planner.md for where the step
#: times come from).
MODELS = {
    "mlp": planner.Workload(1_863_690, 0.018, 1000),
    "resnet50": planner.Workload(25_557_032, 0.1, 1000),
    "transformer-1b": planner.Workload(1_000_000_000, 0.5, 1000),
}
WORKERS = (8, 64, 1024)
BANDWIDTHS = ("1gbit", "10gbit", "100gbit")
LATENCIES = ("0.1ms", "1ms", "10ms", "100ms")


#: ``MODEL/HOSTS``: the link constants as fitted on the committed runs
#: (``fitted``), or without the hosts' share of a ring step (``ideal``).
HOSTS = {"fitted": {}, "ideal": {"step_overhead": 0.0}}


def scale_table(argument: str) -> str:
    """Speed-up of keras-skip (adaptive interval, no compression or overlap)
    over synchronous SGD, the interval chosen, and synchronous SGD's step
    time, per cluster, for ``MODEL/HOSTS`` (see :data:`MODELS`, :data:`HOSTS`)."""
    model, _, hosts = argument.partition("/")
    if model not in MODELS or hosts not in HOSTS:
        raise ValueError(
            f"the scale table's argument must be MODEL/HOSTS with MODEL one of "
            f"{', '.join(MODELS)} and HOSTS one of {', '.join(HOSTS)}. "
            f"Received: {argument!r}"
        )
    workload = MODELS[model]
    lines = [
        "| workers | link | "
        + " | ".join(f"{latency} one way" for latency in LATENCIES)
        + " |",
        "|---:|---|" + "---|" * len(LATENCIES),
    ]
    for workers in WORKERS:
        for bandwidth in BANDWIDTHS:
            cells = []
            for latency in LATENCIES:
                p = planner.plan(
                    workload,
                    workers,
                    planner.Link.from_text(bandwidth, latency, **HOSTS[hosts]),
                )
                step = p.synchronous.epoch_seconds / workload.steps_per_epoch
                cells.append(
                    f"{p.speedup:.1f}x (H={p.skip.interval}; sync {_seconds(step)})"
                )
            lines.append(f"| {workers} | {bandwidth} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _seconds(value: float) -> str:
    return f"{value:.3g} s" if value < 100 else f"{value:,.0f} s"


def check_table(directory: str | pathlib.Path) -> str:
    found = check.checks(directory)
    return check.markdown_table(found) + "\n\n" + check.summary(found) + ".\n"


KINDS = {"check": check_table, "scale": scale_table}

GENERATED = pages.generated("keras_skip.bench.planner.tables")


def render(kind: str, argument: str, root: pathlib.Path | None = None) -> str:
    """The table ``kind`` of ``argument`` (a directory relative to ``root``
    for ``check``, a model's name for ``scale``)."""
    if kind not in KINDS:
        raise ValueError(f"table kind {kind!r} is not one of {sorted(KINDS)}")
    if kind == "check" and root is not None:
        argument = root / argument
    return KINDS[kind](argument)


def refresh(page: str | pathlib.Path) -> int:
    """Prints again every generated table of ``page``; returns how many."""
    return pages.refresh(page, GENERATED, render)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) == 2 and argv[0] == "refresh":
        print(f"{refresh(argv[1])} tables printed again in {argv[1]}")
        return 0
    if len(argv) == 2 and argv[0] in KINDS:
        try:
            print(render(argv[0], argv[1]), end="")
        except ValueError as error:
            print(f"keras_skip.bench.planner.tables: {error}", file=sys.stderr)
            return 2
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
