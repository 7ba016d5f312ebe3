"""The ``keras-skip`` command line explains itself: a version, help with the
default of every option, and usage errors that name the option, the value and
what is allowed, before anything is created."""

import argparse

import pytest

import keras_skip
from keras_skip import cli
from keras_skip.bench import harness


def subparser(name: str) -> argparse.ArgumentParser:
    if name == "bench":
        return harness.build_parser()
    commands = next(
        a
        for a in cli.build_parser()._actions
        if isinstance(a, argparse._SubParsersAction)
    )
    return commands.choices[name]


def test_version(capsys):
    with pytest.raises(SystemExit) as stop:
        cli.main(["--version"])
    assert stop.value.code == 0
    assert capsys.readouterr().out.strip() == f"keras-skip {keras_skip.__version__}"


@pytest.mark.parametrize("command", ["demo", "bench", "plan"])
def test_every_option_has_help_that_shows_its_default(command):
    parser = subparser(command)
    text = parser.format_help()
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        assert action.help, f"{command} {action.option_strings} has no help"
        if action.default not in (None, False):
            option = action.option_strings[0]
            section = text.split("options:\n", 1)[1]
            entry = section.split(f"\n  {option}", 1)[1].split("\n  -", 1)[0]
            shown = (
                " ".join(map(str, action.default))
                if isinstance(action.default, list)
                else str(action.default)
            )
            assert f"(default: {shown})" in " ".join(entry.split()), (
                command,
                option,
                entry,
            )


def test_demo_shares_the_bench_link_options():
    def options(parser):
        return {
            a.option_strings[0]: (a.default, a.help, a.choices)
            for a in parser._actions
            if a.option_strings and a.dest not in ("help", "epochs")
        }

    demo, bench = options(subparser("demo")), options(subparser("bench"))
    assert demo.keys() == {"--workers", "--bandwidth", "--latency", "--links", "--out"}
    assert {name: bench[name] for name in demo} == demo


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            ["demo", "--workers", "four"],
            "--workers: must be an integer >= 1, got 'four'",
        ),
        (["demo", "--epochs", "0"], "--epochs: must be an integer >= 1, got '0'"),
        (
            ["demo", "--bandwidth", "100mbps"],
            "--bandwidth: '100mbps' is in bytes per second as tc reads it "
            "(800 Mbit/s); write the rate in bits, such as '800mbit'",
        ),
        (["bench", "--bandwidth", "12.5MBps"], "(100 Mbit/s)"),
        (["bench", "--bandwidth", "fast"], "must be a positive tc rate in bits"),
        (["bench", "--target", "88"], "--target: must be an accuracy in (0, 1]"),
        (["bench", "--methods", "fastest"], "--methods: invalid choice: 'fastest'"),
        (["launch"], "invalid choice: 'launch'"),
    ],
)
def test_bad_values_are_usage_errors_naming_option_and_value(argv, message, capsys):
    made = []
    original = harness.tempfile.mkdtemp
    harness.tempfile.mkdtemp = lambda **kwargs: made.append(kwargs) or "x"
    try:
        with pytest.raises(SystemExit) as stop:
            cli.main(argv)
    finally:
        harness.tempfile.mkdtemp = original
    assert stop.value.code == 2
    assert message in " ".join(capsys.readouterr().err.split())
    assert made == []


def test_rates_in_bits_are_taken_as_written():
    args = harness.build_parser().parse_args(["--bandwidth", "1Gbit"])
    assert args.bandwidth == "1gbit"
    assert harness.build_parser().parse_args(["--bandwidth", "none"]).bandwidth is None
