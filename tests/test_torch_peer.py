"""``keras-skip bench --peer torch``: PyTorch on the same links, data, shards
and initial weights as the Keras methods, in one table.

The suite's CI has no PyTorch: what needs it skips; the option, its errors,
the export of the Keras workers' weights and batches, and the merged table
are tested for real without it."""

import importlib.util
import json
import pathlib
import sys

import numpy as np
import pytest

from keras_skip.bench import harness
from keras_skip.bench.reports import peer, tables
from keras_skip.bench.workers import export, launcher

ROOT = pathlib.Path(__file__).resolve().parents[1]


def torch_peer_script():
    """``benchmarks/torch_peer.py`` as a module (it imports PyTorch only in
    the functions that use it)."""
    spec = importlib.util.spec_from_file_location(
        "torch_peer", ROOT / "benchmarks" / "torch_peer.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_peer_option_names_what_is_allowed(capsys):
    args = harness.build_parser().parse_args(["--peer", "torch"])
    assert args.peer == "torch" and args.peer_fragments == 2
    assert harness.build_parser().parse_args([]).peer is None
    with pytest.raises(SystemExit) as stop:
        harness.build_parser().parse_args(["--peer", "jax"])
    assert stop.value.code == 2
    error = capsys.readouterr().err
    assert "argument --peer: invalid choice: 'jax'" in error and "torch" in error


def test_peer_without_torch_fails_at_once_saying_how_to_install(tmp_path, monkeypatch):
    # What an installation without the extra sees (this blocks the imports
    # where PyTorch is installed, as in CI it is absent).
    monkeypatch.setitem(sys.modules, "torch", None)
    monkeypatch.setitem(sys.modules, "torchft", None)
    out = tmp_path / "run"
    args = harness.build_parser().parse_args(
        ["--peer", "torch", "--bandwidth", "none", "--out", str(out)]
    )
    with pytest.raises(SystemExit) as stop:
        harness.run(args, print_fn=lambda line: None)
    message = str(stop.value.code)
    assert message.startswith("--peer torch needs torch and torchft, not installed")
    assert 'pip install -e ".[peer]"' in message
    assert "Allowed values of --peer: torch." in message
    assert not out.exists()  # nothing created


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--latency", "25ms"], "without latency"),
        (["--workload", "cnn"], "use --workload mlp, not cnn"),
        (["--interval", "9"], "--interval (9) must be divisible by --peer-fragments"),
        (["--peer-sync-delay", "16"], "--peer-sync-delay must be in [0, 16)"),
    ],
)
def test_peer_refuses_what_it_cannot_compare(argv, message, tmp_path):
    out = tmp_path / "run"
    args = harness.build_parser().parse_args(
        ["--peer", "torch", "--bandwidth", "none", *argv, "--out", str(out)]
    )
    with pytest.raises(
        SystemExit,
        match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\["),
    ):
        harness.run(args, print_fn=lambda line: None)
    assert not out.exists()


def test_export_holds_the_keras_weights_batches_and_data(tmp_path):
    path = tmp_path / "inputs.npz"
    export.export(path, hidden=[16], seed=3, workers=2, batch=8, epochs=2)
    loaded = export.load(path)
    assert loaded["meta"] == {
        "seed": 3,
        "hidden": [16],
        "workers": 2,
        "batch": 8,
        "epochs": 2,
    }
    weights = loaded["weights"]
    assert [w.shape for w in weights] == [(784, 16), (16,), (16, 10), (10,)]
    for saved, built in zip(weights, export.initial_weights([16], 3), strict=True):
        np.testing.assert_array_equal(saved, built)
    assert loaded["x"].shape == (4000, 784) and loaded["x_test"].shape == (1000, 784)
    order = loaded["order"]
    assert order.shape == (2, 4000 // 16, 2, 8)
    for epoch in order:  # every epoch a new shuffle, no row twice
        rows = epoch.reshape(-1)
        assert len(set(rows.tolist())) == rows.size and rows.max() < 4000
    assert not np.array_equal(order[0], order[1])
    # Another seed, other weights and another order.
    other = export.initial_weights([16], 4)
    assert not np.array_equal(other[0], weights[0])

    # PyTorch's layout: each kernel transposed, and back.
    script = torch_peer_script()
    linear = script.torch_linear_weights(weights)
    assert [w.shape for w in linear] == [(16, 784), (16,), (10, 16), (10,)]
    for back, saved in zip(linear[0::2], weights[0::2], strict=True):
        np.testing.assert_array_equal(back.T, saved)

    # A forward pass in PyTorch's layout gives Keras' logits.
    import keras

    from keras_skip.bench.workers import workloads

    model = workloads.mlp((16,))
    model.set_weights(weights)
    x = loaded["x_test"][:64]
    h = np.maximum(x @ linear[0].T + linear[1], 0)
    logits = h @ linear[2].T + linear[3]
    np.testing.assert_allclose(
        logits, keras.ops.convert_to_numpy(model(x)), rtol=1e-5, atol=1e-5
    )


def test_weights_written_by_a_worker_load_in_order(tmp_path):
    weights = export.initial_weights([8], 0)
    path = tmp_path / "w.npz"
    np.savez(
        path,
        kernel_0=weights[0],
        bias_0=weights[1],
        kernel_1=weights[2],
        bias_1=weights[3],
    )
    for loaded, saved in zip(export.load_weights(path), weights, strict=True):
        np.testing.assert_array_equal(loaded, saved)


@pytest.mark.slow
def test_exported_order_is_what_each_worker_trains_on(tmp_path):
    """Two MultiWorkerMirroredStrategy workers on 127.0.0.1 read the rows of
    the first batches of two epochs from the benchmark's own data and
    pipeline: the exported order, epoch by epoch."""
    result = launcher.launch(
        [sys.executable, str(ROOT / "tests" / "workers" / "peer_order_worker.py")],
        2,
        timeout=300,
        log_dir=tmp_path,
    )
    assert result.ok, result.failure_report()
    order = export.batch_order(4000, 2, 32, 2, seed=0)
    for w in result.workers:
        line = next(line for line in w.log.splitlines() if line.startswith("ROWS "))
        rows = json.loads(line.removeprefix("ROWS "))
        assert rows == order[:, :3, w.index].tolist()


def method(name, label, accuracies, seconds, wire, steps_per_epoch=10):
    return {
        "name": name,
        "label": label,
        "epochs": [
            {
                "epoch": i + 1,
                "seconds": s,
                "validation_seconds": 0.0,
                "val_accuracy": a,
                "iterations": steps_per_epoch * (i + 1),
            }
            for i, (a, s) in enumerate(zip(accuracies, seconds, strict=True))
        ],
        "synchronizations": 4,
        "payload_bytes": 8_000_000,
        "wire_bytes": wire,
        "intervals": [32],
        "decision": None,
        "seconds": seconds[-1] + 5,
        "traces": None,
    }


def test_one_table_of_both_frameworks_and_the_ratios(tmp_path):
    report = {
        "target": 0.88,
        "methods": [
            method("sync", "synchronous SGD", [0.8, 0.89], [30.0, 60.0], 300e6),
            method("skip", "skip+correction (interval 32)", [0.85, 0.9], [2, 4], 20e6),
            method(
                "overlap",
                "skip+correction, overlapped averages (interval 32)",
                [0.84, 0.88],
                [1.5, 3.0],
                20e6,
            ),
            method("nocomm", "no communication (bound)", [0.8, 0.9], [1, 2], 0),
        ],
        "peer": {
            "framework": "PyTorch",
            "methods": [
                method("torch-ddp", "DDP (synchronous)", [0.8], [33.0], 150e6),
                method(
                    "torch-post-local",
                    "PostLocalSGD, PeriodicModelAverager (period 32)",
                    [0.86, 0.89],
                    [3.0, 6.0],
                    10e6,
                ),
                method(
                    "torch-diloco",
                    "torchft streaming DiLoCo (2 fragments, delay 1, interval 32)",
                    [0.85, 0.88],
                    [3.0, 6.3],
                    10e6,
                ),
            ],
        },
    }
    rows = peer.peer_rows(report)
    assert [(r["framework"], r["method"][:8]) for r in rows] == [
        ("Keras", "synchron"),
        ("Keras", "skip+cor"),
        ("Keras", "skip+cor"),
        ("PyTorch", "DDP (syn"),
        ("PyTorch", "PostLoca"),
        ("PyTorch", "torchft "),
    ]
    ddp = rows[3]
    assert ddp["time_to_target"] is None and ddp["epochs_run"] == 1
    assert ddp["wire_mb_per_step"] == pytest.approx(15.0)  # 150 MB over 10 steps
    assert rows[1]["wire_mb_per_step"] == pytest.approx(1.0)
    found = peer.ratios(rows)
    assert found["best"] == {
        "keras_skip": "skip+correction, overlapped averages (interval 32)",
        "peer": "PostLocalSGD, PeriodicModelAverager (period 32)",
        "ratio": pytest.approx(2.0),
    }
    assert found["streaming"]["ratio"] == pytest.approx(2.1)
    text = peer.markdown_table(report)
    lines = text.splitlines()
    assert lines[0] == (
        "| framework | method | time to 0.88 | epochs | s / epoch | final accuracy "
        "| syncs | MB / step (wire) |"
    )
    assert "| PyTorch | DDP (synchronous) | not reached in 1 epochs | - |" in text
    assert "| Keras | skip+correction (interval 32) | 4.0 s | 2 | 2.00 | 0.9000 |" in (
        text
    )
    assert "reached the target 2.10x as fast as PyTorch's torchft streaming" in text
    # The docs' generator prints the same from the results file.
    path = tmp_path / "results.json"
    path.write_text(json.dumps(report))
    assert tables.render("peer", [path]) == text
    terminal = peer.text_table(report)
    assert "not reached in 1 epochs" in terminal and "PyTorch" in terminal
    # A peer that reached nothing: the ratio says so.
    for m in report["peer"]["methods"]:
        for e in m["epochs"]:
            e["val_accuracy"] = 0.5
    notes = peer.markdown_table(report)
    assert "no ratio, PyTorch did not reach the target" in notes


@pytest.mark.slow
def test_a_tiny_comparison_starts_both_frameworks_from_the_same_weights(tmp_path):
    pytest.importorskip("torch")
    pytest.importorskip("torchft")
    import keras

    from keras_skip.bench.workers import workloads

    lines = []
    args = harness.build_parser().parse_args(
        [
            *("--workers", "2", "--bandwidth", "none", "--hidden", "32"),
            *("--epochs", "1", "--interval", "8", "--methods", "sync", "overlap"),
            *("--peer", "torch", "--out", str(tmp_path)),
        ]
    )
    report = harness.run(args, print_fn=lines.append)
    output = "\n".join(lines)
    names = [(r["framework"], r["method"]) for r in report["peer_rows"]]
    assert names == [
        ("Keras", "synchronous SGD"),
        ("Keras", "skip+correction, overlapped averages (interval 8)"),
        ("PyTorch", "DDP (synchronous)"),
        ("PyTorch", "PostLocalSGD, PeriodicModelAverager (period 8)"),
        ("PyTorch", "torchft streaming DiLoCo (2 fragments, delay 1, interval 8)"),
    ]
    assert "framework  method" in output and "[torch diloco] epoch 1/1" in output
    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved["peer"]["versions"]["torch"].startswith("2.")
    assert saved["peer"]["arguments"][0] == "benchmarks/torch_peer.py"
    assert "--weights" not in saved["peer"]["arguments"]

    # The Keras workers' initial weights are the benchmark model's, and the
    # torch workers start from them: the same test loss and accuracy.
    weights = export.load_weights(tmp_path / "initial-weights.npz")
    for written, built in zip(weights, export.initial_weights([32], 0), strict=True):
        np.testing.assert_array_equal(written, built)
    model = workloads.mlp((32,))
    model.set_weights(weights)
    model.compile(loss=workloads.classification_loss(), metrics=["accuracy"])
    _, (x_test, y_test) = workloads.load_mnist_subset(0)
    loss, accuracy = model.evaluate(x_test, y_test, verbose=0, batch_size=1000)
    for m in saved["peer"]["methods"]:
        assert m["initial"]["val_loss"] == pytest.approx(loss, rel=1e-5), m["name"]
        assert m["initial"]["val_accuracy"] == pytest.approx(accuracy, abs=1e-6)

    # Synchronous DDP is plain SGD on the global batches: one epoch of it
    # ends where Keras' SGD on the same batches in one process ends.
    order = export.batch_order(4000, 2, 32, 1, seed=0)
    (x, y), _ = workloads.load_mnist_subset(0)
    model.compile(
        optimizer=keras.optimizers.SGD(0.05),
        loss=workloads.classification_loss(),
        metrics=["accuracy"],
    )
    for step in order[0]:
        rows = step.reshape(-1)
        model.train_on_batch(x[rows], y[rows])
    loss, _ = model.evaluate(x_test, y_test, verbose=0, batch_size=1000)
    ddp = next(m for m in saved["peer"]["methods"] if m["name"] == "torch-ddp")
    assert ddp["epochs"][0]["val_loss"] == pytest.approx(loss, rel=1e-4)


def test_the_benchmark_data_trains_in_one_order_however_many_iterators_open():
    """Keras' fit, under a strategy, takes a batch from a first iterator of
    the dataset to build the model and then opens another (keras-skip's
    optimizer under MultiWorkerMirroredStrategy does not): a dataset that
    reshuffles on each iteration would give synchronous SGD and keras-skip
    different epochs. The benchmark's dataset yields the same batches from
    every iterator, in the exported order."""
    import tensorflow as tf

    from keras_skip.bench.workers import worker, workloads

    config = dict(worker.DEFAULTS, epochs=2, batch_per_worker=32)
    (x, y), _, batch = worker._load_data(config, tf.distribute.get_strategy(), 1)
    data, steps = worker._dataset(config, x, y, 0, batch, batch)
    (raw, _), _ = workloads.load_mnist_subset(config["seed"])
    order = export.batch_order(len(raw), 1, batch, 2, seed=config["seed"])
    first, second = iter(data), iter(data)
    next(first)  # what fit takes to build the model
    for rows in order[:, :steps, 0].reshape(-1, batch):
        np.testing.assert_array_equal(next(second)[0].numpy(), raw[rows])
    np.testing.assert_array_equal(next(iter(data))[0].numpy(), raw[order[0, 0, 0]])
