"""``python -m keras_skip.bench.efficiency``: runs the efficiency map (or
part of it) and writes its results as JSON."""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import platform
import shlex
import sys
import time
from collections.abc import Sequence

from keras_skip.bench.efficiency import cells

USAGE_EXAMPLES = """examples:
  python -m keras_skip.bench.efficiency --out docs/results/efficiency.json
      the whole map (about 3 hours on 2 cores); with --resume, a map cut
      short goes on where it stopped
  python -m keras_skip.bench.efficiency --cells 'cnn/adamw/dirichlet0.1/H128/r8' \\
      --seeds 0 --out docs/results/efficiency.json --resume
      one key cell, seed 0, added to the results
  python -m keras_skip.bench.efficiency --quick --out quick.json
      the reduced map: two tiny cells, 1 seed, a few dozen steps
  python -m keras_skip.bench.efficiency --list
      the cells, runs and estimated time, without running anything
"""


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m keras_skip.bench.efficiency",
        description=(
            "Statistical efficiency of keras-skip's methods: optimizer steps to "
            "a validation target and the final validation metric, per method, "
            "on MirroredStrategy replicas of one process (logical CPU devices)."
        ),
        epilog=USAGE_EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--out",
        type=pathlib.Path,
        help="the JSON file of the results (written after every run)",
    )
    p.add_argument(
        "--cells",
        nargs="+",
        metavar="PATTERN",
        help="only the cells whose id (WORKLOAD/INNER/SHARDS/HINTERVAL/rREPLICAS) "
        "matches one of these shell patterns; a full id outside the map adds it",
    )
    p.add_argument(
        "--methods",
        nargs="+",
        metavar="METHOD",
        help=f"only these methods, of {', '.join(cells.METHODS)}",
    )
    p.add_argument(
        "--seeds", nargs="+", type=int, help="these seeds in every cell chosen"
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="the reduced map: tiny models and a few dozen steps "
        "(with --cells, those cells at the quick settings)",
    )
    p.add_argument(
        "--steps", type=int, help="steps of every run (default: the workload's)"
    )
    p.add_argument(
        "--resume",
        action="store_true",
        help="keep the runs already in --out and run only the others",
    )
    p.add_argument(
        "--list",
        action="store_true",
        help="print the cells, the runs and the estimated time, and stop",
    )
    return p


def machine() -> str:
    """The machine, without its name or paths."""
    import keras
    import tensorflow as tf

    return (
        f"{platform.system()} {platform.machine()}, {os.cpu_count()} CPU cores, "
        f"Python {platform.python_version()}, tensorflow {tf.__version__}, "
        f"keras {keras.__version__}"
    )


def chosen_cells(args: argparse.Namespace) -> list[cells.Cell]:
    base = cells.quick_map() if args.quick and not args.cells else cells.full_map()
    return cells.select(base, args.cells, args.methods, args.seeds)


def specs(args: argparse.Namespace, names) -> dict:
    import dataclasses

    found = {}
    for name in names:
        spec = cells.workload(name, quick=args.quick)
        if args.steps:
            spec = dataclasses.replace(spec, steps=args.steps)
        found[name] = spec
    return found


def check(args: argparse.Namespace, chosen: list[cells.Cell], found: dict) -> None:
    """Refuses, before TensorFlow starts, what cannot run."""
    if args.steps is not None and args.steps < 1:
        raise ValueError("--steps must be at least 1")
    for cell in chosen:
        spec = found[cell.workload]
        if cell.replicas < 1:
            raise ValueError(f"{cell.id}: replicas must be at least 1")
        if spec.steps % cells.grid(cell, spec):
            raise ValueError(
                f"{cell.id}: {spec.steps} steps are not a multiple of the "
                f"evaluation grid of {cells.grid(cell, spec)} steps"
            )
        if max(cell.interval, spec.every) % min(cell.interval, spec.every):
            raise ValueError(
                f"{cell.id}: interval {cell.interval} and the grid of "
                f"{spec.every} steps must divide one another"
            )


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        chosen = chosen_cells(args)
        found = specs(args, {c.workload for c in chosen})
        check(args, chosen, found)
    except ValueError as error:
        print(f"python -m keras_skip.bench.efficiency: {error}", file=sys.stderr)
        return 2
    runs = cells.runs_of(chosen)
    estimate = cells.estimate_seconds(runs, quick=args.quick)
    if args.list:
        for cell in chosen:
            print(f"{cell.id:<34} seeds {cell.seeds} methods {', '.join(cell.methods)}")
        print(f"{len(chosen)} cells, {len(runs)} runs, about {estimate / 3600:.1f} h")
        return 0
    if args.out is None:
        print("python -m keras_skip.bench.efficiency: --out is needed", file=sys.stderr)
        return 2
    previous = {}
    if args.resume and args.out.exists():
        previous = {r["key"]: r for r in json.loads(args.out.read_text())["runs"]}
    todo = [r for r in runs if r.key not in previous]
    replicas = max((r.cell.replicas for r in todo), default=1)
    print(
        f"{len(todo)} runs to do ({len(runs) - len(todo)} already in {args.out}), "
        f"about {cells.estimate_seconds(todo, quick=args.quick) / 60:.0f} min",
        flush=True,
    )

    # Logical devices must be set before TensorFlow runs anything.
    from keras_skip.bench.workers import devices

    devices.configure_replicas(replicas)
    from keras_skip.bench.efficiency import train

    command = "python -m keras_skip.bench.efficiency " + shlex.join(
        sys.argv[1:] if argv is None else list(argv)
    )
    result = {
        "command": command,
        "machine": machine(),
        "date": datetime.date.today().isoformat(),
        "quick": args.quick,
        "full_map": {
            "cells": len(cells.full_map()),
            "runs": len(cells.runs_of(cells.full_map())),
            "estimated_seconds": round(
                cells.estimate_seconds(cells.runs_of(cells.full_map()))
            ),
            "costs": {k: list(v) for k, v in cells.COSTS.items()},
        },
        "workloads": {},
        "cells": [],
        "runs": list(previous.values()),
    }
    if previous:
        old = json.loads(args.out.read_text())
        result["cells"] = old.get("cells", [])
        result["workloads"] = old.get("workloads", {})
        result["commands"] = sorted({*old.get("commands", [old["command"]]), command})
    datasets: dict = {}
    for name, spec in found.items():
        described = {
            "steps": spec.steps,
            "batch_per_replica": spec.batch,
            "every": spec.every,
            "metric": spec.metric,
            "target": spec.target,
            "learning_rates": spec.learning_rates,
            "warmup": spec.warmup,
            "weight_decay": spec.weight_decay,
            "size": spec.size,
        }
        result["workloads"][name] = described
    for cell in chosen:
        entry = {
            "id": cell.id,
            "workload": cell.workload,
            "inner": cell.inner,
            "shards": cell.shards,
            "interval": cell.interval,
            "replicas": cell.replicas,
            "methods": list(cell.methods),
            "seeds": list(cell.seeds),
            "grid": cells.grid(cell, found[cell.workload]),
        }
        result["cells"] = [c for c in result["cells"] if c["id"] != cell.id] + [entry]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    strategies: dict = {}
    start = time.perf_counter()
    for number, run in enumerate(todo, 1):
        spec = found[run.cell.workload]
        if run.cell.workload not in datasets:
            datasets[run.cell.workload] = train.Dataset(spec)
            if run.cell.workload == "lm":
                corpus = datasets["lm"].corpus
                result["workloads"]["lm"]["corpus"] = {
                    "train_files": len(corpus.train_files),
                    "train_tokens": corpus.train_tokens,
                    "validation_files": len(corpus.validation_files),
                    "validation_tokens": len(corpus.validation),
                    "digest": corpus.digest,
                }
        dataset = datasets[run.cell.workload]
        if run.cell.replicas not in strategies:
            strategies[run.cell.replicas] = devices.mirrored_strategy(run.cell.replicas)
        outcome = train.train(spec, run, dataset, strategies[run.cell.replicas])
        outcome["shards_of_replicas"] = dataset.describe(
            run.cell.shards, run.cell.replicas
        )
        result["runs"].append(outcome)
        args.out.write_text(json.dumps(result, indent=1) + "\n")
        print(
            f"[{number}/{len(todo)}] {run.key}: final loss {outcome['final_loss']:.4f}"
            f", accuracy {outcome['final_accuracy']:.4f}, {outcome['seconds']:.0f} s"
            f" ({time.perf_counter() - start:.0f} s in all)",
            flush=True,
        )
    if not todo:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
