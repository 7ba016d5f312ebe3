"""The time-to-accuracy harness, its network emulation and the demo."""

import json
import os
import pathlib
import re
import signal
import statistics
import subprocess
import sys
import time

import pytest

from keras_skip.bench import harness, links
from keras_skip.bench.links import netem
from keras_skip.bench.reports import tables

EMULATION = netem.unavailable_reason()
needs_emulation = pytest.mark.skipif(
    EMULATION is not None, reason=f"slow-link emulation unavailable: {EMULATION}"
)


def leftovers(tag):
    """Namespaces and links named with ``tag``: one network's, since other
    tests may hold networks of their own at the same time."""
    namespaces = subprocess.run(
        ["ip", "netns", "list"], capture_output=True, text=True
    ).stdout
    interfaces = subprocess.run(
        ["ip", "-o", "link"], capture_output=True, text=True
    ).stdout
    name = re.compile(rf"\b{tag}(n\d+|v\d+|vh|hub|br)\b")
    return [
        line for line in (namespaces + interfaces).splitlines() if name.search(line)
    ]


def tag_of(network):
    return network.bridge.removesuffix("br")


@pytest.mark.slow
def test_quick_mode_runs_every_method_and_reports(tmp_path):
    lines = []
    args = harness.build_parser().parse_args(
        [
            *("--quick", "--measure-drift", "--out", str(tmp_path)),
            *("--trace", str(tmp_path / "traces")),
        ]
    )
    report = harness.run(args, print_fn=lines.append)
    output = "\n".join(lines)
    assert "2 workers, loopback" in output
    methods = [row["method"] for row in report["rows"]]
    assert methods == [
        "synchronous SGD",
        "local SGD (interval 8)",
        "skip+correction (interval 8)",
        "skip+correction, adaptive (target_ratio 1)",
        "AdaComm-style local SGD",
        "no communication (bound)",
    ]
    rows = {row["method"]: row for row in report["rows"]}
    sync = rows["synchronous SGD"]
    assert sync["time_to_target"] is not None and sync["vs_sync"] == 1.0
    assert sync["synchronizations"] == 2 * (4000 // 64)
    skip = rows["skip+correction (interval 8)"]
    assert skip["synchronizations"] < sync["synchronizations"] / 4
    assert skip["interval"] == "8"
    assert rows["no communication (bound)"]["epoch_seconds"] > 0
    assert "[sync] epoch 1/2" in output  # progress display
    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved["target"] == pytest.approx(report["target"])
    plots = ("accuracy_vs_time", "epoch_time", "accuracy_vs_epoch", "drift_vs_epoch")
    for name in plots:
        assert (tmp_path / f"{name}.png").stat().st_size > 1000
    # Telemetry from the workers' logs: drift at averages, bytes per epoch.
    methods = {m["name"]: m for m in saved["methods"]}
    skip_epochs = methods["skip"]["epochs"]
    assert all(e["drift"] > 0 for e in skip_epochs)
    assert sum(e["bytes_sent"] for e in skip_epochs) == methods["skip"]["payload_bytes"]
    assert all(e["drift"] is None for e in methods["sync"]["epochs"])
    # --trace: every worker of every method traced, and summed up.
    for name, method in methods.items():
        for worker in (0, 1):
            assert (tmp_path / "traces" / name / f"worker-{worker}.json").exists()
        assert len(method["traces"]) == 2
        executions = method["traces"][0]["executions"]
        assert 0 < executions <= method["seconds"], name
    # No method of the quick run delays averages.
    assert saved["trace_hidden"] == saved["trace_flights"] == {}
    # The docs' tables are made from this file.
    results = tmp_path / "results.json"
    drift = tables.render("drift", [results]).splitlines()
    assert drift[0] == "| epoch | 1 | 2 |"
    skip_drift = next(line for line in drift if line.startswith("| drift, skip+"))
    shown = [float(cell) for cell in skip_drift.strip("|").split("|")[1:]]
    assert shown == pytest.approx([e["drift"] for e in skip_epochs], abs=5e-4)
    assert not any("synchronous" in line for line in drift)
    options = tables.render("options", [results]).splitlines()
    assert "payload MB" in options[0] and len(options) == 2 + len(methods)
    assert tables.render("run", [results]) == tables.run_table(saved)


def test_table_kinds_and_inputs_are_checked(tmp_path, capsys):
    results = tmp_path / "results.json"
    results.write_text(json.dumps({"methods": [{"label": "sync", "epochs": []}]}))
    with pytest.raises(ValueError, match=r"'plot' is not one of .*'drift'"):
        tables.render("plot", [results])
    with pytest.raises(ValueError, match="run it with --measure-drift"):
        tables.render("drift", [results])
    with pytest.raises(ValueError, match="made from one file, not 2"):
        tables.render("drift", [results, results])
    assert tables.main(["drift", str(results)]) == 2
    assert "tables drift: no method of this run measured drift" in (
        capsys.readouterr().err
    )


def test_refresh_prints_every_generated_table_of_a_page_again(tmp_path):
    (tmp_path / "docs" / "results").mkdir(parents=True)
    measured = {
        "steps_per_execution": 8,
        "bare_ms_per_step": 7.3,
        "wrapped_ms_per_step": 7.5,
        **dict.fromkeys(["ratio", "ratio_min", "ratio_max"], 1.02),
        **dict.fromkeys(["cpu_ratio", "cpu_ratio_min", "cpu_ratio_max"], 1.03),
    }
    (tmp_path / "docs/results/wrapper.json").write_text(json.dumps([measured]))
    marker = "<!-- generated: python -m keras_skip.bench.reports.tables wrapper "
    page = tmp_path / "docs" / "page.md"
    page.write_text(
        f"Before.\n\n{marker}docs/results/wrapper.json -->\n| stale |\n"
        "<!-- end of generated table -->\n\nAfter.\n"
    )
    assert tables.refresh(page) == 1
    text = page.read_text()
    assert "| stale |" not in text and "| 8 | 7.30 | 7.50 | 1.020 (1.02-1.02) |" in text
    assert text.startswith("Before.\n") and text.endswith("\nAfter.\n")


def test_overlap_span_benchmark_times_its_four_cases_and_makes_its_table(tmp_path):
    """``benchmarks/overlap_span.py`` on loopback, 2 real workers, a few steps:
    every worker reports its four medians, each the median of its timed
    rounds, and the share hidden computed from them; ``tables span`` prints
    a row from the file. No assertion compares one time with another: on a
    shared machine any of them can stretch (one with the parts one after
    the other once came out shorter than half their sum)."""
    script = pathlib.Path(__file__).parents[1] / "benchmarks" / "overlap_span.py"
    out = tmp_path / "span.json"
    arguments = ["--bandwidth", "none", "--steps", "3", "--rounds", "2"]
    result = subprocess.run(
        [sys.executable, str(script), *arguments, "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    assert "2 workers, loopback, no emulated link; medians of 2 rounds:" in (
        result.stdout
    )
    span = json.loads(out.read_text())
    assert span["arguments"]["steps"] == 3 and "json" not in span["arguments"]
    assert len(span["workers"]) == 2
    cases = ("steps", "all_reduce", "sequential", "together")
    for w in span["workers"]:
        assert sorted(w["rounds"]) == sorted(cases)
        for case in cases:
            assert len(w["rounds"][case]) == 2 and min(w["rounds"][case]) > 0
            assert w[case] == pytest.approx(statistics.median(w["rounds"][case]))
        expected = (w["steps"] + w["all_reduce"] - w["together"]) / min(
            w["steps"], w["all_reduce"]
        )
        assert w["hidden"] == pytest.approx(expected)
    table = tables.render("span", [out])
    assert table.splitlines()[2].startswith("| 2, 0 ms | 3 in ")
    bad = subprocess.run(
        [sys.executable, str(script), "--bandwidth", "100mbps"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert bad.returncode == 2 and "100mbps" in bad.stderr


def record(epoch, seconds, accuracy=None):
    return {
        "epoch": epoch,
        "seconds": seconds + 1.0,
        "validation_seconds": 1.0,
        "val_accuracy": accuracy,
    }


def method(name, times, accuracies=None):
    accuracies = accuracies or [None] * len(times)
    epochs = [
        record(i + 1, t, a)
        for i, (t, a) in enumerate(zip(times, accuracies, strict=True))
    ]
    return harness.MethodResult(name, name, epochs, 0, 0, None, [1], None, 0.0)


def test_the_bound_counts_the_no_communication_runs_first_epoch():
    nocomm = method("nocomm", [6.0, 9.0, 12.1, 15.0])
    assert nocomm.epoch_seconds == pytest.approx(3.0)
    assert nocomm.seconds_at(3) == pytest.approx(12.1)  # as measured
    assert nocomm.seconds_at(6) == pytest.approx(15.0 + 2 * 3.0)  # extended
    sync = method("sync", [20.0, 40.0, 60.0], [0.5, 0.8, 0.9])
    skip = method("skip", [9.0, 14.0, 19.0, 24.0], [0.6, 0.7, 0.85, 0.9])
    rows = {r["method"]: r for r in harness.summary_rows([sync, skip, nocomm], 0.85)}
    assert rows["nocomm"]["time_to_target"] == pytest.approx(12.1)
    assert rows["nocomm"]["epochs_to_target"] == 3
    assert rows["skip"]["vs_bound"] == pytest.approx(19.0 / 12.1)
    assert rows["sync"]["vs_bound"] == pytest.approx(60.0 / 12.1)


def test_overlap_hidden_is_the_share_of_communication_time_saved():
    nocomm = method("nocomm", [5.0, 8.0, 11.0])  # 3 s per epoch
    skip = method("skip", [15.0, 28.0, 41.0])  # 13 s: 10 s communicating
    overlap = method("overlap", [15.0, 26.0, 37.0])  # 11 s
    outer = method("outer-compress", [15.0, 25.0, 35.0])
    outer_overlap = method("outer-compress-overlap", [15.0, 26.0, 37.0])
    hidden = harness.overlap_hidden([skip, overlap, outer, outer_overlap, nocomm])
    assert hidden["overlap"] == pytest.approx(0.2)
    assert hidden["outer-compress-overlap"] == pytest.approx(-1 / 7)  # it cost
    assert harness.overlap_hidden([skip, overlap]) == {}  # no bound to measure
    # Streaming averages compare with the same fragments without overlap, and
    # with nothing when those did not run.
    stream = method("outer-compress-stream", [15.0, 27.0, 39.0])  # 12 s
    stream_overlap = method("outer-compress-overlap-stream", [15.0, 24.0, 33.0])
    hidden = harness.overlap_hidden([stream, stream_overlap, nocomm])
    assert hidden == {"outer-compress-overlap-stream": pytest.approx(1 / 3)}
    assert harness.overlap_hidden([outer, stream_overlap, nocomm]) == {}


def test_bad_arguments_are_clear_errors():
    with pytest.raises(
        ValueError, match=r"`bandwidth` must be a tc rate.*bandwidth='fast'"
    ):
        netem.check_rate("fast")
    assert netem.check_rate("100Mbit") == "100mbit"
    with pytest.raises(SystemExit, match="--stop-at-target needs --target"):
        harness.run(harness.build_parser().parse_args(["--stop-at-target"]))


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--workers", "0"], "--workers: must be an integer >= 1, got '0'"),
        (["--outer-momentum", "1.5"], "--outer-momentum: must be a number in [0, 1)"),
        (
            ["--outer-learning-rate", "-1"],
            "--outer-learning-rate: must be a number > 0",
        ),
        (["--methods", "fast"], "--methods: invalid choice: 'fast'"),
    ],
)
def test_bad_options_are_usage_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as stop:
        harness.build_parser().parse_args(argv)
    assert stop.value.code == 2
    assert message in capsys.readouterr().err


@needs_emulation
def test_emulated_links_limit_bandwidth_and_are_removed(tmp_path):
    script = tmp_path / "bandwidth.py"
    script.write_text(
        "import socket, sys, time\n"
        "if sys.argv[1] == 'server':\n"
        "    s = socket.socket(); s.bind(('0.0.0.0', 5201)); s.listen(1)\n"
        "    c, _ = s.accept(); n = 0; t = time.time()\n"
        "    while d := c.recv(1 << 20): n += len(d)\n"
        "    print(n * 8 / (time.time() - t) / 1e6)\n"
        "else:\n"
        "    c = socket.create_connection((sys.argv[2], 5201))\n"
        "    for _ in range(10): c.sendall(b'x' * (1 << 20))\n"
    )
    with netem.EmulatedNetwork(2, "20mbit") as network:
        server = subprocess.Popen(
            [*network.wrap(1), sys.executable, str(script), "server"],
            stdout=subprocess.PIPE,
            text=True,
        )
        time.sleep(1.0)
        subprocess.run(
            [*network.wrap(0), sys.executable, str(script), "client", network.hosts[1]],
            check=True,
            timeout=60,
        )
        measured = float(server.communicate(timeout=60)[0])
        sent = network.transmitted_bytes()
        assert sent[0] > 10 * (1 << 20)
    assert 14 < measured < 22, measured
    assert leftovers(tag_of(network)) == []


@needs_emulation
def test_emulated_network_is_removed_after_an_error():
    network = netem.EmulatedNetwork(2, "50mbit")
    with pytest.raises(RuntimeError, match="boom"), network:
        assert len(leftovers(tag_of(network))) >= 2
        raise RuntimeError("boom")
    assert leftovers(tag_of(network)) == []


@needs_emulation
@pytest.mark.slow
def test_interrupting_the_benchmark_removes_workers_and_namespaces(tmp_path):
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "keras_skip.bench",
            "--workers",
            "2",
            "--bandwidth",
            "50mbit",
            "--methods",
            "sync",
            "--hidden",
            "32",
            "--epochs",
            "100",
            "--out",
            str(tmp_path),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        # Ctrl-C as in a terminal, also when the suite itself runs in the
        # background (where the shell starts it with SIGINT ignored).
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    deadline = time.monotonic() + 120
    seen = ""
    while "epoch 1/100" not in seen:
        assert time.monotonic() < deadline, seen
        seen += process.stdout.readline()
    process.send_signal(signal.SIGINT)
    output = process.communicate(timeout=60)[0]
    assert process.returncode == 130, output
    assert "every worker process and network namespace was removed" in output
    assert leftovers(f"{netem.PREFIX}{process.pid % 100000}") == []
    # This run's workers only (their configuration names its directory):
    # other tests may run benchmark workers at the same time.
    workers = subprocess.run(
        ["pgrep", "-f", f"keras_skip.bench.workers.worker.*{tmp_path}"],
        capture_output=True,
        text=True,
    ).stdout
    assert workers.strip() == ""


def test_unavailable_namespaces_are_explained_and_a_relay_takes_over(monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    reason = "emulating slow links needs root (network namespaces and tc)"
    assert netem.unavailable_reason() == reason
    mechanism, note = links.choose("100mbit", "0ms")
    assert mechanism == "relay"
    assert note == f"{reason}; a user-space relay emulates the links instead"
    assert links.choose(None, "0ms") == (None, None)


def test_non_iid_order_gives_each_worker_its_own_reshuffled_shard():
    import numpy as np

    from keras_skip.bench.workers.worker import non_iid_order

    workers, batch, epochs = 4, 8, 3
    order = non_iid_order(100, workers, batch, epochs, seed=1)
    usable = 96  # whole global batches only
    assert order.shape == (epochs * usable,)
    shards = np.arange(usable).reshape(workers, -1)
    per_epoch = order.reshape(epochs, -1, workers, batch)  # epoch, step, worker
    for epoch in per_epoch:
        for w in range(workers):
            rows = epoch[:, w].reshape(-1)
            # Worker w sees exactly its shard, each example once per epoch.
            assert sorted(rows) == sorted(shards[w])
    # ... in a new order every epoch.
    assert not np.array_equal(per_epoch[0], per_epoch[1])


@pytest.mark.slow
def test_independent_processes_are_compared_with_the_no_communication_run(tmp_path):
    lines = []
    args = harness.build_parser().parse_args(
        [
            *("--workers", "2", "--bandwidth", "none", "--methods", "nocomm", "solo"),
            *("--hidden", "16", "--epochs", "2", "--nocomm-epochs", "3"),
            *("--out", str(tmp_path)),
        ]
    )
    report = harness.run(args, print_fn=lines.append)
    rows = {row["method"]: row for row in report["rows"]}
    solo = rows["2 independent processes (no cluster)"]
    nocomm = rows["no communication (bound)"]
    assert solo["epoch_seconds"] > 0 and nocomm["epoch_seconds"] > 0
    assert report["nocomm_vs_independent"] == pytest.approx(
        nocomm["epoch_seconds"] / solo["epoch_seconds"]
    )
    # Every solo process waited for the others before training.
    assert sorted(p.name for p in (tmp_path / "solo").glob("ready-*")) == [
        "ready-0",
        "ready-1",
    ]
    assert "epoch of 2 independent processes" in "\n".join(lines)


def test_independent_processes_that_never_all_get_ready_time_out(tmp_path):
    from keras_skip.bench.workers import worker

    with pytest.raises(TimeoutError, match="not every one of 2 processes"):
        worker.start_together(str(tmp_path), 0, 2, timeout=0.05)
    assert (tmp_path / "ready-0").exists()
    alone = tmp_path / "alone"
    alone.mkdir()
    worker.start_together(str(alone), 0, 1, timeout=0.05)  # at once


def test_stream_methods_average_fragments_and_say_so():
    """The methods with stream build the optimizer with --fragments
    fragments (delayed over --overlap-steps with overlap), and their labels
    name the count; the others keep one."""
    import tensorflow as tf

    from keras_skip.bench import methods
    from keras_skip.bench.workers import worker

    args = harness.build_parser().parse_args(
        [
            *("--methods", "stream", "outer-compress-overlap-stream", "skip"),
            *("--fragments", "3", "--overlap-steps", "4"),
        ]
    )
    labels = {name: label for name, label, _ in methods.method_plan(args)}
    assert "3 fragments" in labels["stream"]
    assert "3 fragments" in labels["outer-compress-overlap-stream"]
    assert "fragments" not in labels["skip"]
    config = {**worker.DEFAULTS, **harness._worker_config(args)}
    strategy = tf.distribute.get_strategy()
    for method, fragments, overlap in [
        ("stream", 3, False),
        ("outer-compress-overlap-stream", 3, 4),
        ("skip", 1, False),
    ]:
        model, _ = worker.build({**config, "method": method}, strategy)
        assert model.optimizer.fragments == fragments
        assert model.optimizer.overlap == overlap


def test_latest_methods_end_epochs_with_the_latest_averages():
    """The methods ending in -latest build the optimizer with
    boundary="latest" and say so in their labels; the others keep "full"."""
    import tensorflow as tf

    from keras_skip.bench import methods
    from keras_skip.bench.workers import worker

    args = harness.build_parser().parse_args(
        ["--methods", "outer-compress-stream-latest", "outer-compress"]
    )
    labels = {name: label for name, label, _ in methods.method_plan(args)}
    assert "latest averages at epoch ends" in labels["outer-compress-stream-latest"]
    assert "latest" not in labels["outer-compress"]
    config = {**worker.DEFAULTS, **harness._worker_config(args)}
    strategy = tf.distribute.get_strategy()
    for method, boundary, fragments in [
        ("outer-compress-stream-latest", "latest", 2),
        ("outer-compress", "full", 1),
    ]:
        model, _ = worker.build({**config, "method": method}, strategy)
        assert model.optimizer.boundary == boundary
        assert model.optimizer.fragments == fragments


def test_delayed_stream_methods_need_two_overlap_steps(capsys):
    """A fragment's average is delayed or not overlapped at all: a method
    with stream and overlap at --overlap-steps 1 is a usage error."""
    with pytest.raises(SystemExit) as stop:
        harness.main(["--methods", "outer-compress-overlap-stream"])
    assert stop.value.code == 2
    assert "--overlap-steps must be at least 2" in capsys.readouterr().err
