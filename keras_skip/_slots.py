"""What an average does with the inner optimizer's state (its slots).

One policy is chosen when the optimizer is built, from `optimizer_state`
(``maths.OPTIMIZER_STATE_POLICIES``): `Local` keeps each replica's slots,
`Averaged` averages them with the weights, `AveragedSecondMoments` averages
only the second moments (the preconditioner, such as Adam's velocities),
`Reset` sets them back to the constants they start from. Whatever the
policy, a synchronous step averages them first if they differ between
replicas (all its replicas then take the same step from the same state), and
so does every boundary average that asks for them (``include_slots``).
"""

from __future__ import annotations

import tensorflow as tf

from keras_skip import _compat
from keras_skip.steering import first_copy, tf_variable


def slot_variables(inner) -> list[tf.Variable]:
    """The inner optimizer's float state that averages may cover: its
    variables but its step counter and learning rate."""
    skip = {
        id(_compat.iterations_variable(inner)),
        id(_compat.learning_rate_variable(inner)),
    }
    return [
        tf_variable(v)
        for v in inner.variables
        if id(v) not in skip and _compat.is_float(v)
    ]


class Local:
    """Each replica keeps its own slots (``optimizer_state="local"``).

    `apart` is the optimizer's variable that is 1 while the slots differ
    between replicas; a synchronous step must not start from them.
    """

    def __init__(self, inner, apart):
        self._inner = inner
        self.apart = apart

    def slots(self) -> list[tf.Variable]:
        return slot_variables(self._inner)

    def sent(self, slots, include_slots: bool) -> list:
        """The slots an average sends with the weights."""
        return list(slots) if include_slots else []

    def after_local_step(self, slots) -> None:
        if slots:
            self.apart.value.assign(1)

    def after_average(self, slots, include_slots: bool, overlapped: bool) -> None:
        """`overlapped`: the replicas each took a step after what was sent."""
        if include_slots and not overlapped:
            self.apart.value.assign(0)


class Averaged(Local):
    """Every average averages the slots (``optimizer_state="average"``)."""

    def sent(self, slots, include_slots: bool) -> list:
        return list(slots)

    def after_average(self, slots, include_slots: bool, overlapped: bool) -> None:
        if not overlapped:
            self.apart.value.assign(0)


class AveragedSecondMoments(Local):
    """Every average averages the slots that estimate the squared gradient
    (``optimizer_state="average_second_moments"``), and the other slots
    stay each replica's own. With skewed shards each replica's own second
    moments scale its steps differently, which the correction, measured in
    weight space, cannot undo (see the algorithm page); shared second
    moments cost one slot's bytes, where ``"average"`` sends them all.
    `second`: the ids of those slots (`second_moment_ids`)."""

    def __init__(self, inner, apart, second: set[int]):
        super().__init__(inner, apart)
        self._second = second

    def sent(self, slots, include_slots: bool) -> list:
        if include_slots:
            return list(slots)
        return [s for s in slots if id(s) in self._second]


def second_moment_ids(inner) -> set[int]:
    """The ids of `inner`'s second-moment slot variables; a ValueError if it
    keeps none (SGD, Lion)."""
    found = {id(tf_variable(v)) for v in _compat.second_moments(inner)}
    if not found:
        raise ValueError(
            "SkipCorrectionOptimizer(optimizer_state='average_second_moments') "
            "averages the inner optimizer's second moments (Adam's "
            "velocities, Adagrad's accumulators, ...), but "
            f"{type(inner).__name__} keeps none. Use optimizer_state="
            "'average' or 'local'."
        )
    return found


class Reset(Local):
    """Every interval average sets the slots back to the constants they
    start from (``optimizer_state="reset"``); `starts`: those constants, by
    slot variable's id (see `constant_starts`)."""

    def __init__(self, inner, apart, starts: dict[int, float]):
        super().__init__(inner, apart)
        self._starts = starts

    def after_average(self, slots, include_slots: bool, overlapped: bool) -> None:
        if not include_slots:
            for s in slots:
                s.assign(tf.fill(s.shape, tf.cast(self._starts[id(s)], s.dtype)))
        if not overlapped:
            self.apart.value.assign(0)


def build(optimizer_state: str, inner, add_variable, starts: dict[int, float]):
    """The policy for `optimizer_state`, its variable made with the
    optimizer's `add_variable`; `starts`: see `constant_starts` (used by
    ``"reset"`` only)."""
    if optimizer_state == "average_second_moments":
        second = second_moment_ids(inner)  # refused before any variable
    # 1 while the slots differ between replicas: a synchronous step must not
    # start from them.
    apart = add_variable((), dtype="int64", name="slots_apart")
    if optimizer_state == "reset":
        return Reset(inner, apart, starts)
    if optimizer_state == "average_second_moments":
        return AveragedSecondMoments(inner, apart, second)
    return {"local": Local, "average": Averaged}[optimizer_state](inner, apart)


def constant_starts(inner) -> dict[int, float]:
    """For ``optimizer_state="reset"``: the constant each slot starts from (0
    for momentum, `initial_accumulator_value` for Adagrad's accumulators, 1
    for Nadam's momentum schedule), read once, right after the inner
    optimizer is built. A slot that starts from anything else (the weights)
    cannot be reset: a ValueError names it."""
    if tf.inside_function():
        raise ValueError(
            "SkipCorrectionOptimizer(optimizer_state='reset') reads the "
            "values the inner optimizer's state starts from when it is "
            "built, which must happen eagerly: call "
            "`optimizer.build(model.trainable_variables)` inside "
            "`strategy.scope()` before the training loop."
        )
    starts = {}
    for slot in slot_variables(inner):
        with tf.init_scope():
            value = first_copy(slot).read_value()
            low = float(tf.reduce_min(value).numpy())
            high = float(tf.reduce_max(value).numpy())
        if low != high:
            raise ValueError(
                "SkipCorrectionOptimizer(optimizer_state='reset') sets the "
                "inner optimizer's state back to where it started at every "
                f"average, but {type(inner).__name__}'s "
                f"variable '{slot.name}' does not start from a constant "
                "(it starts from the weights). Use optimizer_state="
                "'average' or 'local'."
            )
        starts[id(slot)] = low
    return starts
