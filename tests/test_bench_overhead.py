"""The baselines of the adaptive interval and the overhead benchmark."""

import json

import keras
import numpy as np
import pytest
from conftest import mirrored
from test_package import run_python

import keras_skip
from keras_skip.bench import overhead
from keras_skip.bench.workers import baselines

D = 8


def data(n=512):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(n, D)).astype("float32")
    return x, (x[:, 0] > 0).astype("int32")


def make_model(interval, replicas=2):
    keras.utils.set_random_seed(0)
    strategy = mirrored(replicas)
    with strategy.scope():
        model = keras.Sequential([keras.Input((D,)), keras.layers.Dense(2)])
        model.compile(
            optimizer=keras_skip.SkipCorrectionOptimizer(
                keras.optimizers.SGD(0.1), interval=interval
            ),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
    return model


def test_adacomm_all_reduces_the_loss_and_recomputes_the_interval_at_every_average():
    x, y = data()
    model = make_model(4)
    adacomm = baselines.AdaCommCallback(initial_interval=4, max_interval=16)
    model.fit(
        x, y, batch_size=32, epochs=2, verbose=0, shuffle=False, callbacks=[adacomm]
    )
    averages = model.optimizer.averages_performed
    # One loss all-reduce per interval average; at most one boundary average
    # per epoch does not count.
    assert averages - 2 <= adacomm.collectives <= averages
    assert adacomm.collectives >= 4
    assert len(adacomm.intervals) == adacomm.collectives
    assert all(1 <= h <= 16 for h in adacomm.intervals)
    assert adacomm.bytes_sent == 8 * adacomm.collectives
    assert adacomm.overhead_seconds > adacomm.tracing_seconds > 0

    # The loss falls, so the AdaComm rule shrinks the interval below H_0.
    assert adacomm.intervals[-1] < 4


def test_grid_search_tries_every_candidate_and_counts_its_communication():
    x, y = data()
    result = baselines.grid_search_interval(
        make_model, x, y, batch_size=32, candidates=(1, 4), trial_steps=8
    )
    assert [t.interval for t in result.trials] == [1, 4]
    assert result.trials[0].communications == 8  # a gradient all-reduce per step
    assert result.trials[1].communications == 2 + 0  # averages after steps 4 and 8
    assert result.collectives == 10
    assert result.bytes_sent == 10 * (D * 2 + 2) * 4
    assert result.interval in (1, 4)
    assert result.seconds >= sum(t.seconds for t in result.trials)


KEEP_THE_SPLIT = """
import tensorflow as tf
from keras_skip.bench.workers import devices

cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(
    cpu, [tf.config.LogicalDeviceConfiguration()] * 4
)
devices.configure_replicas(2)  # as a benchmark run first in a test process
strategy = devices.mirrored_strategy(4)
total = strategy.reduce(
    "SUM", strategy.run(lambda: tf.constant(1.0)), axis=None
)
print(len(tf.config.list_logical_devices("CPU")), float(total))
"""


def test_a_benchmark_keeps_a_larger_split_of_the_cpu_it_finds():
    """A benchmark run in a process that split the CPU into more devices
    used to split it anew into fewer, before TensorFlow started: the
    overhead benchmark run first in a test process left it 2 devices, and a
    later `fit` on a 4-replica strategy hung in its averages."""
    done = run_python(KEEP_THE_SPLIT)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split()[-2:] == ["4", "4.0"]


@pytest.mark.slow
def test_overhead_benchmark_runs_and_reports_every_strategy(capsys):
    rows = overhead.run(
        epochs=1,
        replicas=2,
        hidden=(16,),
        trial_steps=3,
        candidates=(1, 8),
        verbose=False,
    )
    assert [r.strategy.split(" ")[0] for r in rows] == [
        "AdaptiveIntervalCallback",
        "AdaComm-style",
        "grid",
    ]
    ours, adacomm, grid = rows
    assert ours.collectives == 0 and ours.bytes_sent == 0  # one worker

    assert grid.choosing_seconds > ours.choosing_seconds
    # The callback traces nothing; the baseline's tracing is part of its cost.
    assert ours.tracing_seconds == 0 and ours.choosing_seconds > 0
    assert 0 < adacomm.tracing_seconds < adacomm.choosing_seconds
    assert grid.tracing_seconds is None
    table = overhead.format_table(rows)
    assert "x ours" in table and "of its training time choosing" in table
    assert "of which tracing" in table and "in trials" in table


def test_step_overhead_reports_wall_and_cpu_ratios(tmp_path, capsys):
    from keras_skip.bench import step_overhead

    out = tmp_path / "rows.json"
    code = step_overhead.main(
        [
            *("--steps-per-execution", "2", "--rounds", "2", "--steps", "4"),
            *("--json", str(out)),
        ]
    )
    assert code == 0
    (row,) = json.loads(out.read_text())
    assert row["steps_per_execution"] == 2 and row["rounds"] == 2
    for clock in ("ratio", "cpu_ratio"):
        assert 0 < row[f"{clock}_min"] <= row[clock] <= row[f"{clock}_max"]
    assert row["bare_ms_per_step"] > 0 and row["wrapped_ms_per_step"] > 0
    assert "wall time" in capsys.readouterr().out


def test_first_fit_benchmark_compares_equal_models_and_renders(tmp_path, capsys):
    from keras_skip.bench import first_fit
    from keras_skip.bench.reports import tables

    out = tmp_path / "first_fit.json"
    code = first_fit.main(
        [
            *("--replicas", "4", "--inner", "sgd", "--intervals", "4"),
            *("--fragments", "2", "--rounds", "1", "--steps", "3"),
            *("--json", str(out)),
        ]
    )
    assert code == 0
    (row,) = json.loads(out.read_text())
    assert (row["inner"], row["interval"], row["replicas"]) == ("sgd", 4, 4)
    assert (row["fragments"], row["overlap"]) == (2, 0)
    # Both arms trained the same model on the same batches, to the bit: the
    # first fragment's average after step 2, then a held last step.
    assert row["same_weights"] is True
    for clock in ("cpu_ratio", "wall_ratio"):
        assert 0 < row[f"{clock}_min"] <= row[clock] <= row[f"{clock}_max"]
    assert "| same weights |" in capsys.readouterr().out
    table = tables.render("first_fit", [out]).splitlines()
    assert table[2].startswith("| sgd | 4 | 2, 0 | ") and table[2].endswith("| yes |")
    with pytest.raises(ValueError, match="inner must be one of"):
        first_fit.measure(None, "rmsprop", 4)


def test_first_fit_scale_benchmark_times_three_variants_and_renders(tmp_path, capsys):
    from keras_skip.bench import first_fit_scale
    from keras_skip.bench.reports import tables

    out = tmp_path / "first_fit_scale.json"
    code = first_fit_scale.main(
        [
            *("--replicas", "2", "--layers", "1", "3", "--width", "8"),
            *("--rounds", "2", "--steps", "3", "--json", str(out)),
        ]
    )
    assert code == 0
    rows = json.loads(out.read_text())
    # Two variables per hidden layer, and the output layer's two.
    assert [(r["layers"], r["variables"]) for r in rows] == [(1, 4), (3, 8)]
    for row in rows:
        assert (row["replicas"], row["rounds"], row["steps"]) == (2, 2, 3)
        for variant in first_fit_scale.VARIANTS:
            assert row[f"{variant}_seconds"] > 0 and row[f"{variant}_cpu_seconds"] > 0
        for name in ("skip_ratio", "streaming_ratio", "streaming_cpu_ratio"):
            assert 0 < row[f"{name}_min"] <= row[name] <= row[f"{name}_max"]
    printed = capsys.readouterr().out
    assert "ratios to Keras' own fit" in printed
    table = tables.render("first_fit_scale", [out]).splitlines()
    assert table[0].startswith("| hidden layers | variables | Keras s |")
    assert table[2].startswith("| 1 | 4 | ") and table[3].startswith("| 3 | 8 | ")
    with pytest.raises(ValueError, match="layers must be an integer >= 1; got 0"):
        first_fit_scale.measure(None, 0)


def test_paired_ratios_are_the_median_and_extremes_of_each_pair():
    from keras_skip.bench import paired

    got = paired.ratios("r", [2.0, 9.0, 3.0], [1.0, 3.0, 4.0])
    assert got == {"r": 2.0, "r_min": 0.75, "r_max": 3.0}
    with pytest.raises(ValueError, match="got 2 and 1"):
        paired.ratios("r", [1.0, 2.0], [1.0])
    with pytest.raises(ValueError, match="got 0 and 0"):
        paired.ratios("r", [], [])
