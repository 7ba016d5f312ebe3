"""The README's main job: `keras-skip demo`."""

import subprocess
import sys

import pytest

from keras_skip import cli, demo


def test_demo_trains_all_three_methods_and_prints_the_table(capsys):
    results = demo.run(epochs=1, replicas=2, interval=8, verbose=0)
    out = capsys.readouterr().out
    assert [r.method for r in results] == [
        "synchronous SGD",
        "local SGD (interval 8, no correction)",
        "skip+correction (interval 8)",
    ]
    steps = -(-4000 // 64)
    assert results[0].synchronizations == steps
    # Every 8 local steps, plus the boundary average at the end of the epoch.
    assert results[1].synchronizations == results[2].synchronizations == steps // 8 + 1
    for r in results:
        assert r.val_accuracy > 0.6, r
        assert r.method in out
    assert "val accuracy" in out and "synchronizations" in out


def test_command_line_runs_the_demo():
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "keras_skip",
            "demo",
            "--epochs",
            "1",
            "--replicas",
            "2",
            "--quiet",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "skip+correction (interval 8)" in result.stdout


@pytest.mark.parametrize(
    "argv", [["demo", "--epochs", "0"], ["demo", "--interval", "x"], []]
)
def test_command_line_rejects_bad_arguments(argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(argv)
    assert exit_info.value.code == 2
    assert "usage: keras-skip" in capsys.readouterr().err


def test_format_table_aligns_columns():
    table = demo.format_table(
        [
            demo.DemoResult("a", 1.0, 10, 2.0, 0.5),
            demo.DemoResult("longer name", 12.25, 3, 0.6, 0.75),
        ]
    )
    lines = table.splitlines()
    assert len({len(line.rstrip()) for line in lines[:2]}) == 1
    assert "12.2 s" in table and "0.7500" in table
