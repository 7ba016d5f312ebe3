"""What the efficiency map runs: workloads, inner optimizers, methods and
the cells, with the design that keeps the whole map within about 3 hours on
2 cores (see the package's docstring for the reasons)."""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field, replace

from keras_skip.bench.efficiency.data import IMAGE_SHARDS, TEXT_SHARDS

INTERVALS = (8, 32, 128, 512)
#: Twice the map's intervals up to 128: `skip/second` there sends, per step,
#: the bytes the default sends at the map's interval with AdamW.
EQUAL_BYTES_INTERVALS = (16, 64, 256)
INNERS = ("sgdm", "adamw")


@dataclass(frozen=True)
class Workload:
    """A model, its data and its budget.

    ``steps``: optimizer steps of every run; ``batch``: examples (or text
    windows) per replica and step; ``every``: the evaluation grid of
    intervals up to ``every`` (longer intervals evaluate after each of
    their averages); ``metric`` and ``target``: what "reached the target"
    means (validation accuracy at least, or validation loss at most);
    ``learning_rates``: per inner optimizer, the constant rate of SGD with
    momentum and the peak of AdamW's warm-up + cosine schedule.
    """

    name: str
    steps: int
    batch: int
    every: int
    metric: str
    target: float
    learning_rates: dict = field(default_factory=dict)
    warmup: int = 128
    weight_decay: float = 0.01
    size: dict = field(default_factory=dict)
    shards: tuple[str, ...] = IMAGE_SHARDS
    #: The skewed shards of this workload's key cells.
    skewed: str = "dirichlet0.1"

    @property
    def higher_is_better(self) -> bool:
        return self.metric == "accuracy"


WORKLOADS = {
    "mlp": Workload(
        "mlp",
        steps=1024,
        batch=32,
        every=64,
        metric="accuracy",
        target=0.90,
        learning_rates={"sgdm": 0.02, "adamw": 1e-3},
        size={"hidden": (256, 256)},
    ),
    "cnn": Workload(
        "cnn",
        steps=1024,
        batch=32,
        every=64,
        metric="accuracy",
        # Synchronous training passes 0.93, local methods at interval 128 on
        # Dirichlet 0.1 shards did not within the budget: set after the
        # first key-cell run so that steps to target tell the methods apart.
        target=0.85,
        learning_rates={"sgdm": 0.02, "adamw": 2e-3},
    ),
    "lm": Workload(
        "lm",
        steps=512,
        batch=16,
        every=64,
        metric="loss",
        target=2.1,
        learning_rates={"sgdm": 0.1, "adamw": 3e-3},
        size={"length": 64, "width": 64, "heads": 4, "blocks": 2, "hidden": 128},
        shards=TEXT_SHARDS,
        skewed="files",
    ),
}

#: The tiny settings of ``--quick`` (and of the test suite's smoke map).
QUICK = {
    "mlp": {"steps": 48, "every": 16, "size": {"hidden": (32,)}, "target": 0.5},
    "cnn": {"steps": 48, "every": 16, "target": 0.5},
    "lm": {
        "steps": 48,
        "every": 16,
        "batch": 4,
        "target": 3.5,
        "size": {"length": 16, "width": 16, "heads": 2, "blocks": 1, "hidden": 32},
    },
}


def workload(name: str, quick: bool = False) -> Workload:
    if name not in WORKLOADS:
        raise ValueError(f"workload {name!r} is not one of {sorted(WORKLOADS)}")
    spec = WORKLOADS[name]
    return replace(spec, **QUICK[name]) if quick else spec


@dataclass(frozen=True)
class Method:
    """A way to train, as arguments of ``SkipCorrectionOptimizer``."""

    name: str
    label: str
    correction: float = 1.0
    optimizer_state: str = "local"
    outer: bool = False
    synchronous: bool = False
    #: The outer Nesterov step's momentum (None: DiLoCo's, `OUTER_MOMENTUM`).
    outer_momentum: float | None = None


METHODS = {
    m.name: m
    for m in (
        Method("sync", "synchronous (interval 1)", synchronous=True),
        Method("local", "local SGD (correction 0)", correction=0.0),
        Method("skip", "skip+correction (default)"),
        Method("outer", "outer Nesterov, no correction (DiLoCo)", 0.0, outer=True),
        Method("outer+correction", "outer Nesterov + correction", outer=True),
        Method("skip/average", "skip+correction, slots averaged", 1.0, "average"),
        Method("skip/reset", "skip+correction, slots reset", 1.0, "reset"),
        Method(
            "skip/second",
            "skip+correction, second moments averaged",
            1.0,
            "average_second_moments",
        ),
        Method(
            "second+outer0.5",
            "skip/second with outer Nesterov, momentum 0.5",
            1.0,
            "average_second_moments",
            outer=True,
            outer_momentum=0.5,
        ),
    )
}
#: The methods of every cell; the slot policies run in the key cells and
#: the SGD-with-momentum cells only (SGD has no second moments).
MAIN_METHODS = ("sync", "local", "skip", "outer", "outer+correction")
ALL_METHODS = tuple(METHODS)
SGD_METHODS = tuple(m for m in METHODS if "second" not in m)
#: The main methods and the option that shares AdamW's second moments.
ADAMW_METHODS = (*MAIN_METHODS, "skip/second")
#: DiLoCo's outer optimizer: Nesterov SGD, learning rate 0.7, momentum 0.9.
OUTER_LEARNING_RATE = 0.7
OUTER_MOMENTUM = 0.9


@dataclass(frozen=True)
class Cell:
    """One setting of the map; every method runs in it, on the same seeds."""

    workload: str
    inner: str
    shards: str
    interval: int
    replicas: int
    methods: tuple[str, ...] = MAIN_METHODS
    seeds: tuple[int, ...] = (0,)

    @property
    def id(self) -> str:
        return (
            f"{self.workload}/{self.inner}/{self.shards}"
            f"/H{self.interval}/r{self.replicas}"
        )

    def sync_key(self, seed: int) -> str:
        """Synchronous training does not depend on the interval: one run
        serves every interval of the same workload, optimizer, shards,
        replicas and seed."""
        return f"{self.workload}/{self.inner}/{self.shards}/r{self.replicas}/s{seed}"


def parse_cell(text: str) -> Cell:
    """``WORKLOAD/INNER/SHARDS/HINTERVAL/rREPLICAS``, as :attr:`Cell.id`."""
    parts = text.split("/")
    if len(parts) != 5 or not parts[3].startswith("H") or not parts[4].startswith("r"):
        raise ValueError(
            f"cell {text!r}: expected WORKLOAD/INNER/SHARDS/HINTERVAL/rREPLICAS, "
            "such as cnn/adamw/dirichlet0.1/H128/r8"
        )
    name, inner, shards, interval, replicas = parts
    spec = workload(name)
    if inner not in INNERS:
        raise ValueError(f"cell {text!r}: inner {inner!r} is not one of {INNERS}")
    if shards not in spec.shards:
        raise ValueError(f"cell {text!r}: shards of {name} are one of {spec.shards}")
    try:
        return Cell(name, inner, shards, int(interval[1:]), int(replicas[1:]))
    except ValueError:
        raise ValueError(f"cell {text!r}: interval and replicas are integers") from None


KEY_SEEDS = (0, 1, 2)


def full_map() -> list[Cell]:
    """The whole map, key cells first.

    - Key cells (3 seeds, all nine methods): AdamW, 8 replicas, interval
      128, skewed shards (Dirichlet 0.1; the language model by source
      file), for the CNN and the language model: the map's first target.
    - Around each key cell, one factor at a time (1 seed, the five main
      methods, and `skip/second` wherever the inner optimizer is AdamW): IID
      shards; interval 32 (the CNN also 8 and 512); 4 replicas; for the CNN,
      Dirichlet 1.0 and SGD with momentum (with the slot policies too:
      momentum is a slot). The
      language model costs the most (its train function takes minutes to
      compile on 8 replicas), so it runs 512 steps and no interval 512.
    - Equal bytes: `skip/second` on the CNN's and the MLP's AdamW Dirichlet
      0.1 shards at intervals 16, 64 and 256 (1 seed). It sends the second
      moments with the weights, so at twice an interval it sends what the
      default sends at that interval, per step.
    - The MLP, the cheapest model: both optimizers at every interval on
      Dirichlet 0.1 shards, 8 replicas (the five main methods, and
      `skip/second` with AdamW; 1 seed, 3 at AdamW's interval 128 to measure
      the MLP's spread over seeds).
    """
    cells: list[Cell] = []
    for name in ("cnn", "lm"):
        skewed = WORKLOADS[name].skewed
        cells.append(Cell(name, "adamw", skewed, 128, 8, ALL_METHODS, KEY_SEEDS))
    for name in ("cnn", "lm"):
        key = Cell(name, "adamw", WORKLOADS[name].skewed, 128, 8, ADAMW_METHODS)
        cells.append(replace(key, shards="iid"))
        for interval in (8, 32, 512) if name == "cnn" else (32,):
            cells.append(replace(key, interval=interval))
        if name == "cnn":
            cells.append(replace(key, shards="dirichlet1.0"))
        cells.append(replace(key, replicas=4))
        if name == "cnn":
            cells.append(replace(key, inner="sgdm", methods=SGD_METHODS))
    # Averaged second moments at twice an interval of the map send the
    # default's bytes per step with AdamW (weights and second moments, half
    # as often): the comparison at equal bytes.
    for name in ("cnn", "mlp"):
        for interval in EQUAL_BYTES_INTERVALS:
            cells.append(
                Cell(
                    name, "adamw", "dirichlet0.1", interval, 8, ("sync", "skip/second")
                )
            )
    for inner in INNERS:
        for interval in INTERVALS:
            methods = ADAMW_METHODS if inner == "adamw" else MAIN_METHODS
            # One MLP cell with the key cells' seeds gives the MLP's spread.
            seeds = KEY_SEEDS if (inner, interval) == ("adamw", 128) else (0,)
            cells.append(
                Cell("mlp", inner, "dirichlet0.1", interval, 8, methods, seeds)
            )
    return cells


#: Measured cost of one run on the 2-core machine of the docs, busy with
#: other work: seconds of tracing and start-up, and seconds per step at 8
#: replicas (4 replicas: about half). ``--list`` estimates from these. The
#: CNN's and the language model's are the mean seconds of their 8-replica
#: runs in ``docs/results/efficiency.json`` (70 s and 120 s), the MLP's a
#: first estimate.
COSTS = {"mlp": (20.0, 0.03), "cnn": (15.0, 0.054), "lm": (40.0, 0.156)}


def estimate_seconds(runs: list[Run], quick: bool = False) -> float:
    total = 0.0
    for run in runs:
        overhead, per_step = COSTS[run.cell.workload]
        steps = workload(run.cell.workload, quick).steps
        total += overhead + per_step * steps * run.cell.replicas / 8
    return total


def quick_map() -> list[Cell]:
    """The reduced map of ``--quick``: two tiny cells at 4 replicas, 1 seed."""
    return [
        Cell("mlp", "sgdm", "dirichlet0.1", 8, 4),
        Cell("lm", "adamw", "files", 8, 4, ("sync", "local", "skip", "outer")),
    ]


def select(
    cells: list[Cell],
    patterns: list[str] | None = None,
    methods: list[str] | None = None,
    seeds: list[int] | None = None,
) -> list[Cell]:
    """The cells whose id matches one of the shell-style ``patterns`` (all
    without), with their methods restricted to ``methods`` and their seeds
    replaced by ``seeds`` when given. A pattern that is a full cell id not
    in the map adds that cell, with seed 0 and the main methods, or with
    ``methods`` when given (those its inner optimizer has: the second-moment
    methods need AdamW)."""
    for name in methods or ():
        if name not in METHODS:
            raise ValueError(f"method {name!r} is not one of {list(METHODS)}")
    chosen = []
    for pattern in patterns or ["*"]:
        matched = [c for c in cells if fnmatch.fnmatchcase(c.id, pattern)]
        if not matched and not any(ch in pattern for ch in "*?["):
            added = parse_cell(pattern)
            if methods:
                able = ALL_METHODS if added.inner == "adamw" else SGD_METHODS
                if not set(methods) & set(able):
                    raise ValueError(
                        f"cell {pattern!r}: none of the methods {methods} runs "
                        f"with inner {added.inner!r} (it has no second moments)"
                    )
                added = replace(added, methods=able)
            matched = [added]
        if not matched:
            known = ", ".join(c.id for c in cells[:3])
            raise ValueError(f"no cell matches {pattern!r} (cells look like {known})")
        chosen += [c for c in matched if c not in chosen]
    result = []
    for cell in chosen:
        if methods:
            cell = replace(cell, methods=tuple(m for m in cell.methods if m in methods))
        if seeds:
            cell = replace(cell, seeds=tuple(seeds))
        if cell.methods:
            result.append(cell)
    return result


@dataclass(frozen=True)
class Run:
    """One training run: a method of a cell with a seed. Synchronous runs
    are shared by the cells that differ by the interval only."""

    cell: Cell
    method: str
    seed: int

    @property
    def key(self) -> str:
        if METHODS[self.method].synchronous:
            return f"{self.cell.sync_key(self.seed)}/sync"
        return f"{self.cell.id}/s{self.seed}/{self.method}"


def runs_of(cells: list[Cell]) -> list[Run]:
    """Every run the cells need, each once, in the cells' order."""
    seen, runs = set(), []
    for cell in cells:
        for seed in cell.seeds:
            for method in cell.methods:
                run = Run(cell, method, seed)
                if run.key not in seen:
                    seen.add(run.key)
                    runs.append(run)
    return runs


def grid(cell: Cell, spec: Workload) -> int:
    """The evaluation grid of a cell: every ``spec.every`` steps, or after
    every average for longer intervals, so that every method of the cell
    (synchronous included) is evaluated at the same steps, each a step
    right after an average, where the replicas hold one model."""
    return max(cell.interval, spec.every)
