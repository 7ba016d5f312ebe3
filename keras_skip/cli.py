"""The ``keras-skip`` command line."""

from __future__ import annotations

import argparse
import signal
import sys


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="keras-skip",
        description="Data-parallel Keras training that skips most synchronizations.",
    )
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser(
        "demo",
        help="synchronous SGD against skip+correction with 4 worker processes, "
        "over emulated 100 Mbit/s links (2-4 minutes)",
    )
    demo.add_argument("--workers", type=_positive, default=4)
    from keras_skip.bench import harness

    demo.add_argument(
        "--bandwidth",
        type=harness._bandwidth,
        default="100mbit",
        help="every worker's link (tc rate), or 'none' for no limit "
        "(default: %(default)s)",
    )
    demo.add_argument(
        "--latency",
        type=harness._latency,
        default="0ms",
        help="one-way delay added to every worker's link, such as '25ms' "
        "(default: %(default)s)",
    )
    demo.add_argument("--epochs", type=_positive, default=3)
    demo.add_argument("--out", help="directory for results.json and plots")
    commands.add_parser(
        "bench",
        add_help=False,
        help="time to accuracy over emulated slow links (`keras-skip bench --help`)",
    )
    return parser


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:

    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] == "bench":
        from keras_skip.bench import harness

        return harness.main(argv[1:])
    args = build_parser().parse_args(argv)
    if args.command == "demo":
        from keras_skip import demo

        signal.signal(signal.SIGTERM, _interrupt)
        try:
            demo.run(
                workers=args.workers,
                bandwidth=args.bandwidth,
                epochs=args.epochs,
                out=args.out,
                latency=args.latency,
            )
        except KeyboardInterrupt:
            print(
                "Interrupted; every worker process and network namespace was removed."
            )
            return 130
    return 0
