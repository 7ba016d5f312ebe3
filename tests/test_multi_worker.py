"""MultiWorkerMirroredStrategy with real worker processes on 127.0.0.1.

Every test bounds its workers' time and the launcher kills every process it
started, also when a test fails. Two workers that need no process of their
own train in shared processes (``workers/pool.py``) that take one job after
another, as a user's process trains one model after another; a failed job
ends them.
"""

import contextlib
import json
import sys
import time
import types

import internals
import numpy as np
import pytest
import tensorflow as tf
from conftest import components, keras_fixes_for_every_model, mirrored
from workers import fit_worker, pool

from keras_skip.bench.workers import launcher

WORKER = [sys.executable, fit_worker.__file__]


def run_workers(
    tmp_path, n, timeout=240, kill=None, log_dir=None, chief=False, **config
):
    """`n` fit_worker processes; with `chief`, process 0 is the chief task.

    Two workers that need nothing of their own (a kill, a chief, settings
    of the whole process) train in the shared pool's processes."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    config = {**config, "out": str(tmp_path)}
    if n == 2 and kill is None and not chief and pooled(config):
        return pool.shared(WORKER, n).run(
            config, log_dir or tmp_path / "logs", timeout=timeout
        )
    result = launcher.launch(
        [*WORKER, json.dumps(config)],
        n,
        timeout=timeout,
        kill=kill,
        log_dir=log_dir or tmp_path / "logs",
        chief=chief,
    )
    return result


def pooled(config) -> bool:
    """Whether every worker keeps the settings the pool's processes start
    with (`fit_worker.start`)."""
    overrides = [config, *config.get("workers", {}).values()]
    return all(
        c.get(key, fit_worker.DEFAULTS[key]) == fit_worker.DEFAULTS[key]
        for c in overrides
        for key in fit_worker.PROCESS_SETTINGS
    )


def ended_by_a_gone_peer(log: str) -> bool:
    """Whether a worker's log holds TensorFlow's error for a peer that
    stopped (a failed collective, or the coordination service's heartbeat
    check)."""
    return "UnavailableError" in log or "unhealthy" in log


def outputs(tmp_path, n):
    return [dict(np.load(tmp_path / f"worker-{i}.npz")) for i in range(n)]


def mirrored_reference(n, with_history=False, slots=None, **overrides):
    """The same training on n MirroredStrategy replicas of this process:
    (weights, corrections), and the `History` dict if `with_history`.

    `slots`: replica r trains on the rows a worker run gives to replica
    `slots[r]` (by default r) of each global batch."""
    import keras_skip

    config = {**fit_worker.DEFAULTS, **overrides}
    x, y = fit_worker.make_data(config)
    if slots is not None:
        rows = config["batch_per_replica"]
        order = np.arange(len(x)).reshape(-1, n, rows)[:, slots].ravel()
        x, y = x[order], y[order]

    strategy = mirrored(n)
    model = fit_worker.build_model(config, strategy)
    callbacks = (
        [keras_skip.SkipCorrectionCallback()] if config["mode"] == "skip" else []
    )
    batch = config["batch_per_replica"] * n
    # A plain optimizer needs the opt-in, as in the workers.
    stock = config["mode"] == "stock"
    with keras_fixes_for_every_model() if stock else contextlib.nullcontext():
        if config["dataset"]:
            data = tf.data.Dataset.from_tensor_slices((x, y)).batch(batch)
            history = model.fit(
                data, epochs=config["epochs"], verbose=0, callbacks=callbacks
            )
        else:
            history = model.fit(
                x,
                y,
                batch_size=batch,
                epochs=config["epochs"],
                shuffle=False,
                verbose=0,
                callbacks=callbacks,
            )
    weights = np.concatenate([w.ravel() for w in model.get_weights()])
    corrections = None
    if config["mode"] == "skip":
        per_variable = [components(c) for c in internals.corrections(model.optimizer)]
        corrections = [
            np.concatenate([copies[r].ravel() for copies in per_variable])
            for r in range(n)
        ]
    if with_history:
        return weights, corrections, history.history
    return weights, corrections


def assert_same_run(results, expected):
    """Every worker ended exactly as in the `expected` (uninterrupted) run."""
    for got, want in zip(results, expected, strict=True):
        np.testing.assert_array_equal(got["weights"], want["weights"])
        np.testing.assert_array_equal(got["corrections"], want["corrections"])
        assert got["iterations"] == want["iterations"]
        assert got["averages"] == want["averages"]


def assert_workers_agree(results):
    for r in results[1:]:
        np.testing.assert_array_equal(r["weights"], results[0]["weights"])
        np.testing.assert_array_equal(
            r["after_average_digests"], results[0]["after_average_digests"]
        )


@pytest.mark.slow
def test_four_workers_equal_four_mirrored_replicas(tmp_path):
    config = dict(interval=3, correction=1.0, momentum=0.5, epochs=2, validation=True)
    result = run_workers(tmp_path, 4, **config)
    assert result.ok, result.failure_report()
    results = outputs(tmp_path, 4)
    assert_workers_agree(results)
    # 256 samples / (4 x 8) = 8 steps per epoch: averages after steps 3, 6, the
    # epoch boundary (8), then 11, 14 and 16.
    assert results[0]["after_averages"].tolist() == [3, 6, 8, 11, 14, 16]
    assert results[0]["averages"] == 6
    # Each worker trained on its own shard: after the first (local) step
    # their weights differ.
    first = [r["first_step"] for r in results]
    assert all(np.abs(first[i] - first[0]).max() > 1e-6 for i in range(1, 4))
    weights, corrections = mirrored_reference(4, **config)
    np.testing.assert_allclose(results[0]["weights"], weights, rtol=1e-5, atol=1e-6)
    # Corrections divide weight differences by the period's learning-rate sum:
    # the ring all-reduce's order of summation (which shifts with the payload's
    # size) shows up in them at about 1e-6.
    for i in range(4):
        np.testing.assert_allclose(
            results[i]["corrections"], corrections[i], rtol=1e-4, atol=5e-6
        )


@pytest.mark.slow
def test_telemetry_of_two_workers_equals_two_mirrored_replicas(tmp_path):
    config = dict(interval=3, momentum=0.5, epochs=2, measure_drift=True)
    result = run_workers(tmp_path, 2, **config)
    assert result.ok, result.failure_report()
    results = outputs(tmp_path, 2)
    assert_workers_agree(results)
    weights, _, expected = mirrored_reference(2, with_history=True, **config)
    np.testing.assert_allclose(results[0]["weights"], weights, rtol=1e-5, atol=1e-6)
    # 256 samples / (2 x 8) = 16 steps per epoch: 5 interval averages and a
    # boundary one, each of the 6*16 + 16 + 16 + 1 = 129 float32 weights.
    assert expected["averages"] == [6, 6]
    assert expected["bytes_sent"] == [6 * 129 * 4] * 2
    assert min(expected["drift"]) > 0
    # Between workers each average also carries the one-float stop vote.
    for r in results:
        assert r["history_averages"].tolist() == expected["averages"]
        assert r["history_bytes_sent"].tolist() == [6 * 130 * 4] * 2
        assert r["bytes_sent"] == 2 * 6 * 130 * 4
        np.testing.assert_allclose(r["history_drift"], expected["drift"], rtol=1e-4)


def assert_two_workers_equal_two_mirrored_replicas(tmp_path, config, option, off):
    """Two workers train with `config`; both end identical and equal to two
    MirroredStrategy replicas of this process, which differ from a run with
    `option` set to `off` (so the option is exercised)."""
    result = run_workers(tmp_path, 2, **config)
    assert result.ok, result.failure_report()
    results = outputs(tmp_path, 2)
    assert_workers_agree(results)
    weights, corrections = mirrored_reference(2, **config)
    without, _ = mirrored_reference(2, **{**config, option: off})
    assert np.abs(weights - without).max() > 1e-5
    np.testing.assert_allclose(results[0]["weights"], weights, rtol=1e-5, atol=1e-6)
    for i in range(2):
        np.testing.assert_allclose(
            results[i]["corrections"], corrections[i], rtol=1e-4, atol=1e-6
        )


@pytest.mark.slow
def test_outer_optimizer_on_two_workers_equals_two_mirrored_replicas(tmp_path):
    config = dict(interval=4, momentum=0.5, epochs=2, outer=[0.7, 0.9])
    assert_two_workers_equal_two_mirrored_replicas(tmp_path, config, "outer", None)


@pytest.mark.slow
def test_averaged_second_moments_on_two_workers_equal_two_mirrored_replicas(tmp_path):
    """Adam's second moments ride in every average's payload across the
    workers; its first moments stay each worker's own."""
    config = dict(
        interval=4, epochs=2, adam=True, optimizer_state="average_second_moments"
    )
    assert_two_workers_equal_two_mirrored_replicas(
        tmp_path, config, "optimizer_state", "local"
    )


@pytest.mark.slow
@pytest.mark.parametrize("overlap", [False, True])
def test_streaming_averages_on_two_workers_equal_two_mirrored_replicas(
    tmp_path, overlap
):
    """Each fragment's average (its bfloat16 update, with Adam's second
    moments) is its own collective in the step's graph, after the step or
    (`overlap=True`) started before it; both workers take the same ones."""
    config = dict(
        interval=4,
        fragments=3,
        epochs=2,
        adam=True,
        optimizer_state="average_second_moments",
        compression="bfloat16",
        overlap=overlap,
    )
    assert_two_workers_equal_two_mirrored_replicas(tmp_path, config, "fragments", 1)


@pytest.mark.slow
def test_delayed_streaming_averages_on_two_workers_equal_two_mirrored_replicas(
    tmp_path,
):
    """overlap=2 with two fragments and bfloat16 averages: each fragment's
    16-bit update is all-reduced in a thread beside the next local steps
    (its own traced collective per fragment, the same on both workers) and
    lands by the same rule as on mirrored replicas of one process."""
    config = dict(
        interval=8,
        fragments=2,
        overlap=2,
        compression="bfloat16",
        momentum=0.5,
        epochs=2,
    )
    assert_two_workers_equal_two_mirrored_replicas(tmp_path, config, "overlap", False)
    assert all(r["threaded"] for r in outputs(tmp_path, 2))


@pytest.mark.slow
def test_latest_boundary_on_two_workers_equals_two_mirrored_replicas(tmp_path):
    """boundary="latest" with two delayed fragments in bfloat16: no full
    average at the epochs' ends (the delayed average on its way lands
    there), each worker shows its latest averages and goes on from its own
    weights, as two mirrored replicas do; `fit` ends with a full average."""
    config = dict(
        interval=8,
        fragments=2,
        overlap=2,
        compression="bfloat16",
        momentum=0.5,
        epochs=3,
        boundary="latest",
    )
    assert_two_workers_equal_two_mirrored_replicas(tmp_path, config, "boundary", "full")


@pytest.mark.slow
def test_mixed_float16_overflow_on_one_worker_is_skipped_by_both(tmp_path):
    # 256 samples / (2 x 8) = 16 steps per epoch; worker 1 overflows at step 5.
    config = dict(
        interval=4,
        epochs=1,
        policy="mixed_float16",
        overflow_step=-1,  # the layer on every worker, never armed
        workers={"1": {"overflow_step": 5}},
    )
    result = run_workers(tmp_path, 2, **config)
    assert result.ok, result.failure_report()  # nobody waited in a lone average
    results = outputs(tmp_path, 2)
    assert_workers_agree(results)
    assert np.isfinite(results[0]["weights"]).all()
    # The same run without the injected overflow takes one step more (the
    # first steps may overflow on their own while the loss scale settles).
    clean_dir = tmp_path / "clean"
    clean_dir.mkdir()
    clean = run_workers(clean_dir, 2, **{**config, "workers": {}})
    assert clean.ok, clean.failure_report()
    steps = outputs(clean_dir, 2)[0]["iterations"]
    assert [r["iterations"] for r in results] == [steps - 1, steps - 1]


@pytest.mark.slow
@pytest.mark.parametrize("overlap", [False, 3])
def test_compressed_averages_on_two_workers_equal_two_mirrored_replicas(
    tmp_path, overlap
):
    """bfloat16 averages, also delayed (overlap=3 at interval 4, in a thread
    beside the steps), whose buffers are made under the strategy, which
    broadcasts them from the chief."""
    config = dict(
        interval=4 if overlap else 3,
        momentum=0.5,
        epochs=2,
        compression="bfloat16",
        overlap=overlap,
    )
    assert_two_workers_equal_two_mirrored_replicas(
        tmp_path, config, "compression", None
    )
    threaded = [r["threaded"] for r in outputs(tmp_path, 2)]
    assert threaded == [bool(overlap)] * 2


@pytest.mark.slow
def test_overlapped_averages_on_two_workers_equal_two_mirrored_replicas(tmp_path):
    """Real collective all-reduces between processes, started before the
    local step they overlap; two steps per execution."""
    config = dict(
        interval=3, momentum=0.5, epochs=2, overlap=True, steps_per_execution=2
    )
    assert_two_workers_equal_two_mirrored_replicas(tmp_path, config, "overlap", False)


@pytest.mark.slow
@pytest.mark.parametrize("local_devices", [1, 2])
def test_delayed_averages_on_two_workers_equal_two_mirrored_replicas(
    tmp_path, local_devices
):
    """overlap=3 at interval 4: the all-reduce runs in a thread beside the
    next local steps (with two devices per worker, through each worker's
    first device); the means land by the same rule as on mirrored replicas
    of one process."""
    config = dict(interval=4, momentum=0.5, epochs=2, overlap=3)
    if local_devices == 1:
        assert_two_workers_equal_two_mirrored_replicas(
            tmp_path, config, "overlap", False
        )
        results = outputs(tmp_path, 2)
        assert all(r["threaded"] and r["delays_beside_steps"] for r in results)
        return
    result = run_workers(tmp_path, 2, local_devices=2, **config)
    assert result.ok, result.failure_report()
    results = outputs(tmp_path, 2)
    assert all(r["threaded"] for r in results)
    assert_workers_agree(results)
    # Worker w's device d trains on slot 2d + w of each global batch.
    weights, _ = mirrored_reference(4, slots=[0, 2, 1, 3], **config)
    np.testing.assert_allclose(results[0]["weights"], weights, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_delayed_averages_with_data_of_unknown_length_run_after_their_step(tmp_path):
    """The limit: over a dataset of unknown length every step's all-reduce
    of whether data remains could wait on the delayed average's, so each
    worker warns once and averages after the step, exactly as without
    overlap, and nothing hangs."""
    config = dict(interval=4, momentum=0.5, epochs=2, overlap=3, dataset="unknown")
    result = run_workers(tmp_path, 2, timeout=120, **config)
    assert result.ok, result.failure_report()
    for worker in result.workers:
        assert worker.log.count("agree at every step on whether data remains") == 1
    results = outputs(tmp_path, 2)
    assert_workers_agree(results)
    # So the adaptive rule counts nothing hidden by them.
    assert not any(r["delays_beside_steps"] for r in results)
    weights, _ = mirrored_reference(2, **{**config, "dataset": True, "overlap": False})
    delayed, _ = mirrored_reference(2, **{**config, "dataset": True})
    assert np.abs(weights - delayed).max() > 1e-5
    np.testing.assert_allclose(results[0]["weights"], weights, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_a_delayed_worker_does_not_delay_its_peers_local_steps(tmp_path):
    """Worker 1 sleeps 2 s before its 4th step. At interval 8 worker 0's 4th
    step is local and does not wait; the wait surfaces at step 8's average,
    which ends only after worker 1 has begun step 8. Synchronous training
    (interval 1), the control, waits at step 4 for worker 1 to begin it.

    The workers share one host clock, so their wall-clock stamps compare.
    Each traces its first step alone, so they start up to seconds apart:
    no assertion rests on how long step 8's average waits."""
    delay = {"1": {"delay": [3, 2.0]}}
    config = dict(epochs=1, workers=delay)
    local = run_workers(tmp_path / "local", 2, interval=8, **config)
    assert local.ok, local.failure_report()
    first, second = outputs(tmp_path / "local", 2)
    assert first["seconds"][3] < 1.0, first["seconds"]
    assert first["stamps"][7, 1] >= second["stamps"][7, 0], (first, second)
    synchronous = run_workers(tmp_path / "sync", 2, interval=1, **config)
    assert synchronous.ok, synchronous.failure_report()
    first, second = outputs(tmp_path / "sync", 2)
    assert first["seconds"][3] > 1.5, first["seconds"]
    assert first["stamps"][3, 1] >= second["stamps"][3, 0], (first, second)


@pytest.mark.slow
def test_a_local_step_executes_no_collective(tmp_path):
    """Every collective operation of the traced step and of the execution
    around it (the data iterator's) lies in a synchronizing branch (a
    synchronous step or an average): a local step takes none, and nor does
    resetting the metrics at an epoch's start. The controls: a plain
    optimizer's step has them outside, Keras' own reset reduces every metric
    variable, and the execution of an epoch with a last partial batch has
    the data agreement that remains."""
    config = dict(
        inspect=True,
        epochs=1,
        overlap=True,
        compression="bfloat16",
        outer=[0.7, 0.9],
        measure_drift=True,
        steps_per_execution=2,
        validation=True,
    )
    result = run_workers(tmp_path / "skip", 2, **config)
    assert result.ok, result.failure_report()
    for r in outputs(tmp_path / "skip", 2):
        assert r["traced_graphs"] >= 2  # a step and an execution
        assert r["collectives"].tolist() == []
        # Resetting the metrics, at every epoch's start, exchanges nothing.
        assert r["reset_reductions"] == 0
        assert r["metrics_after_reset"].size > 0
        assert r["metrics_after_reset"].max() == 0
    stock = run_workers(tmp_path / "stock", 2, **{**config, "mode": "stock"})
    assert stock.ok, stock.failure_report()
    stock_result = outputs(tmp_path / "stock", 2)[0]
    found = stock_result["collectives"].tolist()
    assert any(name.startswith("one_step_on_data") for name in found), found
    # Keras' own reset reads back every metric variable across workers.
    assert stock_result["reset_reductions"] == stock_result["metrics_after_reset"].size
    partial = run_workers(tmp_path / "partial", 2, **{**config, "samples": 250})
    assert partial.ok, partial.failure_report()
    found = outputs(tmp_path / "partial", 2)[0]["collectives"].tolist()
    assert found, found
    assert all(name.startswith("multi_step_on_iterator") for name in found), found


@pytest.mark.slow
def test_batch_logs_are_each_workers_own_and_epoch_logs_are_global(tmp_path):
    result = run_workers(tmp_path, 2, interval=4, epochs=2)
    assert result.ok, result.failure_report()
    results = outputs(tmp_path, 2)
    # The workers see different mini-batches, so different batch losses...
    assert np.abs(results[0]["batch_losses"] - results[1]["batch_losses"]).max() > 0
    # ...and the same epoch losses: the mean over every replica.
    np.testing.assert_array_equal(results[0]["loss"], results[1]["loss"])
    _, _, history = mirrored_reference(2, with_history=True, interval=4, epochs=2)
    np.testing.assert_allclose(results[0]["loss"], history["loss"], rtol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize(
    "stop, stopped_at",
    [
        ({"stop_at": 5}, 8),  # mid-period: at the next average, step 8
        ({"stop_at": 16}, 16),  # the epoch's last step: settled at its end
        ({"stop_at_epoch": 0}, 16),  # in on_epoch_end, as EarlyStopping
        # Delayed averages: the vote rides on the copy taken after step 8,
        # whose mean lands before step 12.
        ({"stop_at": 5, "overlap": 3}, 12),
    ],
    ids=["mid-period", "last-step", "epoch-end", "mid-period-delayed"],
)
def test_a_stop_on_one_worker_stops_both_at_the_same_step(tmp_path, stop, stopped_at):
    """Worker 1 alone sets stop_training (16 steps per epoch, interval 4);
    both workers stop after the same step, with identical weights."""
    stop = dict(stop)
    overlap = stop.pop("overlap", False)
    result = run_workers(
        tmp_path, 2, interval=4, epochs=3, overlap=overlap, workers={"1": stop}
    )
    assert result.ok, result.failure_report()
    assert "STOP REQUESTED" in result.workers[1].log
    results = outputs(tmp_path, 2)
    assert [r["iterations"] for r in results] == [stopped_at, stopped_at]
    np.testing.assert_array_equal(results[0]["weights"], results[1]["weights"])


@pytest.mark.slow
def test_plain_optimizer_tf_data_and_steps_per_execution(tmp_path):
    config = dict(
        mode="stock", dataset=True, steps_per_execution=3, validation=True, epochs=2
    )
    result = run_workers(tmp_path, 2, **config)
    assert result.ok, result.failure_report()
    results = outputs(tmp_path, 2)
    np.testing.assert_array_equal(results[0]["weights"], results[1]["weights"])
    assert results[0]["iterations"] == 2 * 256 // 16
    weights, _ = mirrored_reference(2, **config)
    np.testing.assert_allclose(results[0]["weights"], weights, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_stock_keras_still_fails_under_multi_worker(tmp_path):
    """Pins the Keras bug that keras_skip._compat patches (symbolic build)."""
    result = run_workers(tmp_path, 2, mode="unfixed", timeout=120)
    assert not result.timed_out
    assert all(w.returncode != 0 for w in result.workers)
    assert "with an unsupported type" in result.workers[0].log


@pytest.mark.slow
@pytest.mark.parametrize(
    "override, message",
    [
        ({"set_interval": 5}, "interval: worker 0 3, worker 1 5"),
        ({"correction": 0.5}, "correction: worker 0 1, worker 1 0.5"),
        ({"version": "9.9.9"}, "keras-skip version"),
        ({"adaptive": True}, "callback"),
    ],
)
def test_configuration_mismatch_is_a_clear_error_on_every_worker(
    tmp_path, override, message
):
    workers = {"1": override}
    if "set_interval" in override:
        workers["0"] = {"set_interval": "build only"}  # both build before fit
    result = run_workers(tmp_path, 2, timeout=120, workers=workers)
    assert not result.timed_out, result.failure_report()
    for worker in result.workers:
        assert worker.returncode != 0
        assert "The workers are not configured alike" in worker.log, worker.log[-2000:]
        assert message in worker.log
        assert "STEP" not in worker.log  # it failed before the first step


def survivor_of(result):
    """Worker 0 of a two-worker run whose worker 1 was killed, after checking
    that it failed on its own within 20 s of the kill (no hang)."""
    assert not result.timed_out, result.failure_report()
    survivor = result.workers[0]
    assert survivor.returncode != 0
    assert survivor.seconds - result.killed_at < 20, (
        survivor.seconds,
        result.killed_at,
    )
    return survivor


@pytest.mark.slow
def test_dead_peer_ends_the_survivor_within_the_peer_timeout(tmp_path):
    result = run_workers(
        tmp_path,
        2,
        timeout=120,
        epochs=3,
        peer_timeout=2.0,
        workers={"1": {"pause_epoch": 1, "pause_seconds": 60}},
        kill=launcher.Kill(worker=1, when="EPOCH 1 BEGIN"),
    )
    survivor = survivor_of(result)
    assert ended_by_a_gone_peer(survivor.log), survivor.log[-2000:]


@pytest.mark.slow
@pytest.mark.parametrize("local_devices", [1, 2])
def test_a_peer_dead_while_a_delayed_average_flies_is_a_clear_error(
    tmp_path, local_devices
):
    """overlap=3 at interval 4: worker 1 sleeps before its 4th step, whose
    copy worker 0 sends alone, and is killed; worker 0 steps on while its
    all-reduce waits, then fails when the mean must land. With two devices
    per worker the all-reduce is the one through each worker's first
    device."""
    result = run_workers(
        tmp_path,
        2,
        local_devices=local_devices,
        timeout=120,
        interval=4,
        overlap=3,
        epochs=2,
        peer_timeout=2.0,
        workers={"1": {"delay": [3, 60]}},
        kill=launcher.Kill(worker=1, when="STEP 3", delay=1.0),
    )
    survivor = survivor_of(result)
    assert "peer worker stopped or became unreachable" in survivor.log
    assert "STEP 6" in survivor.log  # it stepped on while the copy flew


@pytest.mark.slow
def test_a_peer_dead_while_a_fragment_flies_is_a_clear_error(tmp_path):
    """2 fragments delayed over 3 steps at interval 4: fragment 0's average
    after step 2 completes; worker 1 sleeps before its 4th step and is
    killed, so fragment 1's copy after step 4 flies alone. Worker 0 takes
    step 5 beside it, then fails when it must land before step 6, where
    fragment 0 falls due again."""
    result = run_workers(
        tmp_path,
        2,
        timeout=120,
        interval=4,
        fragments=2,
        overlap=3,
        epochs=2,
        peer_timeout=2.0,
        workers={"1": {"delay": [3, 60]}},
        kill=launcher.Kill(worker=1, when="STEP 3", delay=1.0),
    )
    survivor = survivor_of(result)
    assert "peer worker stopped or became unreachable" in survivor.log
    assert "STEP 5" in survivor.log and "STEP 6" not in survivor.log


@pytest.mark.slow
def test_fragments_with_two_devices_per_worker_equal_four_mirrored_replicas(
    tmp_path,
):
    """2 workers of 2 devices, 2 fragments delayed over 2 steps and epochs
    that end with the latest averages: the same as 4 mirrored replicas of
    one process."""
    config = dict(
        interval=8,
        fragments=2,
        overlap=2,
        momentum=0.5,
        epochs=2,
        boundary="latest",
    )
    result = run_workers(tmp_path, 2, local_devices=2, **config)
    assert result.ok, result.failure_report()
    results = outputs(tmp_path, 2)
    assert all(r["threaded"] for r in results)
    assert_workers_agree(results)
    # Worker w's device d trains on slot 2d + w of each global batch.
    weights, _ = mirrored_reference(4, slots=[0, 2, 1, 3], **config)
    np.testing.assert_allclose(results[0]["weights"], weights, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_fragments_with_data_of_unknown_length_end_epochs_with_a_full_average(
    tmp_path,
):
    """Over a dataset of unknown length no batch knows it ends the epoch:
    with boundary="latest" each epoch still ends with a full average, as
    two mirrored replicas with boundary="full" end theirs."""
    config = dict(
        interval=4,
        fragments=2,
        momentum=0.5,
        epochs=2,
        dataset="unknown",
        boundary="latest",
    )
    result = run_workers(tmp_path, 2, timeout=120, **config)
    assert result.ok, result.failure_report()
    results = outputs(tmp_path, 2)
    assert_workers_agree(results)
    full, _ = mirrored_reference(2, **{**config, "dataset": True, "boundary": "full"})
    np.testing.assert_allclose(results[0]["weights"], full, rtol=1e-5, atol=1e-6)


#: Worker 1 is killed in epoch 2: at its start, or (delayed averages,
#: interval 4, 16 steps an epoch) asleep before its 36th step, whose copy
#: worker 0 sends alone, so that the survivor fails with a mean in flight.
KILLED_IN_EPOCH_2 = {
    "plain": (
        dict(interval=3),
        {"pause_epoch": 2, "pause_seconds": 60},
        launcher.Kill(worker=1, when="EPOCH 2 BEGIN"),
    ),
    "delayed-in-flight": (
        dict(interval=4, overlap=3),
        {"delay": [35, 60]},
        launcher.Kill(worker=1, when="STEP 35", delay=1.0),
    ),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(KILLED_IN_EPOCH_2))
def test_kill_and_restart_resumes_from_the_backup_exactly(tmp_path, case):
    options, worker_1, kill = KILLED_IN_EPOCH_2[case]
    config = dict(momentum=0.5, epochs=3, peer_timeout=2.0, **options)
    reference = tmp_path / "reference"
    reference.mkdir()
    result = run_workers(reference, 2, **config)
    assert result.ok, result.failure_report()
    expected = outputs(reference, 2)

    backup = str(tmp_path / "backup")
    attempt = tmp_path / "attempt"
    attempt.mkdir()
    killed = run_workers(
        attempt, 2, backup_dir=backup, workers={"1": worker_1}, kill=kill, **config
    )
    assert not killed.timed_out and not killed.ok, killed.failure_report()
    assert "EPOCH 2 BEGIN" in killed.workers[0].log
    if "overlap" in options:
        assert "peer worker stopped or became unreachable" in killed.workers[0].log
    # Epochs 0 and 1 were backed up; restarting resumes at epoch 2.
    restarted = run_workers(
        attempt, 2, backup_dir=backup, log_dir=attempt / "logs2", **config
    )
    assert restarted.ok, restarted.failure_report()
    log = restarted.workers[0].log
    assert "EPOCH 0 BEGIN" not in log and "EPOCH 2 BEGIN" in log
    assert_same_run(outputs(attempt, 2), expected)


@pytest.mark.slow
def test_chief_and_worker_back_up_apart_and_resume_exactly(tmp_path):
    """With a "chief" job, the chief (task 0 of its job) and worker task 0
    must not share a backup directory: they would overwrite each other's."""
    config = dict(interval=3, momentum=0.5, epochs=3, peer_timeout=2.0)
    reference = tmp_path / "reference"
    reference.mkdir()
    result = run_workers(reference, 2, chief=True, **config)
    assert result.ok, result.failure_report()
    expected = outputs(reference, 2)

    backup = tmp_path / "backup"
    attempt = tmp_path / "attempt"
    attempt.mkdir()
    killed = run_workers(
        attempt,
        2,
        chief=True,
        backup_dir=str(backup),
        workers={"1": {"pause_epoch": 2, "pause_seconds": 60}},
        kill=launcher.Kill(worker=1, when="EPOCH 2 BEGIN"),
        **config,
    )
    assert not killed.timed_out and not killed.ok, killed.failure_report()
    # Each backed epochs 0 and 1 up (epoch-1, epoch-2) in its own directory,
    # the chief in worker-0.
    assert sorted(d.name for d in backup.iterdir()) == ["worker-0", "worker-1"]
    for directory in backup.iterdir():
        assert sorted(e.name for e in directory.iterdir()) == ["epoch-1", "epoch-2"]
    assert "BACKUP chief worker-0" in killed.workers[0].log
    assert "BACKUP worker worker-1" in killed.workers[1].log

    restarted = run_workers(
        attempt,
        2,
        chief=True,
        backup_dir=str(backup),
        log_dir=attempt / "logs2",
        **config,
    )
    assert restarted.ok, restarted.failure_report()
    for worker in restarted.workers:
        begun = [line for line in worker.log.splitlines() if line.startswith("EPOCH")]
        assert begun[0] == "EPOCH 2 BEGIN", worker.log[-2000:]
    assert_same_run(outputs(attempt, 2), expected)


@pytest.mark.parametrize(
    "cluster",
    [
        {"chief": ["a:1"], "worker": ["b:1"]},
        {"chief": ["a:1"], "worker": ["b:1", "c:1", "d:1"]},
        {"worker": ["a:1", "b:1", "c:1"]},
    ],
)
def test_every_training_task_has_its_own_worker_index(monkeypatch, cluster):
    from tensorflow.python.distribute import multi_worker_util

    from keras_skip import multi_worker

    spec = tf.train.ClusterSpec(cluster)
    n = sum(len(addresses) for addresses in cluster.values())
    # A stand-in for a MultiWorkerMirroredStrategy of n workers, which cannot
    # be created in this process without its peers.
    monkeypatch.setattr(multi_worker, "num_workers", lambda strategy: n)
    indices = []
    for task_type, addresses in cluster.items():
        for task_id in range(len(addresses)):
            resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(
                spec, task_type=task_type, task_id=task_id
            )
            index = multi_worker.worker_index(
                types.SimpleNamespace(cluster_resolver=resolver)
            )
            # TensorFlow's numbering, the replica order of the collectives.
            assert index == multi_worker_util.id_in_cluster(spec, task_type, task_id)
            indices.append(index)
    assert sorted(indices) == list(range(n))


def test_gather_of_any_length_reuses_one_traced_function():
    from keras_skip import multi_worker

    strategy = mirrored(3)
    short = multi_worker.gather(strategy, [1.5, -2.0])
    long = multi_worker.gather(strategy, np.arange(2 * multi_worker.GATHER_WIDTH + 3))
    # Every replica contributes this process's vector, in replica order.
    np.testing.assert_array_equal(short, [[1.5, -2.0]] * 3)
    np.testing.assert_array_equal(
        long, np.tile(np.arange(2 * multi_worker.GATHER_WIDTH + 3), (3, 1))
    )
    assert strategy._keras_skip_gather.experimental_get_tracing_count() == 1


def test_adaptive_interval_is_agreed_by_both_workers_and_times_the_slower(tmp_path):
    # Worker 1's forward pass sleeps 50 ms a step: t_comp is its time.
    run = run_workers(tmp_path, 2, adaptive=True, workers={"1": {"step_sleep": 0.05}})
    assert run.ok, run.failure_report()
    results = outputs(tmp_path, 2)
    assert_workers_agree(results)
    np.testing.assert_array_equal(results[0]["decision"], results[1]["decision"])
    interval, t_comp, t_comm = results[0]["decision"]
    assert t_comp >= 0.05 and t_comm >= 0
    for r in results:
        assert r["probes"] == 1
        # One all-reduce of 16 float64 per replica row, 2 replicas.
        np.testing.assert_array_equal(r["probe_traffic"], [1, 8 * 2 * 16])
        np.testing.assert_array_equal(r["history_interval"], [interval] * 2)


@pytest.mark.slow
def test_restart_keeps_the_adaptive_decision(tmp_path):
    backup = str(tmp_path / "backup")
    config = dict(adaptive=True, epochs=3, peer_timeout=2.0, backup_dir=backup)
    killed = run_workers(
        tmp_path,
        2,
        workers={"1": {"pause_epoch": 2, "pause_seconds": 60}},
        kill=launcher.Kill(worker=1, when="EPOCH 2 BEGIN"),
        **config,
    )
    assert not killed.timed_out and not killed.ok
    restarted = run_workers(tmp_path, 2, log_dir=tmp_path / "logs2", **config)
    assert restarted.ok, restarted.failure_report()
    results = outputs(tmp_path, 2)
    for r in results:
        assert r["probes"] == 0  # the decision came from the backup
    np.testing.assert_array_equal(results[0]["decision"], results[1]["decision"])
    assert results[0]["decision"][0] >= 1


@pytest.mark.slow
def test_a_failed_pool_job_ends_its_workers_and_the_next_job_starts_afresh(tmp_path):
    """The shared worker processes of these tests: worker 1 fails while
    worker 0 waits for it in a collective; the pool waits until worker 0
    ends by its own error (its peer is gone), as a launch would, then ends
    both, and the next job trains as in new processes."""
    shared = pool.shared(WORKER, 2)
    failed = run_workers(tmp_path / "failed", 2, workers={"1": {"interval": -1}})
    assert not failed.ok and not failed.timed_out, failed.failure_report()
    assert failed.workers[1].returncode == 1
    assert "`interval` must be" in failed.workers[1].log, failed.workers[1].log
    # Not cut short by its peer's failure: its own error is in its own log.
    assert failed.workers[0].returncode == 1, failed.failure_report()
    assert ended_by_a_gone_peer(failed.workers[0].log), failed.workers[0].log[-2000:]
    assert shared.processes == []
    result = run_workers(tmp_path / "next", 2)
    assert result.ok, result.failure_report()
    expected, _ = mirrored_reference(2)
    for r in outputs(tmp_path / "next", 2):
        np.testing.assert_allclose(r["weights"], expected, rtol=1e-5, atol=1e-6)
    assert len(shared.processes) == 2


def test_launcher_kills_every_worker_on_timeout(tmp_path):
    start = time.monotonic()
    result = launcher.launch(
        [sys.executable, "-c", "import time; print('up', flush=True); time.sleep(600)"],
        3,
        timeout=3,
        log_dir=tmp_path,
    )
    assert result.timed_out and not result.ok
    assert time.monotonic() - start < 40
    assert all(w.returncode is None for w in result.workers)
    assert all("up" in w.log for w in result.workers)


def test_launcher_reports_exit_codes_and_sets_tf_config(tmp_path):
    script = (
        "import json, os, sys; c = json.loads(os.environ['TF_CONFIG']); "
        "print(c['task']['index'], len(c['cluster']['worker']), "
        "os.environ['TF_NUM_INTRAOP_THREADS']); sys.exit(c['task']['index'])"
    )
    result = launcher.launch(
        [sys.executable, "-c", script], 2, timeout=60, log_dir=tmp_path
    )
    assert [w.returncode for w in result.workers] == [0, 1]
    assert result.workers[1].log.split() == ["1", "2", "1"]
    assert not result.ok


def test_worker_env_sets_the_cluster_the_index_and_the_threads(monkeypatch):
    monkeypatch.setenv("TF_CPP_MIN_LOG_LEVEL", "0")
    monkeypatch.setenv("KERAS_SKIP_SOMETHING", "kept")
    addresses = ["127.0.0.1:1", "127.0.0.1:2"]
    env = launcher.worker_env(addresses, 1, {"EXTRA": "x"}, threads_per_worker=3)
    assert json.loads(env["TF_CONFIG"]) == json.loads(launcher.tf_config(addresses, 1))
    assert env["KERAS_SKIP_WORKER"] == "1"
    assert env["TF_NUM_INTRAOP_THREADS"] == env["TF_NUM_INTEROP_THREADS"] == "3"
    assert env["PYTHONUNBUFFERED"] == "1"
    assert env["TF_CPP_MIN_LOG_LEVEL"] == "0"  # the user's choice is kept
    assert env["EXTRA"] == "x" and env["KERAS_SKIP_SOMETHING"] == "kept"
    monkeypatch.delenv("TF_NUM_INTRAOP_THREADS", raising=False)
    default_threads = launcher.worker_env(addresses, 0, threads_per_worker=None)
    assert "TF_NUM_INTRAOP_THREADS" not in default_threads


def test_launcher_tf_config_with_a_chief_numbers_the_tasks_like_tensorflow():
    from tensorflow.python.distribute import multi_worker_util

    addresses = ["h:1", "h:2", "h:3"]
    for i in range(3):
        config = json.loads(launcher.tf_config(addresses, i, chief=True))
        assert config["cluster"] == {"chief": ["h:1"], "worker": ["h:2", "h:3"]}
        task = config["task"]
        assert task == (
            {"type": "chief", "index": 0}
            if i == 0
            else {"type": "worker", "index": i - 1}
        )
        spec = tf.train.ClusterSpec(config["cluster"])
        assert multi_worker_util.id_in_cluster(spec, task["type"], task["index"]) == i
    assert json.loads(launcher.tf_config(addresses, 1)) == {
        "cluster": {"worker": addresses},
        "task": {"type": "worker", "index": 1},
    }
