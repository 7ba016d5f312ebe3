"""The README's main job: `keras-skip demo`."""

import subprocess
import sys

import pytest

from keras_skip import cli, demo


@pytest.mark.slow
def test_command_line_runs_the_demo(tmp_path):
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "keras_skip",
            "demo",
            "--workers",
            "2",
            "--bandwidth",
            "none",
            "--epochs",
            "2",
            "--out",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout
    assert "2 workers, loopback" in out
    for method in ("synchronous SGD", "skip+correction, adaptive", "no communication"):
        assert method in out
    assert "Over loopback, skip+correction reached" in out or "did not reach" in out
    assert (tmp_path / "results.json").exists()


def test_demo_arguments_are_a_small_harness_run():
    args = demo.arguments(workers=3, bandwidth="1gbit", epochs=2)
    assert (args.workers, args.bandwidth, args.epochs) == (3, "1gbit", 2)
    assert args.methods == ["sync", "adaptive", "nocomm"]
    assert args.hidden == [512, 512]
    assert args.target == demo.TARGET


@pytest.mark.parametrize(
    "argv", [["demo", "--epochs", "0"], ["demo", "--workers", "x"], []]
)
def test_command_line_rejects_bad_arguments(argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(argv)
    assert exit_info.value.code == 2
    assert "usage: keras-skip" in capsys.readouterr().err


def test_bench_help_is_reachable_from_the_command_line(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["bench", "--help"])
    assert exit_info.value.code == 0
    assert "--bandwidth" in capsys.readouterr().out
