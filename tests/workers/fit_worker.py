"""A MultiWorkerMirroredStrategy worker for the multi-worker tests.

Run by keras_skip.bench.workers.launcher with TF_CONFIG set. The only argument is a
JSON configuration (see DEFAULTS); a "workers" entry maps a worker index to
overrides for that worker. Writes worker-<i>.npz into config["out"] and
prints marker lines the tests wait for. The index is the launcher's process
index, KERAS_SKIP_WORKER (with a chief, 0 is the chief).

With ``--serve DIR`` it trains one job after another instead, for the tests'
shared worker processes (``pool.py``).
"""

import contextlib
import hashlib
import json
import os
import pathlib
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import internals  # tests/internals.py: reads of the optimizer's state

DEFAULTS = {
    "mode": "skip",  # "skip", "stock" (plain Keras optimizer) or "unfixed"
    "interval": 3,
    "correction": 1.0,
    "adaptive": False,
    "measure_drift": False,
    "outer": None,  # [learning_rate, momentum] of a Nesterov SGD outer optimizer
    "policy": None,  # a keras.mixed_precision policy, such as "mixed_float16"
    "compression": None,
    "group_size": None,
    "overlap": False,
    "fragments": 1,
    "boundary": "full",
    "local_devices": 1,  # logical CPU devices (replicas) of each worker
    "width": 16,  # units of the hidden layer
    "overflow_step": None,  # this worker's activations are inf at this step
    "step_sleep": 0.0,  # seconds every forward pass of this worker sleeps
    "momentum": 0.0,
    "adam": False,  # Adam(0.01) as the inner optimizer instead of SGD
    "optimizer_state": "local",
    "epochs": 2,
    "samples": 256,
    "batch_per_replica": 8,
    "steps_per_execution": 1,
    "dataset": False,  # True: a batched tf.data.Dataset; "unknown": of unknown length
    "validation": False,
    "backup_dir": None,
    "peer_timeout": 10.0,
    "pause_epoch": None,  # sleep at the start of this epoch (a window to kill in)
    "pause_seconds": 0.0,
    "version": None,  # pretend to be another keras-skip version
    "set_interval": None,  # change the interval after the optimizer is created
    "delay": None,  # [batch, seconds]: this worker sleeps before that batch
    "stop_at": None,  # this worker sets stop_training after this step
    "stop_at_epoch": None,  # ... at the end of this epoch
    "inspect": False,  # report the collectives of a step outside its averages
    "trace": None,  # a directory for keras_skip.TraceCallback's files
    "seed": 0,
    "out": ".",
}


#: What `start` sets for the whole process: a worker that changes one of
#: these runs in a process of its own.
PROCESS_SETTINGS = ("mode", "local_devices", "version", "peer_timeout")


def make_data(config):
    import numpy as np

    rng = np.random.default_rng(config["seed"])
    x = rng.normal(size=(config["samples"], 6)).astype("float32")
    noise = 0.1 * rng.normal(size=(config["samples"], 1))
    y = (x @ rng.normal(size=(6, 1)) + noise).astype("float32")
    return x, y


ARMED = [False]  # set by a callback at config["overflow_step"]


def overflow_layer():
    """Multiplies the activations by inf while ARMED (on this worker only)."""
    import keras
    import numpy as np
    import tensorflow as tf

    def factor():
        return np.float32(np.inf if ARMED[0] else 1.0)

    def scale(x):
        value = tf.numpy_function(factor, [], tf.float32)
        value.set_shape(())
        return x * tf.cast(value, x.dtype)

    return keras.layers.Lambda(scale)


def sleep_layer(seconds):
    """Sleeps `seconds` in every forward pass: a slower worker."""
    import keras
    import numpy as np
    import tensorflow as tf

    def sleep():
        time.sleep(seconds)
        return np.float32(0)

    def delay(x):
        value = tf.numpy_function(sleep, [], tf.float32)
        value.set_shape(())
        return x + tf.stop_gradient(value)

    return keras.layers.Lambda(delay)


#: The conditions of SkipCorrectionOptimizer's step whose first branch is a
#: synchronization (a synchronous step or an average), by name.
SYNCHRONIZING = ("synchronous_step", "average_")


@contextlib.contextmanager
def counting_reductions(strategy):
    """The reduce ops of every ``strategy.reduce`` call made inside, in a
    list (the strategy's class is patched meanwhile)."""
    reductions = []
    reduce = type(strategy).reduce

    def counting_reduce(self, *args, **kwargs):
        reductions.append(args[0] if args else kwargs.get("reduce_op"))
        return reduce(self, *args, **kwargs)

    type(strategy).reduce = counting_reduce
    try:
        yield reductions
    finally:
        type(strategy).reduce = reduce


def collectives_outside_synchronizations(graph, inside=False) -> list[str]:
    """The collective operations of a traced step or execution (and of the
    conditions and loops in it) that do not sit in the first branch of a
    synchronizing condition: those a local step would execute."""
    found = []
    for op in graph.get_operations():
        if op.type.startswith("Collective") and not inside:
            found.append(op.name)
        if hasattr(op, "_true_graph"):
            name = op.name.rsplit("/", 1)[-1]
            synchronizing = name.startswith(SYNCHRONIZING)
            found += collectives_outside_synchronizations(
                op._true_graph, inside or synchronizing
            )
            found += collectives_outside_synchronizations(op._false_graph, inside)
        for loop_graph in ("_body_graph", "_cond_graph"):
            if hasattr(op, loop_graph):
                found += collectives_outside_synchronizations(
                    getattr(op, loop_graph), inside
                )
    return found


def build_model(config, strategy):
    """The model, compiled under `strategy`, with seeded initial weights."""
    import keras

    if config["policy"]:
        keras.mixed_precision.set_global_policy(config["policy"])
    with strategy.scope():
        layers = [
            keras.Input((6,)),
            keras.layers.Dense(
                config["width"],
                activation="tanh",
                kernel_initializer=keras.initializers.GlorotUniform(1),
            ),
        ]
        if config["overflow_step"] is not None:
            layers.append(overflow_layer())
        if config["step_sleep"]:
            layers.append(sleep_layer(config["step_sleep"]))
        layers.append(
            keras.layers.Dense(
                1,
                kernel_initializer=keras.initializers.GlorotUniform(2),
                dtype="float32",
            )
        )
        model = keras.Sequential(layers)
        inner = (
            keras.optimizers.Adam(0.01)
            if config["adam"]
            else keras.optimizers.SGD(0.05, momentum=config["momentum"])
        )
        if config["mode"] == "skip":
            import keras_skip

            outer = None
            if config["outer"]:
                rate, momentum = config["outer"]
                outer = keras.optimizers.SGD(rate, momentum=momentum, nesterov=True)
            optimizer = keras_skip.SkipCorrectionOptimizer(
                inner,
                interval=config["interval"],
                correction=config["correction"],
                measure_drift=config["measure_drift"],
                outer_optimizer=outer,
                compression=config["compression"],
                group_size=config["group_size"],
                overlap=config["overlap"],
                fragments=config["fragments"],
                boundary=config["boundary"],
                optimizer_state=config["optimizer_state"],
            )
        else:
            optimizer = inner
        model.compile(
            optimizer=optimizer,
            loss="mse",
            steps_per_execution=config["steps_per_execution"],
        )
    return model


def several_cpu_replicas(count):
    """Gives this worker `count` replicas on logical CPU devices.

    MultiWorkerMirroredStrategy takes every local GPU as a replica but only
    one CPU; this stands in for a machine with `count` GPUs by handing it
    `count` logical CPU devices instead (the collectives are the real ones).
    """
    import tensorflow as tf
    from tensorflow.python.distribute import collective_all_reduce_strategy as car

    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(
        cpu, [tf.config.LogicalDeviceConfiguration()] * count
    )

    def local_devices(self, cluster_resolver, worker_device):
        devices = tuple(f"{worker_device}/device:CPU:{i}" for i in range(count))
        return devices, "CPU"

    car.CollectiveAllReduceExtended._initialize_local_devices = local_devices


def configure(given: dict, index: int) -> dict:
    """DEFAULTS with `given` and this worker's own overrides."""
    config = dict(DEFAULTS)
    config.update({k: v for k, v in given.items() if k != "workers"})
    config.update(given.get("workers", {}).get(str(index), {}))
    return config


def start(config):
    """This process's strategy (and the process-wide settings it needs)."""
    import tensorflow as tf

    if config["local_devices"] > 1:
        several_cpu_replicas(config["local_devices"])
    if config["mode"] == "unfixed":
        strategy = tf.distribute.MultiWorkerMirroredStrategy()
    else:
        import keras_skip
        from keras_skip import _compat, _version

        if config["mode"] == "stock":
            # A plain Keras optimizer needs the opt-in; a model compiled with
            # SkipCorrectionOptimizer gets the fixes on its own.
            _compat.apply_keras_fixes()
        if config["version"]:
            _version.__version__ = config["version"]
        strategy = keras_skip.multi_worker_strategy(peer_timeout=config["peer_timeout"])
    return strategy


def train(config, strategy, index):
    """Trains as `config` says and writes worker-<index>.npz."""
    import keras
    import numpy as np
    import tensorflow as tf

    if config["mode"] != "unfixed":  # stock Keras, untouched by keras_skip
        import keras_skip

    keras.utils.set_random_seed(config["seed"])
    x, y = make_data(config)
    global_batch = config["batch_per_replica"] * strategy.num_replicas_in_sync
    model = build_model(config, strategy)
    optimizer = model.optimizer
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        optimizer = optimizer.inner_optimizer  # the mixed_float16 policy

    if config["set_interval"]:
        # Variables start from worker 0's values (MultiWorkerMirroredStrategy
        # broadcasts them), so only a change after building differs. Every
        # worker builds (variable creation is itself a collective).
        with strategy.scope():
            optimizer.build(model.trainable_variables)
        if config["set_interval"] != "build only":
            optimizer.interval = config["set_interval"]

    def digest():
        h = hashlib.sha1()
        for w in model.get_weights():
            h.update(np.ascontiguousarray(w).tobytes())
        return h.hexdigest()[:16]

    class Markers(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.after_averages = []  # (step, digest) right after each average
            self.first_step = None
            self.seen = 0  # training batches begun
            self.seconds = []  # of each execution of the train function
            self.stamps = []  # (begin, end) wall-clock times of each execution
            self.batch_losses = []  # the loss in each execution's logs
            self.began = 0.0
            self.delays_beside_steps = False

        def on_train_begin(self, logs=None):
            if backup is not None:
                task = strategy.cluster_resolver.task_type
                print(f"BACKUP {task} {backup.worker_directory.name}", flush=True)

        def on_epoch_begin(self, epoch, logs=None):
            print(f"EPOCH {epoch} BEGIN", flush=True)
            if epoch == config["pause_epoch"]:
                time.sleep(config["pause_seconds"])

        def on_train_batch_begin(self, batch, logs=None):
            ARMED[0] = self.seen == config["overflow_step"]
            if config["delay"] and self.seen == config["delay"][0]:
                time.sleep(config["delay"][1])
            self.seen += 1
            self.began = time.perf_counter()
            self.began_at = time.time()

        def on_train_batch_end(self, batch, logs=None):
            # What the adaptive rule reads during fit: whether delayed
            # averages run beside the steps.
            steering = getattr(optimizer, "steering", None)
            if steering is not None:
                self.delays_beside_steps = steering.delays_beside_steps()
            self.seconds.append(time.perf_counter() - self.began)
            self.stamps.append((self.began_at, time.time()))
            self.batch_losses.append(float(logs["loss"]))
            step = int(self.model.optimizer.iterations.numpy())
            if self.first_step is None:
                self.first_step = [w.copy() for w in self.model.get_weights()]
            if config["mode"] == "skip" and optimizer.local_steps_since_average == 0:
                self.after_averages.append((step, digest()))
            print(f"STEP {step}", flush=True)

        def on_epoch_end(self, epoch, logs=None):
            print(f"EPOCH {epoch} END {digest()}", flush=True)

    class StopAt(keras.callbacks.Callback):
        """Listed first: stops training on this worker alone."""

        def on_train_batch_end(self, batch, logs=None):
            if self.model.optimizer.iterations.numpy() == config["stop_at"]:
                print(f"STOP REQUESTED {config['stop_at']}", flush=True)
                self.model.stop_training = True

        def on_epoch_end(self, epoch, logs=None):
            if epoch == config["stop_at_epoch"]:
                print(f"STOP REQUESTED AT EPOCH END {epoch}", flush=True)
                self.model.stop_training = True

    stops = config["stop_at"] is not None or config["stop_at_epoch"] is not None
    callbacks = [StopAt()] if stops else []
    backup = None
    if config["backup_dir"]:
        backup = keras_skip.BackupAndRestore(config["backup_dir"])
        callbacks.append(backup)
    markers = Markers()
    adaptive = None
    if config["mode"] == "skip":
        if config["adaptive"]:
            adaptive = keras_skip.AdaptiveIntervalCallback(verbose=0)
            callbacks.append(adaptive)
        else:
            callbacks.append(keras_skip.SkipCorrectionCallback())

    callbacks.append(markers)  # last: it sees the boundary averages
    if config["trace"]:
        callbacks.insert(0, keras_skip.TraceCallback(config["trace"]))
    if config["dataset"]:
        data = tf.data.Dataset.from_tensor_slices((x, y)).batch(global_batch)
        if config["dataset"] == "unknown":
            data = data.filter(lambda *_: True)
        fit_args = dict(x=data)
    else:
        fit_args = dict(x=x, y=y, batch_size=global_batch, shuffle=False)
    if config["validation"]:
        fit_args["validation_data"] = (x[:64], y[:64])
    history = model.fit(
        epochs=config["epochs"], verbose=0, callbacks=callbacks, **fit_args
    )

    result = {
        "weights": np.concatenate([w.ravel() for w in model.get_weights()]),
        "first_step": np.concatenate([w.ravel() for w in markers.first_step]),
        "loss": np.array(history.history["loss"]),
        "iterations": int(model.optimizer.iterations.numpy()),
        "after_averages": np.array([s for s, _ in markers.after_averages]),
        "after_average_digests": np.array([d for _, d in markers.after_averages]),
        "evaluate": model.evaluate(x[:64], y[:64], verbose=0),
        "seconds": np.array(markers.seconds),
        "stamps": np.array(markers.stamps),
        # Whether delayed averages ran in a thread beside the steps.
        "threaded": bool(getattr(getattr(optimizer, "_flight", None), "threaded", 0)),
        "batch_losses": np.array(markers.batch_losses),
    }
    if config["inspect"]:
        graphs = getattr(model.train_function, "traced_graphs", [])
        result["traced_graphs"] = len(graphs)
        result["collectives"] = np.array(
            [
                f"{graph.name}: {name}"
                for graph in graphs
                for name in collectives_outside_synchronizations(graph)
            ],
            dtype=str,
        )
        # The reductions across workers of resetting the metrics, as fit
        # and evaluate do at their start; the metrics must end at zero.
        with counting_reductions(strategy) as reductions:
            model.reset_metrics()
        result["reset_reductions"] = len(reductions)
        result["metrics_after_reset"] = np.array(
            [
                float(np.abs(c.numpy()).sum())
                for metric in model.metrics
                for v in metric.variables
                for c in strategy.experimental_local_results(v.value)
            ]
        )
    if config["mode"] == "skip":
        corrections = [c for c in internals.corrections(optimizer) if c is not None]
        result["corrections"] = np.concatenate([c.numpy().ravel() for c in corrections])
        # Every local replica's corrections, one row each.
        local = [strategy.experimental_local_results(c.value) for c in corrections]
        result["local_corrections"] = np.stack(
            [
                np.concatenate([np.ravel(copy) for copy in copies])
                for copies in zip(*local, strict=True)
            ]
        )

        result["averages"] = optimizer.averages_performed
        result["delays_beside_steps"] = markers.delays_beside_steps
        result["bytes_sent"] = optimizer.bytes_sent
        for key in ("averages", "bytes_sent", "drift"):
            if key in history.history:
                result[f"history_{key}"] = np.array(history.history[key])
        if adaptive is not None:
            decision = optimizer.interval_decision
            result["decision"] = np.array(
                [decision.interval, decision.t_comp, decision.t_comm]
            )
            result["probes"] = adaptive.probes
            result["probe_traffic"] = np.array(
                [adaptive.collectives, adaptive.bytes_sent]
            )
            result["history_interval"] = np.array(history.history["interval"])
    np.savez(os.path.join(config["out"], f"worker-{index}.npz"), **result)
    print(f"DONE {digest()}", flush=True)


def main():
    index = int(os.environ["KERAS_SKIP_WORKER"])
    config = configure(json.loads(sys.argv[1]), index)
    train(config, start(config), index)


if __name__ == "__main__":
    # Keras imports scikit-learn for its wrappers whenever it is installed
    # (the demo's data package brings it); this worker never uses it, and it
    # is a fifth of the worker's start.
    sys.modules.setdefault("sklearn", None)
    if sys.argv[1] == "--serve":
        import pool

        pool.serve(pathlib.Path(sys.argv[2]), DEFAULTS, start, configure, train)
    else:
        main()
