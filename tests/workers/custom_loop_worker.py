"""A MultiWorkerMirroredStrategy worker training with a custom loop.

The only argument is the output directory; writes worker-<i>.npz there.
"""

import os
import sys


def main():
    out = sys.argv[1]
    index = int(os.environ["KERAS_SKIP_WORKER"])

    import keras
    import numpy as np
    import tensorflow as tf

    import keras_skip

    strategy = keras_skip.multi_worker_strategy(peer_timeout=10)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(256, 6)).astype("float32")
    y = (x @ rng.normal(size=(6, 1))).astype("float32")
    global_batch = 16
    with strategy.scope():
        model = keras.Sequential(
            [
                keras.Input((6,)),
                keras.layers.Dense(
                    8,
                    activation="tanh",
                    kernel_initializer=keras.initializers.GlorotUniform(1),
                ),
                keras.layers.Dense(
                    1, kernel_initializer=keras.initializers.GlorotUniform(2)
                ),
            ]
        )
        optimizer = keras_skip.SkipCorrectionOptimizer(
            keras.optimizers.SGD(0.05, momentum=0.5), interval=3
        )
        optimizer.build(model.trainable_variables)
    optimizer.attach(model)
    data = tf.data.Dataset.from_tensor_slices((x, y)).batch(global_batch)
    distributed = strategy.experimental_distribute_dataset(data)

    def replica_step(xb, yb):
        with tf.GradientTape() as tape:
            per_example = tf.reduce_mean(
                tf.square(model(xb, training=True) - yb), axis=-1
            )
            loss = tf.nn.compute_average_loss(
                per_example, global_batch_size=global_batch
            )
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables, strict=True))

    @tf.function
    def step(batch):
        strategy.run(replica_step, args=batch)

    first_local = None
    for _ in range(2):
        for batch in distributed:
            step(batch)
            if first_local is None:
                first_local = np.concatenate([w.ravel() for w in model.get_weights()])
        optimizer.average()
    weights = np.concatenate([w.ravel() for w in model.get_weights()])
    np.savez(
        os.path.join(out, f"worker-{index}.npz"),
        weights=weights,
        first_local=first_local,
        averages=optimizer.averages_performed,
    )
    print("DONE", flush=True)


if __name__ == "__main__":
    sys.modules.setdefault("sklearn", None)  # see fit_worker.py
    main()
