"""Several replicas in one process: logical CPU devices and a MirroredStrategy."""

from __future__ import annotations

import os


def configure_replicas(replicas: int) -> None:
    """Splits the CPU into ``replicas`` logical devices.

    Must run before TensorFlow executes anything in this process. A split
    into at least ``replicas`` devices that the process already configured
    is kept: making it smaller would take away devices that strategies
    created later in the process still name (a 4-replica `fit` after the
    overhead benchmark in a test process hung in its averages).
    """
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import tensorflow as tf

    cpu = tf.config.list_physical_devices("CPU")[0]
    if len(tf.config.get_logical_device_configuration(cpu) or ()) >= replicas:
        return
    try:
        tf.config.set_logical_device_configuration(
            cpu, [tf.config.LogicalDeviceConfiguration()] * replicas
        )
    except RuntimeError as error:
        devices = tf.config.list_logical_devices("CPU")
        if len(devices) < replicas:
            raise RuntimeError(
                f"{replicas} logical CPU devices are needed, but TensorFlow was "
                f"initialized with {len(devices)}; run this in a fresh process."
            ) from error


def mirrored_strategy(replicas: int):
    """A MirroredStrategy over the first ``replicas`` logical CPU devices, with
    collective keys of its own (see ``keras_skip._compat.isolate_collective_keys``)."""
    import tensorflow as tf

    from keras_skip import _compat

    strategy = tf.distribute.MirroredStrategy([f"/cpu:{i}" for i in range(replicas)])
    _compat.isolate_collective_keys(strategy)
    return strategy
