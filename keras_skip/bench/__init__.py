"""The benchmark harness: workloads, baselines and benchmarks.

Not imported by ``import keras_skip``; it imports TensorFlow and the
benchmark-only dependencies (mlxtend, matplotlib) when used.

What drives a ``keras-skip bench`` run stands here (:mod:`.harness`,
:mod:`.parser`, :mod:`.methods`, :mod:`.options`), beside the benchmarks
that are scripts of their own (:mod:`.overhead`, :mod:`.step_overhead`);
the rest is a sub-package per concern: :mod:`.links` (the emulated slow
links), :mod:`.workers` (the worker processes and what they train),
:mod:`.reports` (what a run measured, its tables and plots) and
:mod:`.planner` (the planner against the committed runs).
"""
