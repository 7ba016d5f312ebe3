"""What the replicas show at an epoch's end: a full average, or the latest
averages (``SkipCorrectionOptimizer(boundary=...)``).

With ``boundary="full"`` (`FullBoundary`) the epoch ends with a full
average, which waits for the whole model to cross the links while no step
computes. With ``boundary="latest"`` (`LatestAverages`) nothing crosses the
links at the boundary: every replica's weights are set aside and replaced
by the weights of each fragment's latest average, which are the same on
every replica (the period's start, kept by `_outer.PeriodStart`, or the
weights themselves where the fragment has not moved since); the model's
averaged state (BatchNorm statistics) is shown as its latest average left
it. Validation and callbacks see that model; the next epoch's first step
puts every replica's own weights back, so training goes on exactly as if
the boundary had not been there.
"""

from __future__ import annotations

import tensorflow as tf

from keras_skip import _compat, _updates
from keras_skip.steering import read, tf_variable, write


class FullBoundary:
    """The epoch ends with a full average: nothing is set aside."""

    stash: tuple = ()

    @property
    def shown(self) -> bool:
        return False

    def attach(self, strategy, model_state: list) -> None:
        pass

    def record_state(self, distribution, state: list) -> None:
        pass

    def restore(self, strategy) -> bool:
        return True


class LatestAverages(FullBoundary):
    """Shows the latest averages and puts the replicas' own weights back.

    `stash`: per trainable variable, where its replica's own weights wait
    while the averages are shown (an optimizer variable, saved with every
    replica's copy); `shown`: 1 while they are (saved, so a checkpoint taken
    then restores the replicas' own weights when training resumes);
    `period`: the `_outer.PeriodStart`; `schedule`: the averages' schedule;
    `stepped()`: the variables the steps update; `index_of`: a trainable
    variable's index.
    """

    def __init__(self, *, stash, shown, period, schedule, stepped, index_of):
        self.stash = stash
        self._shown = shown
        self._period = period
        self._schedule = schedule
        self._stepped = stepped
        self._index_of = index_of
        self._state: list = []
        # The model state's latest average and its own values while shown
        # (not saved: a resumed run's state restarts from its latest average).
        self._state_average: list = []
        self._state_stash: list = []
        self._state_set_aside = False
        self._functions: dict = {}

    @property
    def shown(self) -> bool:
        """Whether the replicas show the latest averages (eagerly)."""
        return bool(read(self._shown))

    def attach(self, strategy, model_state: list) -> None:
        """Makes the variables that keep the model's averaged state."""
        if [id(v) for v in model_state] == [id(v) for v in self._state]:
            return
        self._state = list(model_state)
        self._functions.clear()

        def like(v, name):
            with strategy.scope(), _compat.created_alike(strategy):
                return tf.Variable(
                    tf.identity(v.read_value()),
                    trainable=False,
                    name=name,
                    aggregation=tf.VariableAggregation.NONE,
                )

        self._state_average = [like(v, "state_average") for v in model_state]
        self._state_stash = [like(v, "state_stash") for v in model_state]

    def record_state(self, distribution, state: list) -> None:
        """After an average that carried the model's state: keeps its means."""
        by_id = {id(tf_variable(v)): i for i, v in enumerate(self._state)}
        for v in state:
            i = by_id.get(id(tf_variable(v)))
            if i is not None:
                distribution.extended.update(
                    self._state_average[i], _updates.assign, args=(v,), group=False
                )

    def show(self, strategy, flight=None) -> None:
        """Sets every replica's own weights aside and shows the latest
        averages (eagerly, no communication); the average `flight` carries
        (`_flight.Flight`), if any is on its way, lands first."""
        if self.shown:
            return
        if flight is not None:
            flight.land()
        with strategy.scope():
            self._function(("show",), self._show)()
        self._state_set_aside = True
        write(self._shown, 1)

    def restore(self, strategy) -> bool:
        """Puts every replica's own weights back (eagerly), unless the
        weights shown were replaced meanwhile: then keeps those and forgets
        the replicas' own. Returns whether nothing was replaced."""
        if not self.shown:
            return True
        with strategy.scope():
            unchanged = bool(self._function(("compare",), self._same)().numpy())
            if unchanged:
                restore = self._function(
                    ("restore", self._state_set_aside), self._restore
                )
                restore()
        write(self._shown, 0)
        self._state_set_aside = False
        return unchanged

    def _function(self, name, body):
        key = (*name, *(id(v) for v in self._stepped()))
        if key not in self._functions:
            self._functions[key] = _updates.function(_updates.in_strategy, body)
        return self._functions[key]

    def _fragments(self):
        """``(moved, variables)`` per fragment of the variables the steps update."""
        schedule, stepped = self._schedule, self._stepped()
        return [
            (schedule.moved(j), schedule.weights(stepped, j)) for j in schedule.parts()
        ]

    def _show(self, distribution):
        update = distribution.extended.update
        for moved, variables in self._fragments():
            for v in variables:
                v = tf_variable(v)
                stash = tf_variable(self.stash[self._index_of(v)])
                update(stash, _updates.assign, args=(v,), group=False)
                update(v, _average_of, args=(self._period.of(v), moved), group=False)
        for v, stash, average in zip(
            self._state, self._state_stash, self._state_average, strict=True
        ):
            update(stash, _updates.assign, args=(tf_variable(v),), group=False)
            update(tf_variable(v), _updates.assign, args=(average,), group=False)
        return tf.constant(True)

    def _restore(self, distribution):
        update = distribution.extended.update
        for _, variables in self._fragments():
            for v in variables:
                stash = tf_variable(self.stash[self._index_of(v)])
                update(tf_variable(v), _updates.assign, args=(stash,), group=False)
        if self._state_set_aside:  # a restored checkpoint set none aside
            for v, stash in zip(self._state, self._state_stash, strict=True):
                update(tf_variable(v), _updates.assign, args=(stash,), group=False)
        return tf.constant(True)

    def _same(self, distribution):
        same = []
        for moved, variables in self._fragments():
            for v in variables:
                v = tf_variable(v)
                stash = tf_variable(self.stash[self._index_of(v)])
                same.append(
                    distribution.extended.call_for_each_replica(
                        _shows, args=(v, self._period.of(v), stash, moved)
                    )
                )
        local = distribution.experimental_local_results
        flat = [s for value in same for s in local(value)]
        return tf.reduce_all(tf.stack([tf.constant(True), *flat]))


def _average_of(variable, start, moved):
    """A replica's copy of a fragment's latest average: the period's start
    if the fragment moved since, else the weights themselves."""
    return variable.assign(tf.where(moved, start.read_value(), variable.read_value()))


def _shows(variable, start, stash, moved):
    """Whether a replica's `variable` holds what `show` set."""
    shown = tf.where(moved, start.read_value(), stash.read_value())
    return tf.reduce_all(tf.equal(variable.read_value(), shown))


def build(add_optimizer_variables, add_variable, var_list, boundary: str, **parts):
    """The boundary part for `boundary` ("full" or "latest"); "latest" makes
    its variables with the optimizer's `add_optimizer_variables` and
    `add_variable`. `parts`: `LatestAverages`'s other arguments."""
    if boundary == "full":
        return FullBoundary()
    stash = add_optimizer_variables(var_list, "boundary_stash")
    shown = add_variable((), dtype="int64", name="boundary_shown")
    return LatestAverages(stash=stash, shown=shown, **parts)
