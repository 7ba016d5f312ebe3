"""Adam on skewed shards, in the reference maths: which slots an average
must share for the correction to work.

    python -m keras_skip.bench.efficiency.preconditioner --json preconditioner.json

Each replica minimizes its own quadratic, ``f_i(x) = 1/2 (x - b_i)^T A_i
(x - b_i)`` with diagonal ``A_i`` and optima ``b_i`` far apart (the skewed
shards of the efficiency map, where every replica's data pull elsewhere),
from noisy gradients, with Adam as the inner optimizer. After a fixed number
of steps the script reports, per slot policy and correction, how far the
replicas' mean is above the optimum of the mean loss (the *gap*), and its
ratio to plain local SGD's. It runs ``maths.simulate`` in float64, no
TensorFlow, in a few seconds.

Adam scales each replica's step by its own second moment ``v_i``, which on
skewed shards differs from replica to replica; the correction, a drift
measured in weight space, does not undo a difference of scales. Averaging
``v`` with the weights (``optimizer_state="average_second_moments"``) gives
every replica the same scale for the next interval; the first moment
forgets within about ``1 / (1 - beta_1)`` steps, so averaging it adds
little. The last rows add an outer Nesterov step (DiLoCo's learning rate
0.7): with momentum 0.9, DiLoCo's, the correction hurts; with 0.5 it helps.
"""

from __future__ import annotations

import argparse
import datetime
import json
import pathlib
import statistics
import sys
from collections.abc import Sequence

import numpy as np

from keras_skip import maths

#: ``name: (optimizer_state, correction, outer)`` in the order of the table;
#: ``outer`` is None or the outer Nesterov step's ``(learning_rate,
#: momentum)``: DiLoCo's (0.7, 0.9), or a lighter momentum.
VARIANTS = {
    "local SGD": ("local", 0.0, None),
    "local SGD, second moments averaged": ("average_second_moments", 0.0, None),
    "skip+correction": ("local", 1.0, None),
    "skip+correction, first moments averaged": ("first_moments", 1.0, None),
    "skip+correction, second moments averaged": ("average_second_moments", 1.0, None),
    "skip+correction, slots averaged": ("average", 1.0, None),
    "DiLoCo (outer 0.7, momentum 0.9)": ("local", 0.0, (0.7, 0.9)),
    "DiLoCo, second moments averaged": ("average_second_moments", 0.0, (0.7, 0.9)),
    "second moments averaged, correction, outer momentum 0.9": (
        "average_second_moments",
        1.0,
        (0.7, 0.9),
    ),
    "second moments averaged, correction, outer momentum 0.5": (
        "average_second_moments",
        1.0,
        (0.7, 0.5),
    ),
}
SETTINGS = dict(replicas=8, dim=20, steps=1024, interval=128, learning_rate=0.01)


def skewed_quadratic(seed: int, replicas: int, dim: int):
    """``(grad_fn, gap)`` of the problem above: ``grad_fn(t, x)`` as
    ``maths.simulate`` takes it, ``gap(x)`` the mean loss of ``x`` above the
    optimum of the mean loss."""
    rng = np.random.default_rng(seed)
    a = rng.uniform(0.1, 1.0, (replicas, dim))
    b = rng.normal(0.0, 3.0, (replicas, dim))
    optimum = (a * b).sum(0) / a.sum(0)

    def loss(x):
        return 0.5 * float((a * (x - b) ** 2).sum(1).mean())

    def grad_fn(t, x):
        noise = np.random.default_rng(1000 * seed + t).normal(size=(replicas, dim))
        return a * (x - b) + 0.3 * noise

    return grad_fn, lambda x: loss(x) - loss(optimum)


def first_moments_only() -> maths.InnerOptimizer:
    """Adam whose first moment is the one an average shares: its slots
    swapped, so that ``second_moments`` names ``m`` (a variant for the
    comparison only; the package has no such policy)."""
    adam = maths.adam()

    def step(g, x, slots, lr, t):
        v, m = slots
        displacement, (m, v) = adam.step(g, x, (m, v), lr, t)
        return displacement, (v, m)

    return maths.InnerOptimizer(adam.init, step, second_moments=(1,))


def final_gap(
    seed: int, optimizer_state: str, correction: float, outer=None, **settings
) -> float:
    settings = {**SETTINGS, **settings}
    grad_fn, gap = skewed_quadratic(seed, settings["replicas"], settings["dim"])
    inner = maths.adam()
    if optimizer_state == "first_moments":
        inner, optimizer_state = first_moments_only(), "average_second_moments"
    result = maths.simulate(
        np.zeros(settings["dim"]),
        grad_fn,
        n=settings["replicas"],
        steps=settings["steps"],
        learning_rate=settings["learning_rate"],
        interval=settings["interval"],
        correction=correction,
        inner=inner,
        optimizer_state=optimizer_state,
        boundaries=[settings["steps"]],
        outer=None if outer is None else maths.sgd(outer[1], nesterov=True),
        outer_learning_rate=1.0 if outer is None else outer[0],
    )
    return gap(result.x[0])


def measure(seeds: Sequence[int], **settings) -> dict:
    """Per variant: the gap of each seed, their median, and the median's
    ratio to plain local SGD's."""
    rows = {}
    for name, (policy, correction, outer) in VARIANTS.items():
        gaps = [final_gap(s, policy, correction, outer, **settings) for s in seeds]
        rows[name] = {"gaps": gaps, "median_gap": statistics.median(gaps)}
    base = rows["local SGD"]["median_gap"]
    for row in rows.values():
        row["vs_local_sgd"] = row["median_gap"] / base
    return rows


def table(rows: dict) -> str:
    lines = [
        "| variant | median gap | vs local SGD | gap per seed |",
        "|---|---|---|---|",
    ]
    for name, row in rows.items():
        seeds = ", ".join(f"{g:.3f}" for g in row["gaps"])
        lines.append(
            f"| {name} | {row['median_gap']:.3f} | {row['vs_local_sgd']:.3f}x "
            f"| {seeds} |"
        )
    return "\n".join(lines) + "\n"


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m keras_skip.bench.efficiency.preconditioner",
        description=__doc__.split("\n\n")[0],
    )
    p.add_argument("--seeds", type=int, default=5, help="problems drawn (default 5)")
    p.add_argument("--json", type=pathlib.Path, help="also write the results here")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.seeds < 1:
        print(
            f"{parser().prog}: --seeds must be >= 1, got {args.seeds}", file=sys.stderr
        )
        return 2
    rows = measure(range(args.seeds))
    print(table(rows), end="")
    if args.json:
        command = "python -m keras_skip.bench.efficiency.preconditioner " + " ".join(
            sys.argv[1:] if argv is None else argv
        )
        args.json.write_text(
            json.dumps(
                {
                    "command": command.strip(),
                    "date": datetime.date.today().isoformat(),
                    "settings": {**SETTINGS, "seeds": args.seeds},
                    "variants": rows,
                },
                indent=1,
            )
            + "\n"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
