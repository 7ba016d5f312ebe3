"""The adaptive interval: the rule (invariant 10) and AdaptiveIntervalCallback."""

import math
import time

import internals
import keras
import numpy as np
import pytest
import tensorflow as tf
from conftest import components, max_replica_spread, mirrored
from hypothesis import assume, given
from hypothesis import strategies as st

import keras_skip
from keras_skip import _interval_limit, maths

times = st.floats(1e-6, 1e3, allow_nan=False, allow_infinity=False)
ratios = st.floats(0.05, 20)
caps = st.integers(1, 512)


# The rule ------------------------------------------------------------------------


@given(times, times, ratios, caps)
def test_rule_is_an_integer_within_bounds(t_comm, t_comp, rho, cap):
    h = maths.adaptive_interval(t_comm, t_comp, rho, cap)
    assert isinstance(h, int)
    assert 1 <= h <= cap


@given(times, st.floats(0.5, 600), ratios, caps)
def test_rule_is_close_to_the_target_when_not_clipped(t_comp, wanted, rho, cap):
    t_comm = wanted * rho * t_comp
    h = maths.adaptive_interval(t_comm, t_comp, rho, cap)
    ratio = t_comm / (rho * t_comp)
    assume(1 < h < cap)
    assert abs(ratio / h - 1) <= 1 / (2 * h) + 1e-12


@given(times, times, times, ratios, caps)
def test_rule_does_not_decrease_as_communication_grows(t_comm, more, t_comp, rho, cap):
    assert maths.adaptive_interval(t_comm + more, t_comp, rho, cap) >= (
        maths.adaptive_interval(t_comm, t_comp, rho, cap)
    )


@given(times, times, st.floats(0.01, 1.0), ratios, caps)
def test_rule_does_not_decrease_as_computation_shrinks(
    t_comm, t_comp, shrink, rho, cap
):
    assert maths.adaptive_interval(t_comm, t_comp * shrink, rho, cap) >= (
        maths.adaptive_interval(t_comm, t_comp, rho, cap)
    )


@given(times, times, st.integers(-20, 20), ratios, caps)
def test_rule_is_unchanged_when_both_times_scale_by_a_power_of_two(
    t_comm, t_comp, exponent, rho, cap
):
    k = 2.0**exponent
    assert maths.adaptive_interval(t_comm * k, t_comp * k, rho, cap) == (
        maths.adaptive_interval(t_comm, t_comp, rho, cap)
    )


@given(times, times, st.floats(1e-3, 1e3), ratios, caps)
def test_rule_is_unchanged_when_both_times_scale_away_from_a_tie(
    t_comm, t_comp, k, rho, cap
):
    ratio = t_comm / (rho * t_comp)
    assume(abs(ratio - math.floor(ratio) - 0.5) > 1e-6)
    assert maths.adaptive_interval(t_comm * k, t_comp * k, rho, cap) == (
        maths.adaptive_interval(t_comm, t_comp, rho, cap)
    )


@given(st.lists(st.tuples(times, times), min_size=1, max_size=8), ratios, caps)
def test_every_worker_computes_the_same_interval_from_the_maxima(measured, rho, cap):
    t_comp = max(c for c, _ in measured)
    t_comm = max(m for _, m in measured)
    decisions = {
        maths.adaptive_interval(
            max(m for _, m in measured), max(c for c, _ in measured), rho, cap
        )
        for _ in measured
    }
    assert decisions == {maths.adaptive_interval(t_comm, t_comp, rho, cap)}


def test_decide_removes_the_wait_for_the_slowest_worker():
    from keras_skip.adaptive import decide

    # Round 2 (no average): worker 1 computes 0.3 s longer. Round 3 (10 steps
    # and an average of 0.2 s) ends together, at 1.3 + 1.5 = 2.8 s: worker 0,
    # which started it at 1.0 s, waited for worker 1 inside the average.
    measured = [[1.0, 1.8], [1.3, 1.5], [1.3, 1.5]]
    decision = decide(measured, steps=10, target_ratio=1.0, max_interval=64)
    assert decision.t_comp == pytest.approx(0.13)
    assert decision.t_comm == pytest.approx(0.2)
    assert decision.interval == 2


@given(
    st.lists(st.tuples(st.floats(0.01, 10), st.floats(0, 20)), min_size=1, max_size=8),
    st.integers(1, 16),
    st.randoms(use_true_random=False),
)
def test_decide_is_the_same_for_any_order_of_workers(measured, steps, rnd):
    from keras_skip.adaptive import decide

    shuffled = list(measured)
    rnd.shuffle(shuffled)
    assert decide(measured, steps, 1.0, 64) == decide(shuffled, steps, 1.0, 64)
    decision = decide(measured, steps, 1.0, 64)
    longest = max(w for w, _ in measured)
    assert decision.t_comp == longest / steps
    # Never negative, and never more than the longest round with an average
    # takes beyond the longest without (up to the rounding of the sums).
    slack = 4 * np.spacing(max(w + a for w, a in measured))
    assert 0 <= decision.t_comm <= max(max(a for _, a in measured) - longest, 0) + slack


@given(st.floats(0.01, 10), st.floats(0, 20), st.integers(1, 16))
def test_decide_on_one_worker_is_the_difference_of_the_rounds(without, with_, steps):
    from keras_skip.adaptive import decide

    decision = decide([[without, with_]], steps, 1.0, 64)
    assert decision.t_comp == without / steps
    assert decision.t_comm == pytest.approx(max(with_ - without, 0.0), abs=1e-12)


# With overlap: only the wire time the steps beside an average do not hide.

overlaps = st.integers(0, 12)
fragment_counts = st.integers(1, 4)
executions = st.integers(1, 8)
shares = st.floats(0.0, 1.0)


def overlapped(t_comm, t_comp, rho, cap, overlap, fragments, spe, share):
    return maths.adaptive_interval(
        t_comm,
        t_comp,
        rho,
        cap,
        overlap=overlap,
        fragments=fragments,
        steps_per_execution=spe,
        overlap_share=share,
    )


@given(times, times, ratios, caps, overlaps, fragment_counts, executions)
def test_overlap_hiding_nothing_keeps_the_rule(t_comm, t_comp, rho, cap, k, f, spe):
    blocking = maths.adaptive_interval(t_comm, t_comp, rho, cap)
    assert overlapped(t_comm, t_comp, rho, cap, k, f, spe, 0.0) == blocking
    assert overlapped(t_comm, t_comp, rho, cap, 0, f, spe, 1.0) == blocking


@given(times, times, ratios, caps, overlaps, fragment_counts, executions, shares)
def test_overlap_never_lengthens_the_interval_and_covers_its_own_exposed_time(
    t_comm, t_comp, rho, cap, k, f, spe, share
):
    from fractions import Fraction

    h = overlapped(t_comm, t_comp, rho, cap, k, f, spe, share)
    assert 1 <= h <= maths.adaptive_interval(t_comm, t_comp, rho, cap)

    def rule(interval):
        # The blocking rule of the time the steps do not hide at `interval`.
        window = maths.overlap_window(k, interval, f, spe)
        hidden = maths.hidden_communication(
            Fraction(t_comm), Fraction(t_comp), window, f, Fraction(share)
        )
        exposed = (Fraction(t_comm) - hidden) / (Fraction(rho) * Fraction(t_comp))
        return min(max(math.floor(exposed + Fraction(1, 2)), 1), cap)

    # The smallest interval whose exposed communication it covers.
    assert h >= rule(h) or h == cap
    assert h == 1 or h - 1 < rule(h - 1)


@given(times, times, times, ratios, caps, overlaps, fragment_counts, shares)
def test_overlap_rule_does_not_decrease_as_communication_grows(
    t_comm, more, t_comp, rho, cap, k, f, share
):
    assert overlapped(t_comm + more, t_comp, rho, cap, k, f, 1, share) >= (
        overlapped(t_comm, t_comp, rho, cap, k, f, 1, share)
    )


@given(times, times, st.integers(-20, 20), ratios, caps, overlaps, fragment_counts)
def test_overlap_rule_is_unchanged_when_both_times_scale_by_a_power_of_two(
    t_comm, t_comp, exponent, rho, cap, k, f
):
    scale = 2.0**exponent
    assert overlapped(t_comm * scale, t_comp * scale, rho, cap, k, f, 1, 0.5) == (
        overlapped(t_comm, t_comp, rho, cap, k, f, 1, 0.5)
    )


def test_overlap_hides_up_to_its_window_of_each_fragments_average():
    # 0.9 s of wire time, 29 ms steps: 31 without overlap. Two fragments of
    # 0.45 s, each beside 6 steps (0.174 s), half of that hidden: 0.174 s of
    # an interval's 0.9 s.
    assert maths.adaptive_interval(0.9, 0.029) == 31
    assert maths.overlap_window(6, 25, 2) == 6
    assert maths.hidden_communication(0.9, 0.029, 6, 2, 0.5) == pytest.approx(0.174)
    assert overlapped(0.9, 0.029, 1.0, 64, 6, 2, 1, 0.5) == 25  # round(0.726/0.029)
    # All of a short average hidden from interval 2 on (at interval 1 the
    # steps are synchronous and nothing overlaps): interval 2.
    assert maths.adaptive_interval(0.1, 0.029) == 3
    assert overlapped(0.1, 0.029, 1.0, 64, 4, 1, 1, 1.0) == 2
    # A window cut by the next fragment's average: at interval 4 with 4
    # fragments each runs beside one step, not the six asked for.
    assert maths.overlap_window(6, 4, 4) == 1
    # A delayed average at an interval no longer than an execution hides
    # nothing: the rule stays where that is so.
    assert maths.overlap_window(4, 8, 1, steps_per_execution=8) == 0
    assert (
        overlapped(0.2, 0.029, 1.0, 64, 4, 1, 8, 1.0)
        == 7
        == (maths.adaptive_interval(0.2, 0.029))
    )


def test_decide_counts_what_overlap_hides():
    from keras_skip.adaptive import decide

    measured = [[0.29, 0.29 + 0.9]]  # ten steps of 29 ms, then an average of 0.9 s
    assert decide(measured, 10, 1.0, 64).interval == 31
    decision = decide(measured, 10, 1.0, 64, overlap=6, fragments=2, overlap_share=0.5)
    assert decision.interval == 25
    # The decision keeps the whole wire time: the rule takes the hidden part.
    assert decision.t_comm == pytest.approx(0.9)


@pytest.mark.parametrize(
    "kwargs, pattern",
    [
        ({"t_comm": 1.0, "t_comp": 1.0, "overlap": -1}, "`overlap` must be an"),
        ({"t_comm": 1.0, "t_comp": 1.0, "fragments": 0}, "`fragments` must be an"),
        ({"t_comm": 1.0, "t_comp": 1.0, "overlap_share": 1.5}, r"overlap_share=1\.5"),
        ({"t_comm": 1.0, "t_comp": 1.0, "overlap_share": "half"}, "'half'"),
        (
            {"t_comm": 1.0, "t_comp": 1.0, "steps_per_execution": 0},
            "steps_per_execution",
        ),
    ],
)
def test_overlap_rule_rejects_bad_input(kwargs, pattern):
    with pytest.raises(ValueError, match=pattern):
        maths.adaptive_interval(**kwargs)


@pytest.mark.parametrize("share", [-0.1, 1.01, float("nan")])
def test_callback_and_choose_interval_reject_a_share_outside_0_1(share):
    allowed = r"`overlap_share` must be a share in \[0, 1\]"
    with pytest.raises(ValueError, match=allowed):
        keras_skip.AdaptiveIntervalCallback(overlap_share=share)
    optimizer = keras_skip.SkipCorrectionOptimizer(keras.optimizers.SGD(0.1))
    with pytest.raises(ValueError, match=r"overlap_share=1.01|overlap_share=-0.1|nan"):
        keras_skip.choose_interval(optimizer, lambda: None, overlap_share=share)
    with pytest.raises(TypeError, match="`overlap_share` must be a number"):
        keras_skip.AdaptiveIntervalCallback(overlap_share="half")


@pytest.mark.parametrize(
    "kwargs, pattern",
    [
        ({"t_comm": -1.0, "t_comp": 1.0}, "t_comm"),
        ({"t_comm": 1.0, "t_comp": 0.0}, "t_comp"),
        ({"t_comm": float("nan"), "t_comp": 1.0}, "t_comm"),
        ({"t_comm": 1.0, "t_comp": 1.0, "target_ratio": 0.0}, "target_ratio"),
        ({"t_comm": 1.0, "t_comp": 1.0, "max_interval": 0}, "max_interval"),
    ],
)
def test_rule_rejects_bad_input(kwargs, pattern):
    with pytest.raises(ValueError, match=pattern):
        maths.adaptive_interval(**kwargs)


# The callback ----------------------------------------------------------------------

D = 8


class Sleep(keras.layers.Layer):
    """Sleeps `seconds` in the forward pass of one replica (or all)."""

    def __init__(self, seconds, replica=None, **kwargs):
        super().__init__(**kwargs)
        self.seconds, self.replica = seconds, replica

    def compute_output_shape(self, input_shape):
        return input_shape

    def call(self, x):
        context = tf.distribute.get_replica_context()
        if context is None:  # Keras' symbolic build, in cross-replica context
            return x
        replica_id = context.replica_id_in_sync_group

        def sleep(rid):
            if self.replica is None or int(rid) == self.replica:
                time.sleep(self.seconds)
            return np.float32(0)

        delay = tf.numpy_function(sleep, [replica_id], tf.float32)
        delay.set_shape(())
        return x + tf.stop_gradient(delay)


class SlowAverage(keras_skip.SkipCorrectionOptimizer):
    """An injected delay in the communication path: every average sleeps."""

    delay = 0.3

    def build(self, var_list):
        super().build(var_list)
        internals.delay_averages(self, self.delay)


class Recorder(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.intervals = []

    def on_train_batch_end(self, batch, logs=None):
        optimizer = self.model.optimizer
        self.intervals.append(
            [int(c) for c in components(internals.interval_variable(optimizer))]
        )


def data(n=512, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, D)).astype("float32")
    return x, x @ rng.normal(size=(D, 1)).astype("float32")


def new_model(
    strategy,
    extra_layers=(),
    optimizer_class=keras_skip.SkipCorrectionOptimizer,
    steps_per_execution=1,
    **skip,
):
    keras.utils.set_random_seed(0)
    with strategy.scope():
        model = keras.Sequential(
            [keras.Input((D,)), *extra_layers, keras.layers.Dense(1)]
        )
        model.compile(
            optimizer=optimizer_class(keras.optimizers.SGD(0.01), **skip),
            loss="mse",
            steps_per_execution=steps_per_execution,
        )
    return model


def fit(model, callbacks, epochs=1, batch_size=64, **kwargs):
    x, y = data()
    return model.fit(
        x,
        y,
        batch_size=batch_size,
        epochs=epochs,
        verbose=0,
        shuffle=False,
        callbacks=callbacks,
        **kwargs,
    )


def test_costly_average_chooses_an_interval_consistent_with_the_times():
    model = new_model(mirrored(4), optimizer_class=SlowAverage)
    adaptive = keras_skip.AdaptiveIntervalCallback(verbose=0)
    recorder = Recorder()
    history = fit(model, [adaptive, recorder], epochs=2)
    decision = adaptive.decision
    # The difference of two rounds' times: the delay, give or take the noise
    # of timing the same local steps twice.
    assert decision.t_comm >= 0.9 * SlowAverage.delay
    assert decision.interval > 1
    assert decision.interval == maths.adaptive_interval(
        decision.t_comm, decision.t_comp
    )
    assert model.optimizer.interval_decision == decision
    # Interval 1 while tracing, then three probe rounds of two steps, then the
    # decision for good.
    assert recorder.intervals[0] == [1] * 4
    for step in range(6, len(recorder.intervals)):
        assert recorder.intervals[step] == [decision.interval] * 4, step
    assert history.history["interval"] == [decision.interval] * 2
    assert history.history["t_comm"] == [decision.t_comm] * 2
    assert history.history["t_comp"] == [decision.t_comp] * 2
    # One worker: its replicas' times are in one process, nothing is sent.
    assert adaptive.probes == 1
    assert adaptive.collectives == 0 and adaptive.bytes_sent == 0
    assert adaptive.overhead_seconds > 0


def test_overlap_shortens_the_interval_by_what_its_steps_hide(capsys):
    """Averages of 0.3 s, steps of 30 ms, two fragments each overlapped with
    the step after it (`overlap=True`), all of whose time it hides: each
    interval hides two steps' time, so the rule chooses about two steps
    less than without overlap, and says so."""
    model = new_model(
        mirrored(2),
        extra_layers=[keras.layers.Dense(3), Sleep(0.03)],
        optimizer_class=SlowAverage,
        fragments=2,
        overlap=True,
    )
    adaptive = keras_skip.AdaptiveIntervalCallback(overlap_share=1.0)
    fit(model, [adaptive], batch_size=16)
    decision = adaptive.decision
    blocking = maths.adaptive_interval(decision.t_comm, decision.t_comp)
    assert decision.interval == maths.adaptive_interval(
        decision.t_comm,
        decision.t_comp,
        overlap=1,
        fragments=2,
        overlap_share=1.0,
    )
    assert 2 <= decision.interval < blocking
    hidden = maths.hidden_communication(decision.t_comm, decision.t_comp, 1, 2, 1.0)
    assert f"{hidden * 1e3:.2f} ms of it hidden by overlap" in capsys.readouterr().out
    assert model.optimizer.interval == decision.interval


def test_a_delayed_average_on_data_of_unknown_length_on_one_worker_hides_steps():
    """Delayed averages (`overlap=3`) on data of unknown length still run
    beside the steps on one worker (only workers must agree at every step
    on whether data remains): the rule counts three steps hidden, and the
    decision is about three steps shorter than without overlap."""
    model = new_model(
        mirrored(2),
        extra_layers=[Sleep(0.03)],
        optimizer_class=SlowAverage,
        overlap=3,
    )
    x, y = data()
    unknown = tf.data.Dataset.from_tensor_slices((x, y)).filter(lambda *_: True)
    assert unknown.cardinality() == tf.data.UNKNOWN_CARDINALITY
    adaptive = keras_skip.AdaptiveIntervalCallback(overlap_share=1.0, verbose=0)
    model.fit(
        unknown.batch(16), epochs=1, verbose=0, shuffle=False, callbacks=[adaptive]
    )
    assert model.optimizer.steering.delays_beside_steps()
    decision = adaptive.decision
    assert decision.interval == maths.adaptive_interval(
        decision.t_comm, decision.t_comp, overlap=3, overlap_share=1.0
    )
    assert decision.interval < maths.adaptive_interval(decision.t_comm, decision.t_comp)


def test_cap_and_target_ratio():
    model = new_model(mirrored(2), optimizer_class=SlowAverage)
    adaptive = keras_skip.AdaptiveIntervalCallback(
        target_ratio=0.01, max_interval=3, verbose=0
    )
    fit(model, [adaptive])
    assert adaptive.decision.interval == 3


@pytest.mark.parametrize("max_interval", [128, 1000])
def test_an_interval_beyond_the_maps_longest_kept_one_warns(max_interval, recwarn):
    model = new_model(mirrored(2), optimizer_class=SlowAverage)
    adaptive = keras_skip.AdaptiveIntervalCallback(
        target_ratio=1e-6, max_interval=max_interval, verbose=0
    )
    fit(model, [adaptive])
    assert adaptive.decision.interval == max_interval
    warned = [w for w in recwarn if "efficiency map" in str(w.message)]
    if max_interval <= _interval_limit.LONGEST_KEPT:
        assert warned == []
    else:
        assert len(warned) == 1
        message = str(warned[0].message)
        assert message.startswith(
            "AdaptiveIntervalCallback chose interval 1000 (max_interval=1000)"
        )
        assert "pass max_interval=128" in message
        assert warned[0].filename == __file__  # it points at the fit call


def test_the_warning_names_who_chose_and_stays_silent_up_to_the_limit(recwarn):
    kept = _interval_limit.LONGEST_KEPT
    _interval_limit.warn_if_longer(kept, 1000, "choose_interval()")
    assert not recwarn
    with pytest.warns(UserWarning, match=r"^choose_interval\(\) chose interval 129 "):
        _interval_limit.warn_if_longer(kept + 1, 1000, "choose_interval()")


def test_cheap_communication_keeps_interval_1():
    model = new_model(mirrored(4), extra_layers=[Sleep(0.2)])
    adaptive = keras_skip.AdaptiveIntervalCallback(verbose=0)
    fit(model, [adaptive], batch_size=128, epochs=2)
    assert adaptive.decision.t_comp >= 0.2
    assert adaptive.decision.t_comm < adaptive.decision.t_comp / 2
    assert adaptive.decision.interval == 1
    assert model.optimizer.interval == 1


def test_a_slower_replica_sets_t_comp_and_all_replicas_agree():
    model = new_model(
        mirrored(4), extra_layers=[Sleep(0.15, replica=2)], optimizer_class=SlowAverage
    )
    adaptive = keras_skip.AdaptiveIntervalCallback(verbose=0)
    recorder = Recorder()
    fit(model, [adaptive, recorder], batch_size=128, epochs=2)
    assert adaptive.decision.t_comp >= 0.15
    assert all(len(set(step)) == 1 for step in recorder.intervals)
    assert recorder.intervals[-1][0] == adaptive.decision.interval


def test_probe_waits_for_the_warmup_and_works_with_steps_per_execution():
    model = new_model(mirrored(2), optimizer_class=SlowAverage, warmup_steps=5)
    with model.distribute_strategy.scope():
        model.compile(
            optimizer=SlowAverage(keras.optimizers.SGD(0.01), warmup_steps=5),
            loss="mse",
            steps_per_execution=2,
        )
    adaptive = keras_skip.AdaptiveIntervalCallback(verbose=0)
    recorder = Recorder()
    fit(model, [adaptive, recorder], epochs=2)
    # Executions of 2 steps: steps 0-5 synchronous (tracing, warm-up), the
    # probe rounds are executions 3, 4 and 5 (steps 6-11; the epoch boundary
    # after execution 3 does not disturb them), then the decision.
    assert [i[0] for i in recorder.intervals[:3]] == [1, 1, 1]
    assert [i[0] for i in recorder.intervals[5:]] == [adaptive.decision.interval] * 3
    assert model.optimizer.iterations.numpy() == 16
    assert adaptive.decision.interval > 1


class IntervalAtEpochEnd(keras.callbacks.Callback):
    """What a checkpoint would save at each epoch end: the optimizer's
    interval, and the value `save_own_variables` stores for it."""

    def __init__(self):
        super().__init__()
        self.reported, self.saved = [], []

    def on_epoch_end(self, epoch, logs=None):
        optimizer = self.model.optimizer
        store = {}
        optimizer.save_own_variables(store)
        index = next(
            i
            for i, v in enumerate(optimizer.variables)
            if v is internals.interval_variable(optimizer)
        )
        self.reported.append(optimizer.interval)
        self.saved.append(int(store[str(index)]))


def test_epoch_boundaries_inside_a_round_restart_it_and_the_probe_still_decides():
    # 3 steps per epoch and rounds of 2: round 3 is cut by the second epoch's
    # end and run again in the third.
    model = new_model(mirrored(2), optimizer_class=SlowAverage)
    adaptive = keras_skip.AdaptiveIntervalCallback(verbose=0)
    seen = IntervalAtEpochEnd()
    history = fit(model, [adaptive, seen], epochs=4, batch_size=172)
    assert history.params["steps"] == 3
    decision = adaptive.decision
    assert decision is not None and adaptive.restarts == 1
    assert decision.t_comm >= 0.9 * SlowAverage.delay
    assert history.history["interval"] == [1, 1, decision.interval, decision.interval]
    # Checkpoints at epoch ends never see the probe's schedule.
    assert seen.reported == seen.saved == history.history["interval"]


def test_epochs_too_short_for_a_round_make_the_callback_give_up_with_a_warning():
    # One step per epoch: every round of two steps is cut by an epoch boundary.
    model = new_model(mirrored(2))
    adaptive = keras_skip.AdaptiveIntervalCallback(verbose=0)
    recorder = Recorder()
    with pytest.warns(UserWarning, match="could not time three undisturbed rounds"):
        history = fit(model, [adaptive, recorder], epochs=12, batch_size=512)
    assert adaptive.decision is None and model.optimizer.interval_decision is None
    assert adaptive.restarts == adaptive.MAX_RESTARTS + 1
    assert history.history["interval"] == [1] * 12
    # Once given up, the steps are synchronous again, on every replica.
    assert recorder.intervals[-2:] == [[1, 1], [1, 1]]
    assert "t_comp" not in history.history


def test_a_save_during_a_probe_round_stores_the_interval_outside_it(tmp_path):
    from keras_skip.adaptive import IntervalProbe

    model = new_model(mirrored(2), interval=3)
    fit(model, [keras_skip.SkipCorrectionCallback()])
    optimizer = model.optimizer
    probe = IntervalProbe(optimizer, steps=2)
    probe.start()
    # The train function would now run the round's schedule.
    assert [int(c) for c in components(internals.interval_variable(optimizer))] == [
        2,
        2,
    ]
    assert optimizer.interval == 3
    model.save_weights(tmp_path / "during.weights.h5")
    probe.cancel()
    assert [int(c) for c in components(internals.interval_variable(optimizer))] == [
        3,
        3,
    ]
    assert not probe.probing and optimizer.interval == 3
    restored = new_model(mirrored(2))
    with restored.distribute_strategy.scope():
        restored.optimizer.build(restored.trainable_variables)
    restored.load_weights(tmp_path / "during.weights.h5")
    assert restored.optimizer.interval == 3


def test_resumed_run_keeps_the_decision_without_probing(tmp_path):
    model = new_model(mirrored(4), optimizer_class=SlowAverage)
    first = keras_skip.AdaptiveIntervalCallback(verbose=0)
    fit(model, [first])
    path = tmp_path / "adaptive.keras"
    model.save(path)
    with mirrored(4).scope():
        resumed = keras.models.load_model(
            path, custom_objects={"SlowAverage": SlowAverage}
        )
    assert resumed.optimizer.interval_decision == first.decision
    second = keras_skip.AdaptiveIntervalCallback(verbose=0)
    recorder = Recorder()
    fit(resumed, [second, recorder])
    assert second.probes == 0 and second.collectives == 0
    assert second.decision == first.decision
    assert {i for step in recorder.intervals for i in step} == {first.decision.interval}


def test_backup_and_restore_keeps_the_decision(tmp_path):
    class Interrupt(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            if epoch == 1:
                raise RuntimeError("interrupted")

    backup = keras.callbacks.BackupAndRestore(str(tmp_path / "backup"))
    first = keras_skip.AdaptiveIntervalCallback(verbose=0)
    model = new_model(mirrored(2), optimizer_class=SlowAverage)
    with pytest.raises(RuntimeError, match="interrupted"):
        fit(model, [first, backup, Interrupt()], epochs=2)
    restarted = new_model(mirrored(2), optimizer_class=SlowAverage)
    second = keras_skip.AdaptiveIntervalCallback(verbose=0)
    recorder = Recorder()
    # The adaptive callback comes first: the restore happens after its
    # on_train_begin, and it must still notice the restored decision.
    fit(restarted, [second, backup, recorder], epochs=2)
    assert second.probes == 0
    assert second.decision == first.decision
    assert {i for step in recorder.intervals for i in step} == {first.decision.interval}


def test_decision_is_printed_when_verbose(capsys):
    model = new_model(mirrored(2), optimizer_class=SlowAverage)
    fit(model, [keras_skip.AdaptiveIntervalCallback()])
    out = capsys.readouterr().out
    assert "AdaptiveIntervalCallback: t_comp" in out and "-> interval" in out


@pytest.mark.parametrize(
    "kwargs, error, pattern",
    [
        (
            {"target_ratio": 0},
            ValueError,
            r"`target_ratio` must be a number > 0\. Received: target_ratio=0",
        ),
        ({"target_ratio": -1.5}, ValueError, r"target_ratio=-1\.5"),
        ({"target_ratio": "1"}, TypeError, r"target_ratio='1'"),
        (
            {"max_interval": 0},
            ValueError,
            r"`max_interval` must be an integer >= 1\. Received: max_interval=0",
        ),
        ({"max_interval": 2.5}, TypeError, r"max_interval=2\.5"),
    ],
)
def test_callback_rejects_bad_arguments(kwargs, error, pattern):
    with pytest.raises(error, match=pattern):
        keras_skip.AdaptiveIntervalCallback(**kwargs)


def test_callback_needs_a_skip_correction_optimizer():
    model = keras.Sequential([keras.Input((D,)), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
    with pytest.raises(ValueError, match="SkipCorrectionOptimizer"):
        fit(model, [keras_skip.AdaptiveIntervalCallback()])


def test_a_decision_below_the_fragments_is_raised_to_them():
    """With fragments=4 every fragment must be averaged once per interval:
    a costly average that the cap holds at interval 3 becomes 4, and the
    training goes on with it."""
    model = new_model(
        mirrored(4),
        extra_layers=[keras.layers.Dense(3)],
        optimizer_class=SlowAverage,
        interval=8,
        fragments=4,
    )
    adaptive = keras_skip.AdaptiveIntervalCallback(max_interval=3, verbose=0)
    history = fit(model, [adaptive], epochs=2)
    assert (
        maths.adaptive_interval(
            adaptive.decision.t_comm, adaptive.decision.t_comp, max_interval=3
        )
        == 3
    )
    assert adaptive.decision.interval == 4
    assert model.optimizer.interval == 4
    assert history.history["interval"] == [4, 4]
    assert model.optimizer.averages_performed > 2


@pytest.mark.parametrize("fragments", [1, 2])
def test_a_probe_over_executions_of_several_steps_keeps_the_delayed_averages(
    fragments,
):
    """With 2 steps per execution the probe's first round holds the interval
    at 2, which no average can be delayed over: the local train function is
    traced then. It must still copy and delay the averages once the decided
    interval allows it."""
    model = new_model(
        mirrored(2),
        extra_layers=[keras.layers.Dense(3)],
        optimizer_class=SlowAverage,
        steps_per_execution=2,
        overlap=3,
        fragments=fragments,
    )
    adaptive = keras_skip.AdaptiveIntervalCallback(max_interval=6, verbose=0)
    fit(model, [adaptive], epochs=2, batch_size=16)
    assert adaptive.decision.interval == 6
    expected = {None} if fragments == 1 else set(range(fragments))
    assert internals.delayed_parts(model.optimizer) == expected
    assert not internals.flight(model.optimizer).in_flight
    assert max_replica_spread(model.trainable_variables) == 0.0
