"""``keras-skip plan``: predicted epoch time of synchronous SGD and keras-skip.

Without ``--probe`` it needs no TensorFlow (unless ``--model`` names a saved
model to count its parameters): the model of time is
:mod:`keras_skip.planner`. With ``--probe`` it runs as one process of a
``TF_CONFIG`` cluster, like training, and measures the step time of the
saved model and the links' cost with a few all-reduces
(:mod:`keras_skip.plan_probe`) before predicting.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
from collections.abc import Callable

from keras_skip import planner


def _argument_type(check: Callable[[str], float]) -> Callable[[str], str]:
    def parse(text: str) -> str:
        try:
            check(text)
        except ValueError as error:
            reason = str(error).split(" Received:")[0].split("` ", 1)[-1]
            raise argparse.ArgumentTypeError(
                f"{reason.rstrip('.')}, got {text!r}"
            ) from error
        return text

    return parse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from keras_skip.bench import options

    model = parser.add_argument_group("the model")
    source = model.add_mutually_exclusive_group()
    source.add_argument(
        "--model", help="a saved .keras model: its trainable values are counted"
    )
    source.add_argument(
        "--params", type=options.positive_int, help="number of trainable values"
    )
    model.add_argument(
        "--step-time",
        type=options.positive_float,
        help="seconds of one training step on one worker, without communication "
        "(measured with --probe)",
    )
    model.add_argument(
        "--steps-per-epoch",
        type=options.positive_int,
        default=1000,
        help="training steps each worker takes in an epoch",
    )
    model.add_argument(
        "--batch-size",
        type=options.positive_int,
        default=32,
        help="with --probe: examples per replica in the timed steps",
    )
    cluster = parser.add_argument_group("the cluster")
    cluster.add_argument(
        "--workers",
        type=options.positive_int,
        help="worker processes (hosts); with --probe, default: the cluster's",
    )
    cluster.add_argument(
        "--devices-per-worker",
        type=options.positive_int,
        default=1,
        help="replicas on each worker; they reduce among themselves at no cost "
        "in the model, and --step-time is the worker's step over all of them",
    )
    cluster.add_argument(
        "--bandwidth",
        type=_argument_type(planner.bandwidth_bytes),
        help="each worker's link rate, in bits: '100mbit', '10gbit'",
    )
    cluster.add_argument(
        "--latency",
        type=_argument_type(planner.latency_seconds),
        default="0.1ms",
        help="one-way latency between workers: '50us', '10ms'",
    )
    cluster.add_argument(
        "--probe",
        action="store_true",
        help="measure the step time, bandwidth and per-step cost of an "
        "all-reduce on the running TF_CONFIG cluster (run on every worker)",
    )
    cluster.add_argument(
        "--probe-bytes",
        type=options.positive_int,
        default=16 * 2**20,
        help="with --probe: bytes of the larger of the two timed all-reduces",
    )
    skip = parser.add_argument_group("keras-skip's options")
    skip.add_argument(
        "--interval",
        type=options.positive_int,
        help="local steps between averages (default: the adaptive callback's choice)",
    )
    skip.add_argument(
        "--compression",
        choices=("none", "bfloat16", "float16"),
        default="none",
        help="the type of the averages' payload",
    )
    skip.add_argument(
        "--slot-copies",
        type=int,
        default=0,
        help="the inner optimizer's slots each average sends, in copies of the "
        "model: 0 with optimizer_state='local' (default), 1 with Adam's "
        "second moments ('average_second_moments'), 2 with all of Adam's "
        "slots ('average')",
    )
    skip.add_argument(
        "--overlap",
        type=int,
        default=0,
        help="local steps an average runs beside (the optimizer's overlap=k)",
    )
    skip.add_argument(
        "--fragments",
        type=options.positive_int,
        default=1,
        help="fragments averaged on their own schedules (the optimizer's fragments)",
    )
    skip.add_argument(
        "--boundary",
        choices=("full", "latest"),
        default="full",
        help="what ends an epoch (the optimizer's boundary): a full average, or "
        "none (the latest averages are shown)",
    )
    skip.add_argument(
        "--target-ratio",
        type=options.positive_float,
        default=1.0,
        help="the adaptive callback's communication to computation ratio",
    )
    skip.add_argument(
        "--max-interval",
        type=options.positive_int,
        default=64,
        help="the adaptive callback's largest interval",
    )
    constants = parser.add_argument_group(
        "the model of time's constants (docs: 'What to expect'); with --probe, "
        "the link's are measured instead"
    )
    constants.add_argument(
        "--link-efficiency",
        type=float,
        default=planner.LINK_EFFICIENCY,
        help="share of the bandwidth an all-reduce's payload gets",
    )
    constants.add_argument(
        "--round-trips",
        type=float,
        default=planner.ROUND_TRIPS_PER_STEP,
        help="round trips each step of the ring all-reduce waits for",
    )
    constants.add_argument(
        "--step-overhead",
        type=float,
        default=planner.STEP_OVERHEAD,
        help="the hosts' seconds per step of the ring all-reduce",
    )
    constants.add_argument(
        "--overlap-share",
        type=float,
        default=planner.OVERLAP_SHARE,
        help="share of an overlapped average's wire time the steps beside it hide",
    )
    parser.add_argument("--json", action="store_true", help="print JSON, not a table")


def run(
    args: argparse.Namespace,
    parser: argparse.ArgumentParser,
    print_fn: Callable[[str], None] = print,
) -> dict:
    """Predicts, prints the table (or JSON) and returns the plan as a dict."""
    if args.model is None and args.params is None:
        parser.error("give the model: --model PATH.keras or --params N")
    if args.overlap < 0:
        parser.error(f"argument --overlap: must be an integer >= 0, got {args.overlap}")
    if args.slot_copies < 0:
        parser.error(
            f"argument --slot-copies: must be an integer >= 0, got {args.slot_copies}"
        )
    measured = None
    if args.probe:
        if args.model is None:
            parser.error("--probe times the model's steps: give --model PATH.keras")
        measured = _probe(args)
        link = measured.link
        step_time = args.step_time or measured.step_time
        workers = args.workers or measured.workers
        params = _count_params(args.model)
    else:
        missing = [
            flag
            for flag, value in (
                ("--workers", args.workers),
                ("--bandwidth", args.bandwidth),
                ("--step-time", args.step_time),
            )
            if value is None
        ]
        if missing:
            parser.error(
                f"without --probe, give {', '.join(missing)} (or measure them "
                "with --probe on the cluster)"
            )
        try:
            link = planner.Link.from_text(
                args.bandwidth,
                args.latency,
                efficiency=args.link_efficiency,
                round_trips=args.round_trips,
                step_overhead=args.step_overhead,
            )
        except ValueError as error:
            parser.error(str(error))
        step_time, workers = args.step_time, args.workers
        params = args.params or _count_params(args.model)
    try:
        workload = planner.Workload(params, step_time, args.steps_per_epoch)
        result = planner.plan(
            workload,
            workers,
            link,
            interval=args.interval,
            compression=None if args.compression == "none" else args.compression,
            slot_copies=args.slot_copies,
            overlap=args.overlap,
            fragments=args.fragments,
            boundary=args.boundary,
            overlap_share=args.overlap_share,
            target_ratio=args.target_ratio,
            max_interval=args.max_interval,
        )
    except ValueError as error:
        parser.error(str(error))
    report = _report(result, args, measured)
    print_fn(json.dumps(report, indent=2) if args.json else format_report(report))
    return report


def _count_params(path: str) -> int:
    import keras

    model = keras.saving.load_model(path, compile=False)
    return int(sum(math.prod(v.shape) for v in model.trainable_weights))


def _probe(args: argparse.Namespace):
    from keras_skip import multi_worker, plan_probe

    strategy = multi_worker.multi_worker_strategy()
    import keras

    with strategy.scope():
        model = keras.saving.load_model(args.model, compile=False)
        model.compile(optimizer=keras.optimizers.SGD(0.0), loss="mse")
    return plan_probe.measure(
        strategy, model, batch_size=args.batch_size, large_bytes=args.probe_bytes
    )


def _report(result: planner.Plan, args: argparse.Namespace, measured) -> dict:
    link = result.link
    return {
        "workers": result.workers,
        "devices_per_worker": args.devices_per_worker,
        "link": dataclasses.asdict(link),
        "link_text": (
            "measured by --probe"
            if measured is not None
            else f"{args.bandwidth}, {args.latency} one way"
        ),
        "workload": dataclasses.asdict(result.workload),
        "adaptive": args.interval is None,
        "fragments": args.fragments,
        "boundary": args.boundary,
        "synchronous": dataclasses.asdict(result.synchronous),
        "skip": dataclasses.asdict(result.skip),
        "speedup": result.speedup,
        "probe": None if measured is None else dataclasses.asdict(measured),
    }


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def _ending(report: dict) -> str:
    """How the epoch ends, for the report's last line."""
    skip = report["skip"]
    steps = report["workload"]["steps_per_epoch"]
    if report["boundary"] == "latest" and steps >= skip["interval"]:
        return ", none at the epoch's end: it shows the latest averages"
    return ", the last at the epoch's end"


def _megabytes(nbytes: float) -> str:
    return f"{nbytes / 1e6:,.2f} MB"


def format_report(report: dict) -> str:
    """The plan as a table with its inputs."""
    w = report["workload"]
    skip = report["skip"]
    how = "adaptive" if report["adaptive"] else "fixed"
    rows = [
        ("synchronous SGD", report["synchronous"]),
        (f"keras-skip ({how} interval)", skip),
    ]
    lines = [
        f"{_count(report['workers'], 'worker')} x "
        f"{_count(report['devices_per_worker'], 'device')}, "
        f"links {report['link_text']}; {w['params']:,} trainable values, "
        f"{w['step_time']:.4g} s a step, {w['steps_per_epoch']} steps an epoch",
        "",
        f"{'':30} {'interval':>8} {'epoch s':>10} {'compute s':>10} "
        f"{'comm s':>10} {'hidden s':>9} {'sent/step':>12} {'speed-up':>9}",
    ]
    sync_seconds = report["synchronous"]["epoch_seconds"]
    for label, p in rows:
        lines.append(
            f"{label:30} {p['interval']:>8} {p['epoch_seconds']:>10.4g} "
            f"{p['compute_seconds']:>10.4g} {p['communication_seconds']:>10.4g} "
            f"{p['hidden_seconds']:>9.3g} {_megabytes(p['bytes_per_step']):>12} "
            f"{sync_seconds / p['epoch_seconds']:>8.2f}x"
        )
    gradients = report["synchronous"]["all_reduce_seconds"]
    lines += [
        "",
        f"One all-reduce of the gradients: {gradients:.4g} s; one average: "
        f"{skip['all_reduce_seconds']:.4g} s ({skip['all_reduces_per_epoch']:.4g} "
        f"an epoch{_ending(report)}).",
    ]
    return "\n".join(lines)
