"""What another framework needs to train exactly as the benchmark's Keras workers.

``benchmarks/torch_peer.py`` trains the MLP workload with PyTorch; to compare
frameworks rather than initial weights or data orders, it takes from here
the Keras model's initial weights and every worker's batches, made as
:mod:`keras_skip.bench.workers.worker` makes them (the same seed, the same
model, the same ``tf.data`` shuffle of the same MNIST subset). Nothing here
imports PyTorch.

The file :func:`export` writes is a NumPy ``.npz`` archive:

- ``kernel_<i>``, ``bias_<i>``: the ``i``-th ``Dense`` layer's weights in
  Keras' layout, a kernel of shape ``(inputs, outputs)`` (a PyTorch
  ``Linear`` holds its transpose, ``(outputs, inputs)``);
- ``x``, ``y``, ``x_test``, ``y_test``: the training and test data;
- ``order``: ``(epochs, steps, workers, batch)`` indices into ``x``: worker
  ``w``'s batch at step ``s`` of epoch ``e`` is ``x[order[e, s, w]]``;
- ``meta``: a JSON string with the seed, the hidden sizes, the workers and
  the batch size per worker.
"""

from __future__ import annotations

import json
import os

import numpy as np


def initial_weights(hidden=(1024, 1024), seed: int = 0) -> list[np.ndarray]:
    """The MLP workload's weights before training, as a benchmark worker
    builds them with ``seed``: ``[kernel_0, bias_0, kernel_1, ...]``."""
    import keras

    from keras_skip.bench.workers import workloads

    # The worker seeds every generator, loads the data (a NumPy generator of
    # its own) and builds the model: no draw comes between.
    keras.utils.set_random_seed(seed)
    model = workloads.mlp(tuple(hidden))
    return [np.asarray(w) for w in model.get_weights()]


def batch_order(
    examples: int, workers: int, batch: int, epochs: int, seed: int = 0
) -> np.ndarray:
    """``(epochs, steps, workers, batch)`` indices: the rows each worker
    trains on at every step, as the worker's ``tf.data`` pipeline gives them
    (one shuffle per epoch with ``seed``, global batches of ``workers *
    batch`` rows, worker ``w`` taking rows ``[w batch, (w + 1) batch)`` of
    each)."""
    import tensorflow as tf

    tf.random.set_seed(seed)
    global_batch = workers * batch
    steps = examples // global_batch
    data = tf.data.Dataset.range(examples)
    data = data.shuffle(examples, seed=seed, reshuffle_each_iteration=True)
    data = data.batch(global_batch, drop_remainder=True).repeat()
    order = np.stack([b.numpy() for b in data.take(steps * epochs)])
    return order.reshape(epochs, steps, workers, batch).astype(np.int32)


def export(
    path: str | os.PathLike,
    *,
    hidden=(1024, 1024),
    seed: int = 0,
    workers: int = 2,
    batch: int = 32,
    epochs: int = 1,
    weights: list[np.ndarray] | None = None,
) -> None:
    """Writes the archive described above to ``path`` (``weights``: the
    initial weights to write, by default :func:`initial_weights`)."""
    from keras_skip.bench.workers import workloads

    (x, y), (x_test, y_test) = workloads.load_mnist_subset(seed)
    weights = initial_weights(hidden, seed) if weights is None else weights
    if len(weights) % 2:
        raise ValueError(
            "`weights` must alternate kernels and biases. "
            f"Received {len(weights)} arrays"
        )
    arrays = {}
    for i in range(len(weights) // 2):
        arrays[f"kernel_{i}"] = weights[2 * i]
        arrays[f"bias_{i}"] = weights[2 * i + 1]
    meta = {
        "seed": seed,
        "hidden": list(hidden),
        "workers": workers,
        "batch": batch,
        "epochs": epochs,
    }
    with open(path, "wb") as f:
        np.savez(
            f,
            x=x,
            y=y,
            x_test=x_test,
            y_test=y_test,
            order=batch_order(len(x), workers, batch, epochs, seed),
            meta=np.asarray(json.dumps(meta)),
            **arrays,
        )


def load_weights(path: str | os.PathLike) -> list[np.ndarray]:
    """``[kernel_0, bias_0, ...]`` from an ``.npz`` of ``kernel_<i>`` and
    ``bias_<i>`` arrays (what a benchmark worker writes with its
    ``initial_weights`` setting)."""
    with np.load(path) as archive:
        layers = sum(1 for name in archive.files if name.startswith("kernel_"))
        return [
            archive[f"{kind}_{i}"] for i in range(layers) for kind in ("kernel", "bias")
        ]


def load(path: str | os.PathLike) -> dict:
    """The archive at ``path``: its arrays, ``meta`` as a dict and
    ``weights``, the kernels and biases in order."""
    with np.load(path) as archive:
        loaded = {name: archive[name] for name in archive.files}
    loaded["meta"] = json.loads(str(loaded["meta"]))
    layers = sum(1 for name in loaded if name.startswith("kernel_"))
    loaded["weights"] = [
        array
        for i in range(layers)
        for array in (loaded[f"kernel_{i}"], loaded[f"bias_{i}"])
    ]
    return loaded
