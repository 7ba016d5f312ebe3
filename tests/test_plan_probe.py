"""plan_probe.measure: the planner's inputs measured on real worker processes."""

import json
import math
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf
from conftest import mirrored
from workers import probe_worker

from keras_skip import plan_probe, planner
from keras_skip.bench.workers import launcher


def test_plan_probe_on_two_workers_measures_one_link_that_reproduces_the_timings(
    tmp_path,
):
    """`keras-skip plan --probe` on two real worker processes: both report
    the same measurements (the slower worker's), the link fitted to them
    reproduces both timed all-reduces, and the plan is made from them."""
    model = keras.Sequential(
        [keras.Input((32,)), keras.layers.Dense(64), keras.layers.Dense(4)]
    )
    model.save(tmp_path / "model.keras")
    config = {"model": str(tmp_path / "model.keras"), "out": str(tmp_path)}
    result = launcher.launch(
        [sys.executable, probe_worker.__file__, json.dumps(config)],
        2,
        timeout=120,
        log_dir=tmp_path / "logs",
    )
    assert result.ok, result.failure_report()
    reports = [json.loads((tmp_path / f"worker-{i}.json").read_text()) for i in (0, 1)]
    assert reports[0] == reports[1]
    report, probe = reports[0], reports[0]["probe"]
    assert report["workers"] == probe["workers"] == 2
    assert report["link"] == probe["link"]
    assert report["workload"]["params"] == model.count_params() == 32 * 64 + 64 + 260
    assert report["workload"]["step_time"] == probe["step_time"] > 0
    assert 0 < probe["small_seconds"] < probe["large_seconds"]
    link = planner.Link(**probe["link"])
    assert math.isfinite(link.bandwidth) and link.bandwidth > 0
    assert (link.latency, link.efficiency, link.round_trips) == (0.0, 1.0, 0.0)
    # The fit is exact at its two points.
    large = link.all_reduce_seconds(probe["large_bytes"], 2)
    assert large == pytest.approx(probe["large_seconds"], rel=1e-6)
    small = link.all_reduce_seconds(plan_probe.SMALL_BYTES, 2)
    assert small == pytest.approx(probe["small_seconds"], rel=1e-6)
    expected = link.all_reduce_seconds(4 * report["workload"]["params"], 2)
    assert report["synchronous"]["all_reduce_seconds"] == pytest.approx(expected)


@pytest.mark.parametrize(
    "strategy",
    [tf.distribute.get_strategy, lambda: mirrored(2)],
    ids=["default", "mirrored"],
)
def test_a_single_process_cannot_measure_the_link(strategy):
    with pytest.raises(ValueError, match="at least 2 workers"):
        plan_probe.measure(strategy())


@pytest.mark.parametrize(
    "argument, value",
    [
        ("batch_size", 0),
        ("batch_size", 2.0),
        ("large_bytes", 1023),
        ("large_bytes", True),
        ("repeats", 0),
        ("repeats", "5"),
    ],
)
def test_bad_arguments_are_named_with_what_is_allowed(argument, value):
    with pytest.raises(
        ValueError,
        match=rf"`{argument}` must be an integer >= \d+\. "
        rf"Received: {argument}={value!r}",
    ):
        plan_probe.measure(tf.distribute.get_strategy(), **{argument: value})


def test_the_fit_is_exact_at_both_points_and_noise_is_refused():
    for workers in (2, 3, 8):
        link = plan_probe.fit_link(0.002, 0.05, 2**20, workers)
        assert link.all_reduce_seconds(2**20, workers) == pytest.approx(0.05, rel=1e-9)
        assert link.all_reduce_seconds(4, workers) == pytest.approx(0.002, rel=1e-9)
    with pytest.raises(RuntimeError, match=r"dominated by noise.*larger `large_bytes`"):
        plan_probe.fit_link(0.01, 0.01, 2**20, 2)


def test_an_uncompiled_model_is_refused_before_any_collective():
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    with pytest.raises(ValueError, match="compiled with a loss"):
        plan_probe.measure(tf.distribute.get_strategy(), model)


@pytest.mark.parametrize(
    "loss, outputs",
    [("mse", 3), (keras.losses.SparseCategoricalCrossentropy(from_logits=True), 5)],
    ids=["targets-like-outputs", "class-labels"],
)
def test_the_step_is_timed_on_every_replica_and_leaves_the_weights(loss, outputs):
    strategy = mirrored(2)
    with strategy.scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(outputs)])
        model.compile(optimizer="sgd", loss=loss)
    before = model.get_weights()
    seconds = plan_probe._time_step(strategy, model, batch_size=8, repeats=2)
    assert 0 < seconds < 10
    for got, want in zip(model.get_weights(), before, strict=True):
        np.testing.assert_array_equal(got, want)
