"""When a local step's due average runs: after the step, or alongside it.

`Sequential` averages after the step the average is due after. `Overlapped`
(``overlap=True`` on several replicas) starts the due interval average's
all-reduce before the step, on the values the step starts from, so that it
runs while the step computes; the mean lands after the step, and each
replica keeps its step's displacement on top (``maths.overlapped_average``).
Until the next average includes that step, the weights *carry* it. Chosen
when the optimizer is built. Cross-replica context.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import keras
import tensorflow as tf

from keras_skip import _updates


class Sent(NamedTuple):
    """An overlapped average's state, taken before the local step."""

    due: tf.Tensor  # an average is due after the step
    overlapped: tf.Tensor  # ... and it is the overlapped one, started here
    moved: tf.Tensor  # the weights had moved since the last average
    gamma: tf.Tensor  # the learning rates' sum before the step
    snapshot: list  # per replica: the payload before it
    means: list  # the payload's means (empty when not overlapped)


def _nothing():
    return tf.constant(False)


class Sequential:
    """A due average runs after the step. `local_steps` and `interval`: the
    optimizer's counter and interval variables."""

    def __init__(self, local_steps, interval, carried=None, full_at=None):
        self._local_steps = local_steps
        self._interval = interval
        # With `overlap` (on one replica they stay at rest): the variables
        # `Overlapped` describes; else None.
        self.carried = carried
        self.full_at = full_at

    def carried_steps(self) -> int:
        """The local steps the weights hold that no average has included, on
        top of the counter (eagerly)."""
        return 0 if self.carried is None else int(self.carried.numpy())

    def moved(self):
        """Whether the weights moved since the last average (a boolean tensor)."""
        return self._local_steps.value > 0

    def first_of_period(self):
        """Whether the coming local step is its period's first."""
        return self._local_steps.value == 0

    def before_step(self, distribution) -> Sent | None:
        return None

    def after_step(self, sent, local_steps, average, average_overlapped):
        """Runs `average()` if one is due after the step (`local_steps`: the
        counter after it). The conditions' names tell the averages apart in
        the graph: tests check that a local step communicates in them only."""
        return tf.cond(
            local_steps >= self._interval.value, average, _nothing, name="average_due"
        )

    def after_average(self, overlapped: bool) -> None:
        pass


class Overlapped(Sequential):
    """A due interval average runs alongside the step, unless the host asked
    for a full one at this step (`full_at`: an epoch's last step, an
    overridden interval's average). `carried`: 1 while the weights hold the
    step an overlapped average ran alongside. `payload()` returns the
    optimizer's ``(weights, slots, payload)``; `codec` is its codec."""

    def __init__(
        self,
        local_steps,
        interval,
        *,
        carried,
        full_at,
        iterations,
        gamma,
        codec,
        payload: Callable[[], tuple[list, list, list]],
    ):
        super().__init__(local_steps, interval, carried, full_at)
        self._iterations = iterations
        self._gamma = gamma
        self._codec = codec
        self._payload = payload

    def moved(self):
        return tf.logical_or(super().moved(), self.carried.value > 0)

    def first_of_period(self):
        # After an overlapped average the weights hold a local step: the
        # period's start was recorded by that average.
        return tf.logical_and(super().first_of_period(), self.carried.value == 0)

    def before_step(self, distribution) -> Sent:
        """Reads what an average would send (the values before the step)
        and, if an overlapped average is due after the step, starts its
        all-reduce. Nothing here writes a variable the step touches, and the
        step writes nothing read here after these reads, so the runtime runs
        the all-reduce while the step's forward and backward pass compute."""
        extended = distribution.extended
        due = self._local_steps.value + 1 >= self._interval.value
        overlapped = tf.logical_and(due, self._iterations.value != self.full_at.value)
        moved = self.moved()
        gamma = tf.identity(self._gamma.value)
        weights, _, payload = self._payload()
        # Read only when due: the step's update then copies what it writes.
        values = _updates.when(
            distribution,
            overlapped,
            lambda: extended.call_for_each_replica(
                lambda: [tf.identity(v) for v in payload]
            ),
            payload,
        )
        codec, rest = self._codec, payload[len(weights) :]

        def send():
            per_replica = codec.send(distribution, weights, rest, moved, values)
            return codec.reduce(distribution, weights, rest, per_replica)

        dtypes = codec.wire_types(weights)
        means = _updates.when(distribution, overlapped, send, payload, dtypes)
        return Sent(due, overlapped, moved, gamma, values, means)

    def after_step(self, sent, local_steps, average, average_overlapped):
        return tf.cond(
            sent.overlapped,
            lambda: average_overlapped(sent),
            lambda: tf.cond(sent.due, average, _nothing, name="average_due"),
            name="average_overlapped",
        )

    def after_average(self, overlapped: bool) -> None:
        self.carried.value.assign(1 if overlapped else 0)


def build(add_variable, overlap: bool, replicas: int, local_steps, interval, **parts):
    """`Sequential`, or with `overlap` `Overlapped` on several replicas
    (`parts`: its other arguments). The variables of overlap are made with
    the optimizer's `add_variable` whatever the number of replicas (a
    checkpoint's variables do not depend on it); on one replica nothing
    overlaps and they stay at rest."""
    if not overlap:
        return Sequential(local_steps, interval)
    # 1 while the weights hold the local step an overlapped average ran
    # alongside, which no average has included yet.
    carried = add_variable((), dtype="int64", name="carried_step")
    # The step (iteration) whose due average must be a full one, as the host
    # arranged it (an epoch's last step, an overridden interval's average),
    # or -1.
    full_at = add_variable(
        (),
        initializer=keras.initializers.Constant(-1),
        dtype="int64",
        name="full_average_step",
    )
    if replicas == 1:
        return Sequential(local_steps, interval, carried, full_at)
    return Overlapped(local_steps, interval, carried=carried, full_at=full_at, **parts)
