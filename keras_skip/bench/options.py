"""The command line's value checks and the options ``demo`` and ``bench`` share.

Every check turns a bad value into argparse's usage error, naming the option,
the value and what is allowed, before the command creates anything (a
directory, a network namespace, a process).
"""

from __future__ import annotations

import argparse
import math

from keras_skip.bench import links


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows every option's default, once, after its help."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "%(default)" in text or action.default in (None, False, argparse.SUPPRESS):
            return text
        return super()._get_help_string(action)

    def _expand_help(self, action: argparse.Action) -> str:
        if isinstance(action.default, list):
            action = argparse.Action(
                action.option_strings,
                action.dest,
                default=" ".join(map(str, action.default)),
                help=action.help,
                choices=action.choices,
                metavar=action.metavar,
            )
        return super()._expand_help(action)


def _at_least(text: str, minimum: int) -> int:
    try:
        value = int(text)
    except ValueError:
        value = minimum - 1
    if value < minimum:
        raise argparse.ArgumentTypeError(
            f"must be an integer >= {minimum}, got {text!r}"
        )
    return value


def positive_int(text: str) -> int:
    return _at_least(text, 1)


def non_negative_int(text: str) -> int:
    return _at_least(text, 0)


def _number(text: str, allowed, what: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not allowed(value):  # NaN fails every comparison
        raise argparse.ArgumentTypeError(f"must be {what}, got {text!r}")
    return value


def positive_float(text: str) -> float:
    return _number(text, lambda v: v > 0, "a number > 0")


def fraction(text: str) -> float:
    """A momentum: a number in [0, 1)."""
    return _number(text, lambda v: 0 <= v < 1, "a number in [0, 1)")


def accuracy(text: str) -> float:
    """A target accuracy: a number in (0, 1]."""
    return _number(text, lambda v: 0 < v <= 1, "an accuracy in (0, 1], such as 0.88")


def bandwidth(text: str) -> str | None:
    try:
        return links.check_bandwidth(text)
    except ValueError as error:
        if "bytes per second" in str(error):
            reason = str(error).split(" Received:")[0].removeprefix("`bandwidth` ")
        else:
            reason = (
                "must be a positive tc rate in bits, such as '100mbit', '1gbit' "
                f"or '500kbit', or 'none' for no limit, got {text!r}"
            )
        raise argparse.ArgumentTypeError(reason) from error


def latency(text: str) -> str:
    try:
        return links.check_latency(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(
            "must be a non-negative duration with a unit (us, ms or s), such "
            f"as '25ms' or '0ms', got {text!r}"
        ) from error


def add_first_fit_options(
    parser: argparse.ArgumentParser, *, rounds: int, rounds_help: str, steps: int
) -> None:
    """The options the first-fit benchmarks share: replicas, paired rounds,
    steps of each fit and the file of the rows."""
    parser.add_argument(
        "--replicas",
        type=positive_int,
        default=4,
        help="logical CPU devices (default: %(default)s)",
    )
    parser.add_argument(
        "--rounds",
        type=positive_int,
        default=rounds,
        help=f"{rounds_help} (default: %(default)s)",
    )
    parser.add_argument(
        "--steps",
        type=positive_int,
        default=steps,
        help="steps of each first fit (default: %(default)s)",
    )
    parser.add_argument("--json", help="also write the rows to this file")


def add_link_options(
    parser: argparse.ArgumentParser, *, epochs: int, epochs_help: str
) -> None:
    """The options of the cluster and its links, the same in ``demo`` and
    ``bench``."""
    parser.add_argument(
        "--workers",
        type=positive_int,
        default=4,
        help="number of worker processes, one replica each",
    )
    parser.add_argument(
        "--bandwidth",
        type=bandwidth,
        default="100mbit",
        help="rate of every worker's link in each direction, in tc's bit "
        "units ('100mbit', '1gbit', '500kbit'), or 'none' for no limit",
    )
    parser.add_argument(
        "--latency",
        type=latency,
        default="0ms",
        help="one-way delay added to every worker's link, such as '25ms'",
    )
    parser.add_argument(
        "--links",
        choices=links.MECHANISMS,
        default="auto",
        help="how to emulate the links: 'tc' (network namespaces and tbf, "
        "needs root; latency by a relay), 'relay' (a user-space relay, no root "
        "needed), or 'auto': tc where possible",
    )
    parser.add_argument("--epochs", type=positive_int, default=epochs, help=epochs_help)
    parser.add_argument(
        "--out",
        default=None,
        help="directory for results.json and plots (default: a new "
        "temporary directory)",
    )
