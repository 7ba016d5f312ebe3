"""Prints the rows of the first batches of the first two epochs this worker
of the benchmark's dataset trains on (``ROWS [[[...], ...], ...]``), for
tests/test_torch_peer.py."""

import json
import os

import keras

import keras_skip
from keras_skip.bench.workers import worker, workloads

keras_skip.apply_keras_fixes()
strategy = keras_skip.multi_worker_strategy(peer_timeout=60)
keras.utils.set_random_seed(0)
config = {
    "workload": "mlp",
    "seed": 0,
    "method": "sync",
    "epochs": 2,
    "batch_per_worker": 32,
}
# Through the worker's own loading and pipeline; rows found by their pixels.
(x, y), _, batch = worker._load_data(config, strategy, 2)
data, steps = worker._dataset(config, x, y, 0, batch, 2 * batch)
(original, _), _ = workloads.load_mnist_subset(0)
index_of = {row.tobytes(): i for i, row in enumerate(original)}
batches = iter(strategy.experimental_distribute_dataset(data))
rows = [[], []]
for step in range(2 * steps):
    local = strategy.experimental_local_results(next(batches)[0])[0].numpy()
    if step % steps < 3:
        rows[step // steps].append([index_of[r.tobytes()] for r in local])
print("ROWS " + json.dumps(rows), flush=True)
assert os.environ["KERAS_SKIP_WORKER"] in ("0", "1")
