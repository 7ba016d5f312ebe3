"""Traces of training: the trace-event file, its summary by hand, and what
`TraceCallback` records of real training (mirrored replicas, and worker
processes whose delayed averages' all-reduces run in a thread)."""

import json

import keras
import numpy as np
import pytest
from conftest import mirrored
from test_multi_worker import run_workers

import keras_skip
from keras_skip import tracing


def span(name, start, end, track=1, **args):
    return {
        "name": name,
        "ph": "X",
        "ts": start * 1e6,
        "dur": (end - start) * 1e6,
        "pid": 0,
        "tid": track,
        "args": args,
    }


def test_summary_by_hand():
    events = [
        span("execution", -4.0, -1.0, steps=1, averages=0),  # traces: not a step
        span("execution", 0.0, 1.0, steps=10, averages=0),  # alone: 0.1 s a step
        span("all-reduce", 1.0, 3.0, track=2, beside=True),
        span("execution", 1.0, 2.5, steps=10, averages=0),  # beside: 0.15 s a step
        span("wait", 2.5, 3.0),
        span("land", 3.0, 3.1),
        span("execution", 3.1, 4.0, steps=10, averages=1),  # an average inside
        span("all-reduce", 4.0, 5.0, beside=False),  # after its execution
        span("land", 5.0, 5.1),
        span("boundary average", 5.1, 5.6),
    ]
    s = tracing.summary(events)
    assert s["executions"] == pytest.approx(3.0 + 3.4)
    assert s["all_reduce"] == pytest.approx(3.0)
    assert s["beside"] == pytest.approx(2.0)
    assert s["waited"] == pytest.approx(0.5)
    assert s["hidden"] == pytest.approx((2.0 - 0.5) / 3.0)
    assert s["delayed_averages"] == 2
    assert s["boundary_averages"] == pytest.approx(0.5)
    assert s["step_seconds"]["alone"] == pytest.approx(0.1)
    assert s["step_seconds"]["beside"] == pytest.approx(0.15)
    assert tracing.summary([])["hidden"] is None


def test_a_trace_file_is_the_trace_event_format(tmp_path):
    trace = tracing.Trace(worker=3)
    assert tracing.active() is None
    with tracing.span("outside", "x"):  # no trace active: nothing recorded
        pass
    with tracing.recording(trace):
        assert tracing.active() is trace
        with tracing.span("all-reduce", "average", tracing.ALL_REDUCE) as args:
            args["bytes"] = 12
        tracing.instant("copy", "average")
        inner = tracing.Trace()
        with tracing.recording(inner), tracing.span("elsewhere", "x"):
            pass
        assert tracing.active() is trace
    assert tracing.active() is None
    path = trace.write(tmp_path / "deep" / "worker-3.json")
    document = json.loads(path.read_text())
    events = document["traceEvents"]
    names = {e["args"]["name"] for e in events if e["ph"] == "M"}
    assert names == {"worker 3", tracing.ALL_REDUCE, tracing.STEPS}
    recorded = [e for e in events if e["ph"] != "M"]
    assert [e["name"] for e in recorded] == ["all-reduce", "copy"]
    assert recorded[0]["args"] == {"bytes": 12} and recorded[0]["pid"] == 3
    assert recorded[0]["dur"] >= 0 and recorded[1]["ph"] == "i"
    assert [e["name"] for e in inner.events] == ["elsewhere"]
    assert not list(tmp_path.glob("deep/*.partial"))


def test_the_callback_refuses_a_directory_that_is_not_a_path():
    with pytest.raises(ValueError, match="`directory` must be a path"):
        keras_skip.TraceCallback(None)


def test_fit_on_mirrored_replicas_records_every_execution_and_delayed_average(tmp_path):
    strategy = mirrored(2)
    with strategy.scope():
        model = keras.Sequential(
            [keras.Input((4,)), keras.layers.Dense(8), keras.layers.Dense(1)]
        )
        optimizer = keras_skip.SkipCorrectionOptimizer(
            keras.optimizers.SGD(0.05), interval=4, overlap=3
        )
        model.compile(optimizer=optimizer, loss="mse", steps_per_execution=2)
    x = np.random.default_rng(0).random((256, 4)).astype("float32")
    tracer = keras_skip.TraceCallback(tmp_path)
    model.fit(
        x,
        x.sum(axis=1),
        epochs=2,
        batch_size=16,
        verbose=0,
        validation_data=(x[:32], x[:32].sum(axis=1)),
        callbacks=[tracer, keras_skip.SkipCorrectionCallback()],
    )
    assert tracer.path == tmp_path / "worker-0.json"
    events = tracing.read(tracer.path)
    by_name = {}
    for e in events:
        by_name.setdefault(e["name"], []).append(e)
    executions = by_name["execution"]
    assert len(executions) == 2 * 16 // 2
    assert sum(e["args"]["steps"] for e in executions) == 2 * 16
    assert len(by_name["epoch"]) == len(by_name["validation"]) == 2
    # Every copy was all-reduced (in a thread, beside the next executions:
    # replicas of one process reduce through one device) and landed, in that
    # order; the averages inside executions and the boundary averages add up
    # to the optimizer's count.
    assert optimizer._flight.threaded
    copies, reduces, lands = by_name["copy"], by_name["all-reduce"], by_name["land"]
    assert len(copies) == len(reduces) == len(lands) > 0
    tracks = {e["args"]["name"]: e["tid"] for e in by_name["thread_name"]}
    for c, r, land in zip(copies, reduces, lands, strict=True):
        assert c["ts"] <= r["ts"] and r["ts"] + r["dur"] <= land["ts"]
        assert r["args"] == {"beside": True}
        assert r["tid"] == tracks[tracing.ALL_REDUCE]
    assert len(by_name["wait"]) == len(reduces)
    inside = sum(e["args"]["averages"] for e in executions)
    boundary = sum(e["args"]["averaged"] for e in by_name["boundary average"])
    assert inside + boundary == optimizer.averages_performed
    assert len(by_name["create buffers"]) == 1
    summary = tracing.summary(events)
    assert summary["beside"] == pytest.approx(summary["all_reduce"])
    assert 0 <= summary["hidden"] <= 1
    assert tracing.active() is None


@pytest.mark.parametrize("local_devices", [1, 2])
def test_two_workers_trace_the_all_reduce_beside_the_steps(tmp_path, local_devices):
    """With one device per worker, or two (reduced through the first), a
    delayed average's all-reduce runs in a thread: each worker's trace shows
    it on its own track, the training thread's waits for it, and the
    workers' processes apart."""
    traces = tmp_path / "traces"
    result = run_workers(
        tmp_path,
        2,
        interval=4,
        overlap=3,
        epochs=2,
        trace=str(traces),
        local_devices=local_devices,
    )
    assert result.ok, result.failure_report()
    for worker in (0, 1):
        document = json.loads((traces / f"worker-{worker}.json").read_text())
        events = document["traceEvents"]
        tracks = {
            e["args"]["name"]: e["tid"] for e in events if e["name"] == "thread_name"
        }
        assert {e["pid"] for e in events} == {worker}
        reduces = [e for e in events if e["name"] == "all-reduce"]
        assert reduces and all(e["tid"] == tracks[tracing.ALL_REDUCE] for e in reduces)
        assert all(e["args"]["beside"] for e in reduces)
        summary = tracing.summary(events)
        assert summary["delayed_averages"] == len(reduces)
        assert summary["beside"] == pytest.approx(summary["all_reduce"])
        assert 0 <= summary["hidden"] <= 1
        waits = [e for e in events if e["name"] == "wait"]
        assert len(waits) == len(reduces)


def test_flights_across_workers_by_hand(tmp_path):
    """Worker 1 starts the all-reduce 0.3 s after worker 0; from then it
    takes 1.0 s, during which worker 1 computes 2 executions of 5 steps
    (0.2 s) before it waits 0.75 s for the mean."""
    from keras_skip.bench.reports import traces

    def write(worker, events):
        trace = tracing.Trace(worker)
        for e in events:
            trace.complete(e["name"], "x", e["ts"], e["ts"] + e["dur"], **e["args"])
        trace.write(tmp_path / f"worker-{worker}.json")

    write(0, [span("all-reduce", 0.0, 1.3, beside=True), span("wait", 0.4, 1.3)])
    write(
        1,
        [
            span("all-reduce", 0.3, 1.3, beside=True),
            span("execution", 0.3, 0.4, steps=5),
            span("execution", 0.45, 0.55, steps=5),
            span("execution", 0.55, 1.35, steps=1),  # holds the wait
            span("wait", 0.55, 1.3),
        ],
    )
    [flight] = traces.flights(traces.read_workers(tmp_path))
    assert flight.skew == pytest.approx(0.3)
    assert flight.wire == pytest.approx(1.0)
    assert flight.steps == 10
    assert flight.computed == pytest.approx(0.2)
    assert flight.waited == pytest.approx(0.75)
    assert "1 delayed averages" in traces.describe(tmp_path)
    assert traces.main([str(tmp_path / "none")]) == 2
