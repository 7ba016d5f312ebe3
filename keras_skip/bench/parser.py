"""The options of ``keras-skip bench``, with their help texts and defaults."""

from __future__ import annotations

import argparse

from keras_skip.bench import options
from keras_skip.bench.methods import ALL_METHODS, DEFAULT_METHODS


def build_parser() -> argparse.ArgumentParser:
    """The parser of ``keras-skip bench``."""
    parser = argparse.ArgumentParser(
        prog="keras-skip bench",
        description="Time to accuracy of synchronous SGD, local SGD and "
        "skip+correction with real worker processes, optionally over emulated "
        "slow links.",
        formatter_class=options.HelpFormatter,
    )
    # The order of the calls is the order of the options in the help.
    options.add_link_options(parser, epochs=12, epochs_help="epoch budget per method")
    _add_training_options(parser)
    _add_interval_options(parser)
    _add_target_options(parser)
    _add_method_options(parser)
    _add_peer_options(parser)
    _add_run_options(parser)
    return parser


def _add_training_options(parser: argparse.ArgumentParser) -> None:
    """The workload and how every method trains on it."""
    add = parser.add_argument
    add(
        "--workload",
        choices=("mlp", "mlp-noniid", "cnn"),
        default="mlp",
        help="the MLP on MNIST, the same with label-sorted shards, or a small CNN",
    )
    add(
        "--hidden",
        type=options.positive_int,
        nargs="+",
        default=[1024, 1024],
        help="hidden layer sizes of the MLP workloads",
    )
    add(
        "--batch-per-worker",
        type=options.positive_int,
        default=32,
        help="batch size of each worker (the global batch is this times --workers)",
    )
    add(
        "--learning-rate",
        type=options.positive_float,
        default=0.05,
        help="SGD learning rate of every method",
    )


def _add_interval_options(parser: argparse.ArgumentParser) -> None:
    """The averaging interval of the fixed and the adaptive methods."""
    add = parser.add_argument
    add(
        "--interval",
        type=options.positive_int,
        default=32,
        help="interval of the fixed-interval methods and AdaComm's start",
    )
    add(
        "--target-ratios",
        type=options.positive_float,
        nargs="+",
        default=[1.0],
        help="the adaptive method's communication/computation ratios per "
        "epoch, one run each",
    )
    add(
        "--max-interval",
        type=options.positive_int,
        default=64,
        help="largest interval the adaptive methods may choose",
    )


def _add_target_options(parser: argparse.ArgumentParser) -> None:
    """The validation accuracy the methods race to."""
    add = parser.add_argument
    add(
        "--target",
        type=options.accuracy,
        default=None,
        help="validation accuracy to reach (default: what synchronous SGD "
        "reaches after the epoch budget)",
    )
    add(
        "--stop-at-target",
        action="store_true",
        help="stop each method once it reaches --target",
    )


def _add_method_options(parser: argparse.ArgumentParser) -> None:
    """Which methods run, and the settings of those that need some."""
    add = parser.add_argument
    add(
        "--methods",
        nargs="+",
        choices=ALL_METHODS,
        default=list(DEFAULT_METHODS),
        metavar="METHOD",
        help=f"methods to run, in order, among: {', '.join(ALL_METHODS)}",
    )
    add(
        "--outer-learning-rate",
        type=options.positive_float,
        default=0.7,
        help="learning rate of method outer's Nesterov SGD outer optimizer",
    )
    add(
        "--compression",
        choices=("bfloat16", "float16"),
        default="bfloat16",
        help="wire type of the methods with compress",
    )
    add(
        "--overlap-steps",
        type=options.positive_int,
        default=1,
        help="local steps the methods with overlap let an average's "
        "all-reduce run beside (SkipCorrectionOptimizer's overlap): 1 is "
        "the step it is due after, more delays it (needs an interval longer)",
    )
    add(
        "--fragments",
        type=options.positive_int,
        default=2,
        help="fragments of the methods with stream (streaming averages, "
        "SkipCorrectionOptimizer's fragments): each averaged on its own, "
        "staggered over the interval; with overlap, --overlap-steps must "
        "be at least 2",
    )
    add(
        "--outer-momentum",
        type=options.fraction,
        default=0.9,
        help="momentum of method outer's outer optimizer",
    )
    add(
        "--nocomm-epochs",
        type=options.positive_int,
        default=3,
        help="epochs of the no-communication run (its epoch time is steady)",
    )
    add(
        "--measure-drift",
        action="store_true",
        help="measure the replicas' drift at every average (one more small "
        "all-reduce per average) and plot it",
    )


#: Frameworks ``--peer`` runs after the Keras methods, on the same links.
PEERS = ("torch",)


def _add_peer_options(parser: argparse.ArgumentParser) -> None:
    """Another framework run after the Keras methods, on the same links."""
    add = parser.add_argument
    add(
        "--peer",
        choices=PEERS,
        default=None,
        help="after the Keras methods, run PyTorch's DDP, PostLocalSGD "
        "(period --interval) and torchft's streaming DiLoCo on the same "
        "links, data, shards, batch, learning rate and initial weights "
        '(benchmarks/torch_peer.py, needs `pip install -e ".[peer]"`), and '
        "print one table of both frameworks",
    )
    add(
        "--peer-sync-epochs",
        type=options.positive_int,
        default=None,
        help="epoch budget of the peer's synchronous DDP (default: --epochs)",
    )
    add(
        "--peer-time-budget",
        type=options.positive_float,
        default=None,
        help="seconds of training after which each peer method stops at the "
        "end of its epoch",
    )
    add(
        "--peer-fragments",
        type=options.positive_int,
        default=2,
        help="fragments of the peer's streaming DiLoCo (by layer; --interval "
        "must be divisible by it)",
    )
    add(
        "--peer-sync-delay",
        type=int,
        default=1,
        help="steps each DiLoCo fragment's all-reduce runs beside the training "
        "before it is needed (torchft's fragment_sync_delay)",
    )


def _add_run_options(parser: argparse.ArgumentParser) -> None:
    """Time limit, the quick run and the seed."""
    add = parser.add_argument
    add(
        "--timeout",
        type=options.positive_float,
        default=3600,
        help="seconds after which a method's workers are killed",
    )
    add(
        "--quick",
        action="store_true",
        help="a small run on loopback (2 workers, a small MLP, 2 epochs)",
    )
    add("--seed", type=int, default=0, help="seed of the data split and the weights")
    add(
        "--trace",
        default=None,
        metavar="DIR",
        help="write a trace of every worker of every method, "
        "DIR/<method>/worker-<i>.json (Chrome trace-event format: steps, "
        "averages, delayed averages' all-reduces, waits and landings), and "
        "sum each up in results.json",
    )
