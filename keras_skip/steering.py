"""The one interface through which callbacks steer the optimizer.

Whoever decides something about the averages between two executions of the
train function (the epoch-boundary logic of `SkipCorrectionCallback`, the
adaptive probe, the stop agreement between workers, a benchmark's own
interval rule) does it through a `Steering`: it reads the counters, holds
the interval for a while and releases it, records the adaptive decision and
casts a stop vote. Nothing else reaches into the optimizer's state.

Every read and write here is eager and touches the first local copy (reads)
or every local copy (writes) of an optimizer variable directly: one
operation each, cheap enough to run between any two executions.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import keras
import numpy as np
import tensorflow as tf


class Counters(NamedTuple):
    """The optimizer's counters, as one read between executions sees them."""

    #: Local steps since the last average, as
    #: `SkipCorrectionOptimizer.local_steps_since_average` counts them (with
    #: `overlap`, the step an overlapped average ran alongside counts).
    local_steps: int
    #: Averages performed (interval and boundary averages).
    averages: int
    #: Optimizer steps taken (0-based index of the next step).
    iterations: int
    #: Averages and synchronous steps: the moments at which the workers
    #: exchanged anything.
    synchronizations: int


class Steering:
    """Steers a built `SkipCorrectionOptimizer` between executions.

    Get it from `optimizer.steering`; all but `strategy` need the optimizer
    built. Holding
    the interval (`hold`) makes the next average due when the local step
    count reaches the given value, and makes that average a full one (never
    overlapped); `interval` and checkpoints keep the interval outside the
    hold, and `release` gives it back (or sets a new one).

    Example:

    ```python
    import keras
    import keras_skip

    optimizer = keras_skip.SkipCorrectionOptimizer(
        keras.optimizers.SGD(0.1), interval=8
    )
    optimizer.build([keras.Variable([1.0, 2.0])])
    steering = optimizer.steering
    steering.hold(3)  # the next average after 3 local steps
    assert steering.held and optimizer.interval == 8
    steering.release()
    assert steering.counters().local_steps == 0
    ```
    """

    def __init__(self, strategy: tf.distribute.Strategy):
        self._strategy = strategy
        self._variables: dict | None = None
        self._outside: int | None = None
        self._steps_to_next: Callable[[], int] | None = None
        self._may_hold: Callable[[int], bool] | None = None
        #: Lands a delayed average on its way, if any (eagerly). Called
        #: before a vote is cast, whose landing would otherwise count the
        #: vote as this worker's own, and before an epoch's averages are
        #: counted.
        self.land: Callable[[], object] = lambda: None
        #: Whether delayed averages (``overlap >= 2``) run beside the steps
        #: in this `fit`: not across workers on data of unknown length, where
        #: the workers agree at every step on whether data remains.
        self.delays_beside_steps: Callable[[], bool] = lambda: False

    def bind(
        self,
        *,
        interval: keras.Variable,
        local_steps: keras.Variable,
        averages: keras.Variable,
        synchronous: keras.Variable,
        iterations: keras.Variable,
        decision: tuple[keras.Variable, keras.Variable, keras.Variable],
        votes: tuple[tf.Variable, ...] = (),
        carried: keras.Variable | None = None,
        full_at: keras.Variable | None = None,
        hold: keras.Variable | None = None,
        steps_to_next_average: Callable[[], int] | None = None,
        may_hold: Callable[[int], bool] | None = None,
    ) -> None:
        """Called by the optimizer when it is built: the state steered
        (`hold`: with fragments, 1 while the interval is held;
        `steps_to_next_average`, `may_hold`: see the methods of those
        names)."""
        self._variables = dict(
            interval=interval,
            local_steps=local_steps,
            averages=averages,
            synchronous=synchronous,
            iterations=iterations,
            decision=decision,
            votes=votes,
            carried=carried,
            full_at=full_at,
            hold=hold,
        )
        self._steps_to_next = steps_to_next_average
        self._may_hold = may_hold
        self._outside = None

    def _state(self, name: str):
        if self._variables is None:
            raise RuntimeError(
                "The optimizer's steering reads and writes its state, which "
                "exists once the optimizer is built: call "
                "`optimizer.build(model.trainable_variables)` (or start "
                "`fit`) first."
            )
        return self._variables[name]

    @property
    def strategy(self) -> tf.distribute.Strategy:
        """The distribution strategy the optimizer was built under."""
        return self._strategy

    def counters(self) -> Counters:
        """Reads the counters (this also waits for the steps in flight)."""
        carried = self._state("carried")
        averages = int(read(self._state("averages")))
        return Counters(
            local_steps=self.local_steps()
            + (int(read(carried)) if carried is not None else 0),
            averages=averages,
            iterations=int(read(self._state("iterations"))),
            synchronizations=averages + int(read(self._state("synchronous"))),
        )

    def local_steps(self) -> int:
        """Local steps the interval counts since the last average (without
        the step an overlapped average ran alongside)."""
        return int(read(self._state("local_steps")))

    def steps_to_next_average(self) -> int:
        """Local steps until the next interval average falls due (with
        fragments, the next fragment's), from the counters now."""
        self._state("interval")
        if self._steps_to_next is None:
            return self.interval_now() - self.local_steps()
        return self._steps_to_next()

    def may_hold(self, count: int) -> bool:
        """Whether an execution of `count` steps may be held to end with a
        full average (the epoch's last, `SkipCorrectionCallback`): not with
        fragments, whose held executions run a train function of their own."""
        self._state("interval")
        return True if self._may_hold is None else self._may_hold(count)

    def interval_now(self) -> int:
        """The interval the train function sees now (held or not)."""
        return int(read(self._state("interval")))

    @property
    def held(self) -> bool:
        """Whether the interval is held (between `hold` and `release`)."""
        return self._outside is not None

    @property
    def interval_outside_hold(self) -> int | None:
        """The interval a hold keeps for later, or None when not held."""
        return self._outside

    @interval_outside_hold.setter
    def interval_outside_hold(self, value: int) -> None:
        if self._outside is None:
            raise RuntimeError(
                "Steering.interval_outside_hold can be set only while the "
                "interval is held (between `hold` and `release`); set "
                "`optimizer.interval` instead."
            )
        self._outside = value

    def hold(self, due: int) -> None:
        """Makes the next average due when the local step count reaches
        `due`, and a full one, until `release`."""
        if self._outside is None:
            self._outside = self.interval_now()
        write(self._state("interval"), due)
        if self._state("hold") is not None:
            write(self._state("hold"), 1)
        if self._state("full_at") is not None:
            self.full_average_at(
                int(read(self._state("iterations"))) + due - self.local_steps() - 1
            )

    def release(self, interval: int | None = None) -> None:
        """Gives the train function back the interval outside the hold, or
        `interval` if given, and ends any `full_average_at`."""
        outside, self._outside = self._outside, None
        if outside is not None or interval is not None:
            write(self._state("interval"), outside if interval is None else interval)
        if self._state("hold") is not None:
            write(self._state("hold"), 0)
        self.full_average_at(-1)

    def full_average_at(self, step: int) -> None:
        """Makes an average due at optimizer step `step` (0-based) a full
        one; -1 for none. Without `overlap` every average is full already,
        and this does nothing."""
        full_at = self._state("full_at")
        if full_at is not None:
            write(full_at, step)

    def record(self, decision) -> None:
        """Records an adaptive `IntervalDecision` (saved with the optimizer)
        and releases the interval to the decided one."""
        self.release(decision.interval)
        decided, t_comp, t_comm = self._state("decision")
        write(decided, decision.interval)
        write(t_comp, decision.t_comp)
        write(t_comm, decision.t_comm)

    def decision(self):
        """The recorded adaptive `IntervalDecision`, or None."""
        decided, t_comp, t_comm = self._state("decision")
        if not int(read(decided)):
            return None
        from keras_skip.adaptive import IntervalDecision

        return IntervalDecision(
            int(read(decided)), float(read(t_comp)), float(read(t_comm))
        )

    def saved_value(self, variable):
        """What a checkpoint keeps of one of the optimizer's `variable`s: the
        interval outside a hold, no full average set for an execution, and
        no hold."""
        state = self._variables
        if variable is state["interval"] and self.held:
            return np.int64(self.interval_outside_hold)
        if variable is state["full_at"]:
            return np.int64(-1)
        if variable is state["hold"]:
            return np.int64(0)
        return variable.numpy()

    def vote_stop(self, vote: bool = True) -> None:
        """Sets this worker's stop vote, which the next synchronization
        carries to every worker (does nothing with a single worker)."""
        votes = self._state("votes")
        if votes:
            self.land()
        for v in votes:
            write(v, 1.0 if vote else 0.0)

    def stop_votes(self) -> float:
        """This worker's copy of the vote: its own vote until the next
        synchronization, then the mean of every replica's; 0 with a single
        worker."""
        votes = self._state("votes")
        return float(read(votes[0])) if votes else 0.0


def tf_variable(v):
    """The TensorFlow variable behind a Keras variable."""
    return v.value if isinstance(v, keras.Variable) else v


def first_copy(variable):
    """The first local copy of a (mirrored) optimizer variable."""
    variable = tf_variable(variable)
    return getattr(variable, "values", (variable,))[0]


def read(variable) -> int | float:
    """The value of the first local copy of an optimizer variable, eagerly:
    one read operation, without the distributed machinery."""
    copy = first_copy(variable)
    return tf.raw_ops.ReadVariableOp(resource=copy.handle, dtype=copy.dtype).numpy()


def write(variable, value) -> None:
    """Writes `value` into an optimizer variable between steps.

    Eagerly, each local copy of a mirrored variable is assigned directly: the
    same result as `variable.assign(value)` in cross-replica context, with
    one operation per copy (it matters to the adaptive probe's cost).
    """
    variable = tf_variable(variable)
    if not tf.executing_eagerly():
        variable.assign(value)
        return
    value = tf.constant(value, variable.dtype)
    for copy in getattr(variable, "values", (variable,)):
        tf.raw_ops.AssignVariableOp(resource=copy.handle, value=value)
