"""The ``keras-skip`` command line."""

from __future__ import annotations

import argparse


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
        help="synchronous SGD against skip+correction on 4 CPU replicas",
    )
    demo.add_argument("--epochs", type=_positive, default=5)
    demo.add_argument("--replicas", type=_positive, default=4)
    demo.add_argument("--interval", type=_positive, default=8)
    demo.add_argument("--batch-per-replica", type=_positive, default=32)
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--quiet", action="store_true", help="no progress bars")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "demo":
        from keras_skip import demo

        demo.run(
            epochs=args.epochs,
            replicas=args.replicas,
            interval=args.interval,
            batch_per_replica=args.batch_per_replica,
            verbose=0 if args.quiet else 1,
            seed=args.seed,
        )
    return 0
