"""`SkipCorrectionOptimizer`: local steps, periodic averages, drift correction."""

from __future__ import annotations

import warnings

import keras
import tensorflow as tf

from keras_skip import (
    _arguments,
    _averager,
    _boundary,
    _checks,
    _codecs,
    _compat,
    _drift,
    _flight,
    _outer,
    _overlap,
    _replica_state,
    _slots,
    _step,
    _stop_agreement,
    _streaming,
)
from keras_skip.steering import Steering
from keras_skip.steering import write as _set

_compat.check_versions()


@keras.saving.register_keras_serializable(package="keras_skip")
class SkipCorrectionOptimizer(keras.optimizers.Optimizer):
    """Wraps a Keras optimizer so replicas synchronize once every `interval` steps.

    Synchronous data parallelism all-reduces the gradients at every step; on
    a slow link that communication dominates. With this wrapper each replica
    instead takes *local* steps with its own mini-batch gradient, and every
    `interval` steps the replicas average their weights (one all-reduce of the
    model). Each replica also keeps a *correction* `c_i` that cancels its own
    drift away from the average, learnt from the averages it already receives
    (VRL-SGD, Liang et al. 2019; SCAFFOLD, Karimireddy et al. 2020):

        local step:  x_i <- x_i + Step(x_i, g_i) + lr * c_i
        average:     c_i <- c_i + correction * (x_bar - x_i) / Gamma
                     x_i <- x_bar

    where `Step` is the displacement the wrapped optimizer makes and `Gamma`
    the sum of learning rates since the last average. `interval=1` and the
    warm-up steps are ordinary synchronous steps (gradient all-reduce, one
    inner step), for every inner optimizer.

    Averages and the outer step cover the variables the steps update.
    Variables without a gradient (a weight a layer does not use, the layers
    frozen before the model was compiled again) are left out: they never
    move, as with the optimizer alone.

    Under a `tf.distribute` strategy with more than one replica, pass
    `keras_skip.SkipCorrectionCallback()` (or `AdaptiveIntervalCallback`) to
    `fit`: it averages the replicas at each epoch boundary, so validation,
    checkpoints and the model after `fit` see the averaged model. Forgetting
    it raises a clear error at the first training step.

    Args:
        inner_optimizer: The `keras.optimizers.Optimizer` to wrap (SGD, Adam,
            AdamW, Nadam, Muon, ... or your own subclass). A new, unbuilt
            instance, created under the same strategy scope as the model.
            Each step runs the optimizer's own gradient clipping
            (`clipnorm`, `global_clipnorm`, `clipvalue`), weight decay
            (`_apply_weight_decay`) and update (`_backend_update_step`,
            `update_step`), so on one replica, at any interval, it trains
            exactly like the optimizer alone, and at `interval=1` exactly
            like stock synchronous training. Refused with a clear error:
            optimizers that override `apply`, `apply_gradients` or
            `_backend_apply_gradients` (such as `MultiOptimizer`), which
            local steps would bypass; `gradient_accumulation_steps`;
            `use_ema`; and `ScheduleFreeAdamW` unless
            `optimizer_state="average"` (its state holds a weight-like
            sequence). A `keras.optimizers.LossScaleOptimizer`
            is moved outside: `SkipCorrectionOptimizer(LossScaleOptimizer(opt),
            ...)` returns `LossScaleOptimizer(SkipCorrectionOptimizer(opt, ...))`
            with the same loss-scale settings, the order Keras itself uses
            under `mixed_float16`.
        interval: Integer >= 1, default 8. Local steps between two averages.
            Can be changed between steps (`optimizer.interval = 16`) without
            retracing the train function.
        correction: Float in `[0, 1]`, default 1.0. Strength `beta` of the
            drift correction; 0 gives plain local SGD.
        optimizer_state: What an average does to the inner optimizer's slots
            (momentum, Adam moments): `"local"` (default) keeps each replica's
            own and sends nothing extra, `"average"` averages them with the
            weights (more traffic), `"average_second_moments"` averages only
            those that scale the step by the squared gradient (Adam's
            velocities, Adagrad's accumulators, ...; for Adam-family
            optimizers on skewed data) and keeps the others local,
            `"reset"` sets them back to the values
            they started from (zero for momentum and Adam's moments,
            `initial_accumulator_value` for Adagrad's accumulators; state
            that starts from anything else is refused when built).
        warmup_steps: Integer >= 0, default 0. Number of initial steps taken
            synchronously before local steps start.
        outer_optimizer: Optional `keras.optimizers.Optimizer`, default None.
            Applied at every average to the period's averaged update, as in
            SlowMo and DiLoCo: `x_start - x_bar` (the weights when the period
            began minus their average now) is its gradient, and it moves
            `x_start`; for example `keras.optimizers.SGD(0.7, momentum=0.9,
            nesterov=True)`. Its state (momentum) is identical on every
            replica and saved with the rest. Its own clipping, weight decay
            and update hooks apply to the pseudo-gradient, as in its
            `apply`. None: the average is the new weights. A new, unbuilt
            instance, like `inner_optimizer`.
        compression: None (default), "bfloat16" or "float16". Send each
            average's weights as the replica's update since the period
            began, `x_i - x_start`, in that 16-bit type (half the bytes),
            with error feedback: what rounding lost is kept per replica and
            added to the next average's update. BatchNorm statistics and
            averaged slots are sent in float32.
        measure_drift: Bool, default False. Measure the drift
            `mean_i ||x_i - x_bar||` (trainable weights, all replicas) at
            every average, for the training logs and TensorBoard; it costs
            one extra all-reduce of one float per average.
        group_size: None (default), an integer, or `"worker"`. Hierarchical
            averaging: consecutive replicas form groups of this many that
            stay synchronous at every step, averaging their gradients over
            the fast link inside a machine, while the groups take local
            steps and average every `interval` steps over the slow link
            between machines. Each group moves as one replica with its
            members' mini-batches and keeps one correction. `"worker"`: one
            group per worker, made of its local devices (for example the
            GPUs of a machine under `MultiWorkerMirroredStrategy`). An
            integer must divide the number of replicas on each worker, so
            that no group spans two machines. None or 1: every replica takes
            its own local steps.
        overlap: Bool or int, default False. Overlapped averaging: an
            interval average's all-reduce runs while local steps compute,
            instead of between them. `True` (or 1): it runs alongside the
            step it is due after, sending the weights as they were before
            that step (a snapshot); each replica then takes the snapshots'
            average plus its own step, `x_i <- x_bar_snapshot +
            (x_i - x_i_snapshot)`, and updates its correction on the
            snapshot. An integer `k >= 2` (delayed averaging, in
            `model.fit`): the average sends the weights after the step it
            is due after, its all-reduce runs in a background thread while
            the next steps compute (under `MultiWorkerMirroredStrategy` with
            data of known length, and under `MirroredStrategy`; in a
            custom loop right after the execution that took the snapshot,
            hiding nothing), and
            its mean lands between two executions of the train function
            once at least `k` local steps have run since (sooner if the
            next average could fall due first). It needs an `interval` longer than
            `steps_per_execution`; in a custom training loop the averages
            run after their step. Either way the replicas stay apart by the
            steps taken since the snapshot until the next average. Averages
            at epoch boundaries (and wherever the interval is overridden,
            as during the adaptive probe) stay full averages.
        fragments: Integer >= 1, default 1. Streaming averages: the
            trainable variables are split into this many fragments of whole
            variables with near-equal bytes (the same on every worker), and
            fragment `j` is averaged on its own, `(j + 1) * interval //
            fragments` local steps after a full average and every `interval`
            steps after that, so that each average sends about
            `1 / fragments` of the model and the interval's averages are
            spread over it (Streaming DiLoCo). Each fragment keeps its own
            learning rates' sum for its corrections; the model's averaged
            state (BatchNorm) travels with the last fragment. With
            `compression` and `outer_optimizer`, each fragment sends its own
            update and takes its own outer step. Averages at epoch
            boundaries, before a synchronous step and from `average()`
            cover every fragment that moved. `interval` must be 1 or at
            least `fragments`; at most the number of trainable variables
            (checked when built). With `overlap`, each fragment's average
            is overlapped or delayed as described above (one fragment on
            its way at a time).
        boundary: "full" (default) or "latest": what `SkipCorrectionCallback`
            gives an epoch's end. "full": a full average, which blocks while
            the whole model crosses the links. "latest": no communication;
            every replica's own weights are set aside and each fragment's
            latest average is shown (validation, checkpoints and
            `EarlyStopping` see it), then the own weights come back before
            the next step, so the averages' schedule runs across epochs. An
            epoch with fewer than `fragments` averages, or of unknown
            length, still ends with a full average, and so does `fit`.
            Keeps two more copies of the trainable weights per replica.
        name: Optional name of the optimizer.

    Example:

    ```python
    import keras
    import numpy as np
    import keras_skip

    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    model.compile(
        optimizer=keras_skip.SkipCorrectionOptimizer(
            keras.optimizers.SGD(0.05), interval=4
        ),
        loss="mse",
    )
    x = np.random.rand(64, 4).astype("float32")
    model.fit(x, x.sum(axis=1), batch_size=8, epochs=2, verbose=0,
              callbacks=[keras_skip.SkipCorrectionCallback()])
    print(model.optimizer.averages_performed)
    ```
    """

    def __new__(cls, inner_optimizer=None, *args, **kwargs):
        if isinstance(inner_optimizer, keras.optimizers.LossScaleOptimizer):
            return _arguments.loss_scaling_around(cls, inner_optimizer, *args, **kwargs)
        return super().__new__(cls)

    def __init__(
        self,
        inner_optimizer: keras.optimizers.Optimizer,
        interval: int = 8,
        correction: float = 1.0,
        optimizer_state: str = "local",
        warmup_steps: int = 0,
        outer_optimizer: keras.optimizers.Optimizer | None = None,
        compression: str | None = None,
        measure_drift: bool = False,
        group_size: int | str | None = None,
        overlap: bool = False,
        fragments: int = 1,
        boundary: str = "full",
        name: str | None = None,
        **kwargs,
    ):
        _arguments.reject_base_arguments(kwargs)
        _arguments.check_wrapped_optimizer(inner_optimizer, type(self))
        _arguments.check_slot_policy(inner_optimizer, optimizer_state)
        _arguments.check_outer_optimizer(outer_optimizer, inner_optimizer, type(self))
        interval = _checks.integer("interval", interval, minimum=1)
        warmup_steps = _checks.integer("warmup_steps", warmup_steps, minimum=0)
        correction = _arguments.check_correction(correction)
        compression = _arguments.check_compression(compression)
        group_size = _arguments.check_group_size(group_size)
        measure_drift = _checks.boolean("measure_drift", measure_drift)
        overlap_steps = _arguments.check_overlap(overlap)
        fragments = _arguments.check_fragments(fragments, interval)
        boundary = _arguments.check_boundary(boundary)
        super().__init__(learning_rate=0.0, name=name)
        _compat.isolate_collective_keys(_compat.creation_strategy(self))
        _compat.install_model_hook()
        self.inner_optimizer = inner_optimizer
        self.outer_optimizer = outer_optimizer
        # The wrapper steps the inner optimizer's counter and uses its learning
        # rate. Its own copies, created by the base class, stay tracked
        # (TensorFlow checkpoints refuse lists that lost an element) but are
        # left out of `variables`.
        self._unused = (self._iterations, self._learning_rate)
        with _compat.untracked():
            self._iterations = _compat.iterations_variable(inner_optimizer)
        self._correction = correction
        self._optimizer_state = optimizer_state
        self._warmup_steps = warmup_steps
        self._measure_drift = measure_drift
        self._compression = compression
        self._group_size = group_size
        self._group = 1  # replicas per group, resolved when built
        self._overlap = overlap
        self._overlap_steps = overlap_steps
        self._fragments = fragments
        self._boundary_mode = boundary
        # With overlap >= 2 on several replicas, the host side of delayed
        # averages (`_flight.Flight`), made when built.
        object.__setattr__(self, "_flight", None)
        self._initial_interval = interval
        self._model_state: list[tf.Variable] = []
        # Under several workers, the stop vote that every synchronization
        # carries (see `Steering.vote_stop`); empty otherwise. Not a dependency of
        # the optimizer: checkpoints do not hold it.
        object.__setattr__(self, "_votes", ())
        self._attached = False
        # The variables the traced steps update (those with a gradient), by
        # key; replaced by the first step traced after `attach`. Averages and
        # the outer step cover these only: the others never move.
        self._stepped: dict[int, keras.Variable] = {}
        self._stepped_stale = False
        # Bound to the state when built (see `steering`).
        object.__setattr__(self, "_steering", Steering(_compat.creation_strategy(self)))

    # ------------------------------------------------------------------
    # Configuration and inspectable state.
    # ------------------------------------------------------------------

    @property
    def interval(self) -> int:
        """Local steps between two averages; settable between steps."""
        if not self.built:
            return self._initial_interval
        if self._steering.held:
            return self._steering.interval_outside_hold
        return int(self._interval_variable.numpy())

    @interval.setter
    def interval(self, value: int) -> None:
        value = _checks.integer("interval", value, minimum=1)
        _arguments.check_interval_covers(value, self._fragments)
        if self.built and self._steering.held:
            self._steering.interval_outside_hold = value
        elif self.built:
            _set(self._interval_variable, value)
        else:
            self._initial_interval = value

    @property
    def correction(self) -> float:
        """Strength `beta` of the drift correction, in `[0, 1]`."""
        return self._correction

    @property
    def optimizer_state(self) -> str:
        """The slot policy at an average: "local", "average" or "reset"."""
        return self._optimizer_state

    @property
    def warmup_steps(self) -> int:
        """Number of initial synchronous steps."""
        return self._warmup_steps

    #: Replicas step on their own gradients between averages (read by the
    #: loss-scale patch in `_compat`).
    takes_local_steps = True

    @property
    def compression(self) -> str | None:
        """The 16-bit type averages send the weights' updates in, or None."""
        return self._compression

    @property
    def group_size(self) -> int | str | None:
        """Replicas per synchronous group (hierarchical averaging), as given."""
        return self._group_size

    @property
    def overlap(self) -> bool | int:
        """As given: whether, or over how many local steps, an interval
        average's all-reduce runs beside the steps."""
        return self._overlap

    @property
    def fragments(self) -> int:
        """The fragments averaged on their own schedules (1: none)."""
        return self._fragments

    @property
    def boundary(self) -> str:
        """What the replicas show at an epoch's end: "full" (a full average)
        or "latest" (each fragment's latest average, with no communication)."""
        return self._boundary_mode

    @property
    def showing_latest_averages(self) -> bool:
        """Whether the replicas' own weights are set aside and the latest
        averages shown (`show_latest_averages`)."""
        return self.built and self._boundary.shown

    @property
    def measure_drift(self) -> bool:
        """Whether each average measures the replicas' drift."""
        return self._measure_drift

    @property
    def averages_performed(self) -> int:
        """Averages performed so far (interval and boundary averages)."""
        return int(self._averages.numpy()) if self.built else 0

    @property
    def synchronous_steps(self) -> int:
        """Steps taken synchronously (interval 1 or warm-up): each all-reduced
        the gradients."""
        return int(self._synchronous.numpy()) if self.built else 0

    @property
    def bytes_sent(self) -> int:
        """Bytes each replica has put into all-reduces so far: every
        average's payload and every synchronous step's gradients, counted
        dense (a ring all-reduce moves about twice this over the links)."""
        return int(self._bytes.numpy()) if self.built else 0

    @property
    def drift(self) -> tuple[float, float]:
        """``(sum over averages, last)`` of the measured drift
        ``mean_i ||x_i - x_bar||``; zeros unless ``measure_drift=True``."""
        return self._drift.values() if self.built else (0.0, 0.0)

    @property
    def local_steps_since_average(self) -> int:
        """Local steps taken since the last average (0 right after one). With
        `overlap`, the step an overlapped average ran alongside counts: no
        average has included it yet."""
        if not self.built:
            return 0
        return int(self._local_steps.numpy()) + self._schedule.carried_steps()

    @property
    def interval_decision(self):
        """The adaptive interval decision, or None if none was taken.

        An :class:`keras_skip.adaptive.IntervalDecision` (interval, t_comp,
        t_comm) recorded by `AdaptiveIntervalCallback`. It is saved with the
        optimizer, so a resumed run keeps it instead of probing again.
        """
        return self._steering.decision() if self.built else None

    @property
    def steering(self) -> Steering:
        """The interface through which callbacks steer the averages between
        executions of the train function (see `keras_skip.steering.Steering`):
        counters, holding the interval, the adaptive decision, stop votes."""
        return self._steering

    @property
    def learning_rate(self):
        return self.inner_optimizer.learning_rate

    @learning_rate.setter
    def learning_rate(self, learning_rate):
        self.inner_optimizer.learning_rate = learning_rate

    @property
    def variables(self):
        own = [v for v in self._variables if all(v is not u for u in self._unused)]

        outer = self.outer_optimizer.variables if self.outer_optimizer else []
        return own + self.inner_optimizer.variables + outer

    def scale_loss(self, loss):
        return self.inner_optimizer.scale_loss(loss)

    def __dir__(self):
        # Keras' saving walks `dir()` and would also save and reload the
        # inner optimizer on its own, after the wrapper, overwriting the
        # per-replica slots the wrapper restored. The wrapper saves it whole.
        return [
            a
            for a in super().__dir__()
            if a not in ("inner_optimizer", "outer_optimizer")
        ]

    # ------------------------------------------------------------------
    # Building.
    # ------------------------------------------------------------------

    @_compat.untracked_method
    def build(self, var_list):
        strategy = tf.distribute.get_strategy()
        with _compat.created_alike(strategy):  # all start alike: no broadcast
            self._build(var_list, strategy)

    def _build(self, var_list, strategy):
        _arguments.check_building_in(
            self, self.inner_optimizer, self.outer_optimizer, strategy
        )
        self._group = _arguments.replicas_per_group(self._group_size, strategy)
        n = strategy.num_replicas_in_sync
        super().build(var_list)
        _compat.build_tracked(self.inner_optimizer, var_list)
        # Per slot variable (by id), the constant it starts from, for
        # optimizer_state="reset", read before any variable of the wrapper.
        slot_starts = {}
        if self._optimizer_state == "reset" and n > 1:
            slot_starts = _slots.constant_starts(self.inner_optimizer)
        if self.outer_optimizer is not None:
            _compat.build_tracked(self.outer_optimizer, var_list)
        # The parts of the averaging path, chosen here once. Their variables
        # are created in this order whatever the options: a checkpoint's
        # variables are positional.
        index_of = self._get_variable_index
        self._period = _outer.build_period_start(
            self.add_optimizer_variables,
            var_list,
            index_of,
            needed=self.outer_optimizer is not None
            or self._compression is not None
            or self._boundary_mode == "latest",
        )
        codec = _codecs.build(
            self._compression,
            self.add_optimizer_variables,
            var_list,
            index_of,
            self._period,
        )
        object.__setattr__(self, "_codec", codec)
        self._outer = _outer.build_outer_step(self.outer_optimizer, self._period)
        (
            self._interval_variable,
            self._gamma,
            self._local_steps,
            self._averages,
            self._synchronous,
            self._bytes,
        ) = _step.build_counters(
            self.add_variable, self._initial_interval, self.inner_optimizer
        )
        self._drift = _drift.build(self.add_variable, self._measure_drift)
        self._schedule = _overlap.build(
            self.add_variable,
            self._overlap_steps,
            n,
            self._local_steps,
            self._interval_variable,
            iterations=self._iterations,
            gamma=self._gamma,
            codec=codec,
            payload=lambda: self._averager.payload(include_slots=False),
            buffers=_overlap.Buffers(strategy),
        )
        object.__setattr__(self, "_votes", _stop_agreement.votes(strategy))
        self._slots = _slots.build(
            self._optimizer_state, self.inner_optimizer, self.add_variable, slot_starts
        )
        # The adaptive decision: the chosen interval (0 = none yet) and its times.
        self._decided = self.add_variable((), dtype="int64", name="decided_interval")
        self._decision_t_comp = self.add_variable((), dtype="float64", name="t_comp")
        self._decision_t_comm = self.add_variable((), dtype="float64", name="t_comm")
        self._corrections = [None] * len(var_list)
        if self._correction:
            self._corrections = self.add_optimizer_variables(var_list, "correction")
        if self._fragments > 1:
            self._schedule = _streaming.build(
                self.add_variable,
                self._fragments,
                var_list,
                inner=self.inner_optimizer,
                local_steps=self._local_steps,
                interval=self._interval_variable,
                index_of=index_of,
                gamma=self._gamma,
                slots_apart=self._slots.apart,
                slots=self._slots.slots(),
                base=self._schedule,
                payload=lambda j: self._averager.payload(False, j),
                iterations=self._iterations,
                codec=codec,
            )
        self._boundary = _boundary.build(
            self.add_optimizer_variables,
            self.add_variable,
            var_list,
            self._boundary_mode,
            period=self._period,
            schedule=self._schedule,
            stepped=self._stepped_variables,
            index_of=index_of,
        )
        self._boundary.attach(strategy, self._model_state)
        self._bind_steering()
        self._bind_step(corrected=bool(self._correction) and n > 1)
        flight = _flight.build(
            strategy, self._schedule, self._averager, self._overlap_steps, self
        )
        if flight is not None:
            object.__setattr__(self, "_flight", flight)
            self._steering.land = flight.land
        self._link_replica_state()

    def _bind_step(self, corrected: bool) -> None:
        """The average and the step, from the parts and variables built
        (`corrected`: local steps add the corrections)."""
        averager = _averager.Averager(
            correction=self._correction,
            corrections=self._corrections,
            index_of=self._get_variable_index,
            stepped=self._stepped_variables,
            model_state=lambda: self._model_state,
            votes=self._votes,
            period=self._period,
            codec=self._codec,
            outer=self._outer,
            drift=self._drift,
            schedule=self._schedule,
            slots=self._slots,
            boundary=self._boundary,
            gamma=self._gamma,
            bytes_sent=self._bytes,
            local_steps=self._local_steps,
            averages=self._averages,
        )
        step = _step.Step(
            inner=self.inner_optimizer,
            averager=averager,
            warmup_steps=self._warmup_steps,
            votes=self._votes,
            period=self._period,
            schedule=self._schedule,
            slots=self._slots,
            group=self._group,
            corrected=corrected,
            interval=self._interval_variable,
            iterations=self._iterations,
            local_steps=self._local_steps,
            gamma=self._gamma,
            synchronous=self._synchronous,
            bytes_sent=self._bytes,
        )
        object.__setattr__(self, "_averager", averager)
        object.__setattr__(self, "_step", step)

    def _bind_steering(self) -> None:
        self._steering.bind(
            interval=self._interval_variable,
            local_steps=self._local_steps,
            averages=self._averages,
            synchronous=self._synchronous,
            iterations=self._iterations,
            decision=(self._decided, self._decision_t_comp, self._decision_t_comm),
            votes=self._votes,
            carried=self._schedule.carried,
            full_at=self._schedule.full_at,
            hold=self._schedule.hold,
            steps_to_next_average=self._schedule.steps_to_next_average,
            may_hold=self._schedule.may_hold,
        )

    def _link_replica_state(self) -> None:
        owners = [c for c in self._corrections if c is not None]
        owners += [*self._codec.errors, *self._boundary.stash]
        _replica_state.link(
            self._per_replica_state(), owners + self.inner_optimizer.variables
        )

    def attach(self, model: keras.Model) -> None:
        """Binds this optimizer to the model it trains.

        Records the model's non-trainable floating-point state (BatchNorm
        statistics) so that averages include it, and acknowledges that the
        caller takes boundary averages (`SkipCorrectionCallback` does both).
        Call it once before training in a custom training loop, and call
        :meth:`average` before evaluating or saving.
        """
        _arguments.check_model(model)
        self._model_state = [v.value for v in _compat.averaged_model_state(model)]
        if self.built:
            self._boundary.attach(_compat.creation_strategy(self), self._model_state)
        self._attached = True
        # A recompiled model may train other variables (layers frozen or
        # unfrozen): the next traced step says which.
        self._stepped_stale = True
        loss_scale = getattr(model, "optimizer", None)
        if isinstance(loss_scale, keras.optimizers.LossScaleOptimizer):
            _compat.agree_on_finite_gradients(loss_scale)

    # ------------------------------------------------------------------
    # The step.
    # ------------------------------------------------------------------

    def _backend_apply_gradients(self, grads, trainable_variables):
        replica_context = tf.distribute.get_replica_context()
        if replica_context is None:
            raise RuntimeError(
                "SkipCorrectionOptimizer.apply_gradients must be called in a "
                "replica context, that is inside `strategy.run(...)`."
            )
        n = tf.distribute.get_strategy().num_replicas_in_sync
        if n > 1 and not self._attached:
            raise _arguments.not_attached(n)
        variables = list(trainable_variables)
        self._note_stepped(variables)
        inner = self.inner_optimizer
        sync_grads, local_grads = _step.gradients(inner, grads, n)
        replica_context.merge_call(
            lambda distribution, sync_grads, local_grads, lr: self._step(
                distribution, sync_grads, local_grads, variables, lr
            ),
            args=(sync_grads, local_grads, inner.learning_rate),
        )

    def _note_stepped(self, variables) -> None:
        """Records, while a step is traced, the variables it updates."""
        if self._stepped_stale:
            self._stepped = {}
            self._stepped_stale = False
        for v in variables:
            self._stepped.setdefault(self._var_key(v), v)

    def _stepped_variables(self) -> list:
        """The variables the steps update, in the optimizer's order; all of
        them before any step was traced."""
        if not self._stepped:
            return list(self._trainable_variables)
        return sorted(self._stepped.values(), key=self._get_variable_index)

    def average(self) -> bool:
        """Takes a boundary average now, if any local step happened since the last.

        `SkipCorrectionCallback` calls it at every epoch boundary. In a custom
        training loop, call it before evaluating, checkpointing or reading
        the weights. Callable eagerly (returns whether it averaged) and from a
        `tf.function` (returns a boolean tensor); every replica and worker
        must call it at the same point of training.
        """
        if not self.built:
            return False
        if tf.executing_eagerly():
            self.restore_own_weights()
        if tf.distribute.in_cross_replica_context():
            if not tf.executing_eagerly():
                return self._averager.average_if_pending(tf.distribute.get_strategy())
        elif tf.distribute.has_strategy() or not tf.executing_eagerly():
            return tf.distribute.get_replica_context().merge_call(
                self._averager.average_if_pending
            )
        if self._flight is not None:
            self._flight.land()
        if self.local_steps_since_average == 0:
            return False
        with _compat.creation_strategy(self).scope():
            key = tuple(self._var_key(v) for v in self._stepped_variables())
            return bool(self._averager.eager_average(key)().numpy())

    def show_latest_averages(self) -> None:
        """Shows every fragment's latest average, with no communication.

        Sets every replica's own weights aside and replaces them with the
        weights of each fragment's latest average (the same on every
        replica), and the model's BatchNorm statistics with their latest
        average, so that evaluating, saving or reading the model sees an
        averaged model without waiting for a full average. An average on
        its way (``overlap >= 2``) lands first. Call `restore_own_weights`
        before the next step (`SkipCorrectionCallback` does both with
        ``boundary="latest"``). Eager only; needs ``boundary="latest"``.
        """
        _arguments.check_shows_latest(self._boundary_mode)
        if self.built:
            self._boundary.show(_compat.creation_strategy(self), self._flight)

    def restore_own_weights(self) -> bool:
        """Puts back every replica's own weights, which
        `show_latest_averages` set aside. Returns False if the weights shown
        were replaced meanwhile (`EarlyStopping` restoring its best ones):
        those are kept and the replicas' own forgotten; else True."""
        if not self.built:
            return True
        return self._boundary.restore(_compat.creation_strategy(self))

    def finalize_variable_values(self, var_list):
        self.average()
        self.inner_optimizer.finalize_variable_values(var_list)

    # ------------------------------------------------------------------
    # Saving: every replica's own state, so that training resumes exactly.
    # ------------------------------------------------------------------

    def _per_replica_state(self) -> list[tuple[int, object, bool]]:
        """The state that differs between replicas (`_replica_state`):
        corrections, what compression has not sent, the inner optimizer's
        float slots."""
        corrections = [c for c in self._corrections if c is not None]
        # What compression has not sent restarts from zero on another number
        # of replicas too.
        corrections += self._codec.errors
        apart = [*self._slots.slots(), *self._boundary.stash]
        return _replica_state.per_replica(self.variables, corrections, apart)

    def _trackable_children(self, save_type="checkpoint", **kwargs):
        _flight.land_before_checkpoint(self._flight, save_type)
        return super()._trackable_children(save_type, **kwargs)

    def save_own_variables(self, store):
        if not self.built:
            return  # no state yet: a model saved before training
        if self._flight is not None:
            self._flight.land()  # a save holds no average on its way
        _replica_state.save(
            store,
            self.variables,
            self._per_replica_state(),
            self._steering.saved_value,
        )

    def load_own_variables(self, store):
        if not self.built:
            # As Keras does for any optimizer: weights load into a model whose
            # optimizer has not been built (inference) without its state.
            warnings.warn(
                f"Skipping the state of optimizer '{self.name}': it has not "
                "been built yet. Call `optimizer.build(model.trainable_variables)` "
                "before loading to restore it.",
                stacklevel=2,
            )
            return
        if self._flight is not None:
            self._flight.land()  # then overwritten: the saved state wins
        _replica_state.load(store, self.variables, self._per_replica_state(), self.name)

    # ------------------------------------------------------------------
    # Serialization.
    # ------------------------------------------------------------------

    def get_config(self):
        return _arguments.config_of(self)

    @classmethod
    def from_config(cls, config, custom_objects=None):
        return _arguments.from_config(cls, config, custom_objects)


__all__ = ["SkipCorrectionOptimizer"]
