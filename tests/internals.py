"""The optimizer's internal state that tests compare with the reference maths.

The package steers the optimizer through `optimizer.steering` only; tests also
read state that no user needs (each replica's correction, the unsent part of
a compressed update, the interval variable's every copy). Those reads are
named here, in one place, so that a change of the optimizer's internals
changes this file and not the tests.
"""


def corrections(optimizer) -> list:
    """Each trainable variable's correction (a per-replica variable)."""
    return list(optimizer._corrections)


def slot_variables(optimizer) -> list:
    """The inner optimizer's float state that averages may cover."""
    return optimizer._slots.slots()


def model_state(optimizer) -> list:
    """The model's non-trainable float variables that averages cover."""
    return optimizer._model_state


def unsent(optimizer) -> list:
    """Per replica and variable: what compression has not sent yet."""
    return list(optimizer._codec.errors)


def gamma(optimizer) -> float:
    """The sum of the learning rates since the period began."""
    return float(optimizer._gamma.numpy())


def interval_variable(optimizer):
    """The interval variable the train function reads (mirrored)."""
    return optimizer._interval_variable


def full_average_step(optimizer) -> int:
    """With overlap: the step whose due average is forced full, or -1."""
    return int(optimizer._schedule.full_at.numpy())


def separate_average_functions(optimizer) -> dict:
    """The average functions traced outside the train function, by key."""
    return optimizer._averager.functions


def delay_averages(optimizer, seconds: float) -> None:
    """Makes every average of the built `optimizer` sleep `seconds` first,
    inside the train function: an injected delay in the communication path."""
    import time

    import numpy as np
    import tensorflow as tf

    averager = optimizer._averager
    average = averager.average

    def slow(distribution, include_slots=False, fragment=None):
        sleep = tf.numpy_function(
            lambda: time.sleep(seconds) or np.int64(0), [], tf.int64
        )
        with tf.control_dependencies([sleep]):
            return average(distribution, include_slots, fragment)

    averager.average = slow


def fragments(optimizer) -> list:
    """Per fragment of a streaming average: the flat indices of its
    coordinates, with the trainable variables flattened and concatenated in
    the optimizer's order (the reference's `fragments` as index arrays)."""
    import numpy as np

    sizes = [int(np.prod(v.shape)) for v in optimizer._trainable_variables]
    starts = np.cumsum([0, *sizes])
    every = [list(range(len(sizes)))]  # one fragment: the whole model
    return [
        np.concatenate([np.arange(starts[i], starts[i + 1]) for i in members])
        for members in getattr(optimizer._schedule, "members", every)
    ]


def fragment_local_steps(optimizer) -> tuple[int, ...]:
    """Per fragment: the local steps since its last average."""
    return tuple(int(s) for s in optimizer._schedule.local.numpy())


def flight(optimizer):
    """The host side of delayed averages (`_flight.Flight`), or None."""
    return optimizer._flight


def fragment_in_flight(optimizer) -> int | None:
    """The fragment whose delayed average is on its way, or None."""
    return optimizer._schedule.flying_fragment()


def delayed_parts(optimizer) -> set:
    """The fragments (None: the whole payload) whose average was delayed at
    least once: its all-reduce ran beside the steps, in the flight's thread."""
    return set(optimizer._flight._reduce)
