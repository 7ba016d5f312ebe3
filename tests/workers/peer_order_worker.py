"""Prints the rows of the first batches this worker of the benchmark's
dataset trains on (``ROWS [[...], ...]``), for tests/test_torch_peer.py."""

import json
import os

import keras
import numpy as np

import keras_skip
from keras_skip.bench.workers import worker, workloads

keras_skip.apply_keras_fixes()
strategy = keras_skip.multi_worker_strategy(peer_timeout=60)
keras.utils.set_random_seed(0)
(x, y), _ = workloads.load_mnist_subset(0)
# The rows' indices in place of the pixels, through the worker's own pipeline.
indices = np.arange(len(x), dtype="float32")[:, None]
config = {"workload": "mlp", "seed": 0, "method": "sync"}
data, _ = worker._dataset(config, indices, y, 0, 32, 64)
batches = iter(strategy.experimental_distribute_dataset(data))
rows = []
for _ in range(3):
    local = strategy.experimental_local_results(next(batches)[0])[0]
    rows.append([int(v) for v in local.numpy()[:, 0]])
print("ROWS " + json.dumps(rows), flush=True)
assert os.environ["KERAS_SKIP_WORKER"] in ("0", "1")
