"""The benchmark harness: workloads, baselines and benchmarks.

Not imported by ``import keras_skip``; it imports TensorFlow and the
benchmark-only dependencies (mlxtend, matplotlib) when used.
"""
