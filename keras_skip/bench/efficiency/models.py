"""The models of the efficiency map: the benchmark MLP and CNN of
:mod:`keras_skip.bench.workers.workloads`, and a small character-level
transformer language model."""

from __future__ import annotations

from keras_skip.bench.workers import workloads


def mlp(hidden: tuple[int, ...] = (256, 256)):
    """The benchmark MLP, narrower: 784-256-256-10 (0.27 M parameters)."""
    return workloads.mlp(hidden=hidden)


def cnn():
    """The benchmark CNN: two 3x3 convolutions with pooling (13 k parameters)."""
    import keras

    flat = [keras.Input((784,)), keras.layers.Reshape((28, 28, 1))]
    return keras.Sequential(flat + workloads.cnn().layers)


def char_lm(
    vocabulary: int = 128,
    length: int = 64,
    width: int = 64,
    heads: int = 4,
    blocks: int = 2,
    hidden: int = 128,
):
    """A decoder-only transformer over characters: token and position
    embeddings, ``blocks`` pre-norm blocks of causal self-attention and a
    GELU feed-forward layer, a final norm and a projection to the logits
    of the next character (about 80 k parameters with the defaults). No
    dropout, so that runs differ by the seed alone."""
    import keras

    class PositionEmbedding(keras.layers.Layer):
        def build(self, input_shape):
            self.table = self.add_weight(
                shape=(input_shape[-2], input_shape[-1]),
                initializer=keras.initializers.RandomNormal(stddev=0.02),
                name="positions",
            )

        def call(self, x):
            return x + self.table

    tokens = keras.Input((length,), dtype="int32")
    x = keras.layers.Embedding(vocabulary, width)(tokens)
    x = PositionEmbedding()(x)
    for _ in range(blocks):
        h = keras.layers.LayerNormalization()(x)
        h = keras.layers.MultiHeadAttention(heads, width // heads)(
            h, h, use_causal_mask=True
        )
        x = keras.layers.Add()([x, h])
        h = keras.layers.LayerNormalization()(x)
        h = keras.layers.Dense(hidden, activation="gelu")(h)
        h = keras.layers.Dense(width)(h)
        x = keras.layers.Add()([x, h])
    x = keras.layers.LayerNormalization()(x)
    return keras.Model(tokens, keras.layers.Dense(vocabulary)(x))


BUILDERS = {"mlp": mlp, "cnn": cnn, "lm": char_lm}
