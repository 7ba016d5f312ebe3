"""Can an average travel while several local steps compute, on these links?

    python benchmarks/overlap_span.py [--workers 2] [--bandwidth 100mbit]
        [--latency 0ms] [--links auto] [--steps 32] [--rounds 6] [--json F]

Starts ``--workers`` processes of `MultiWorkerMirroredStrategy` over the
links ``keras-skip bench`` emulates (as root, network namespaces and ``tc``;
otherwise a user-space relay), one TensorFlow thread each. Each worker
times, round after round: ``--steps`` local training steps of the
benchmark's MLP (784-1024-1024-10, batch 32, no communication); one
all-reduce of as many float32 values as that MLP has weights (1,863,690),
as one average sends; the two one after the other; and the two together,
the all-reduce running from a second thread while the steps compute. It
prints each worker's medians and the share of the shorter of the two that
running them together hid: ``(steps + all-reduce - together) / min(steps,
all-reduce)``; one after the other is there to check that the parts add up.

``SkipCorrectionOptimizer(overlap=True)`` runs an average alongside one
step only; this measures what an average spread over ``--steps`` steps could
hide where you train.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import sys
import tempfile
import threading
import time

WEIGHTS = 784 * 1024 + 1024 + 1024 * 1024 + 1024 + 1024 * 10 + 10


def worker(steps: int, rounds: int) -> dict:
    """One worker's medians, in seconds: steps, all-reduce, both one after
    the other, both together; the share hidden; and every round's times
    (``rounds``), from which the medians come."""
    import tensorflow as tf

    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    with strategy.scope():
        payload = tf.Variable(tf.ones([WEIGHTS]))
    layers = [
        tf.Variable(tf.random.normal(shape, stddev=0.03))
        for shape in ((784, 1024), (1024, 1024), (1024, 10))
    ]
    x = tf.random.normal([32, 784])
    y = tf.random.uniform([32], 0, 10, dtype=tf.int32)

    @tf.function
    def step():
        with tf.GradientTape() as tape:
            h = x
            for w in layers[:-1]:
                h = tf.nn.relu(h @ w)
            loss = tf.reduce_mean(
                tf.nn.sparse_softmax_cross_entropy_with_logits(y, h @ layers[-1])
            )
        for w, g in zip(layers, tape.gradient(loss, layers), strict=True):
            w.assign_sub(0.01 * g)

    @tf.function
    def all_reduce():
        def mean():
            context = tf.distribute.get_replica_context()
            return context.all_reduce("MEAN", tf.identity(payload))

        return strategy.run(mean)

    def local_steps():
        for _ in range(steps):
            step()

    def sequential():
        local_steps()
        all_reduce()

    def together():
        background = threading.Thread(target=all_reduce)
        background.start()
        local_steps()
        background.join()

    cases = {
        "steps": local_steps,
        "all_reduce": all_reduce,
        "sequential": sequential,
        "together": together,
    }
    for run in cases.values():
        run()  # traced, and the links warmed, before timing
    times = {name: [] for name in cases}
    for _ in range(rounds):
        for name, run in cases.items():
            start = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - start)
    medians = {name: statistics.median(values) for name, values in times.items()}
    shorter = min(medians["steps"], medians["all_reduce"])
    apart = medians["steps"] + medians["all_reduce"]
    medians["hidden"] = (apart - medians["together"]) / shorter
    medians["rounds"] = times
    return medians


def main(argv: list[str] | None = None) -> int:
    from keras_skip.bench import links, options
    from keras_skip.bench.workers import launcher

    parser = argparse.ArgumentParser(
        description=__doc__.split("\n")[0], formatter_class=options.HelpFormatter
    )
    parser.add_argument(
        "--workers", type=options.positive_int, default=2, help="worker processes"
    )
    parser.add_argument(
        "--bandwidth",
        type=options.bandwidth,
        default="100mbit",
        help="rate of every worker's link, in tc's bit units, or 'none'",
    )
    parser.add_argument(
        "--latency", type=options.latency, default="0ms", help="one-way delay"
    )
    parser.add_argument("--links", choices=links.MECHANISMS, default="auto")
    parser.add_argument(
        "--steps", type=options.positive_int, default=32, help="local steps per round"
    )
    parser.add_argument(
        "--rounds", type=options.positive_int, default=6, help="timed rounds"
    )
    parser.add_argument("--json", type=pathlib.Path, help="also write the results here")
    args = parser.parse_args(argv)
    try:
        mechanism, note = links.choose(args.bandwidth, args.latency, args.links)
    except RuntimeError as error:
        parser.error(str(error))
    if note:
        print(note, flush=True)
    command = [sys.executable, __file__, "--steps", str(args.steps)]
    command += ["--rounds", str(args.rounds)]
    log_dir = pathlib.Path(tempfile.mkdtemp(prefix="keras-skip-overlap-span-"))
    env = {"KERAS_SKIP_OVERLAP_SPAN_WORKER": "1"}
    if mechanism is None:
        described = "loopback, no emulated link"
        result = launcher.launch(command, args.workers, log_dir=log_dir, env=env)
    else:
        with links.SlowLinks(
            args.workers, args.bandwidth, args.latency, mechanism
        ) as slow:
            described = slow.describe()
            result = launcher.launch(
                command,
                args.workers,
                log_dir=log_dir,
                env=env,
                **slow.launch_arguments(),
            )
    if not result.ok:
        print(result.failure_report(), file=sys.stderr)
        return 1
    rows = [
        json.loads(line.split(" ", 1)[1])
        for w in result.workers
        for line in w.log.splitlines()
        if line.startswith("MEDIANS ")
    ]
    print(f"{args.workers} workers, {described}; medians of {args.rounds} rounds:")
    print(
        f"{'worker':<8}{f'{args.steps} steps':>12}{'all-reduce':>12}"
        f"{'in turn':>10}{'together':>10}{'hidden':>8}"
    )
    for i, r in enumerate(rows):
        print(
            f"{i:<8}{r['steps']:>11.3f}s{r['all_reduce']:>11.3f}s"
            f"{r['sequential']:>9.3f}s{r['together']:>9.3f}s{r['hidden']:>8.0%}"
        )
    if args.json:
        arguments = {k: v for k, v in vars(args).items() if k != "json"}
        summary = {"arguments": arguments, "links": described, "workers": rows}
        args.json.write_text(json.dumps(summary, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    if os.environ.get("KERAS_SKIP_OVERLAP_SPAN_WORKER"):
        flags = argparse.ArgumentParser()
        flags.add_argument("--steps", type=int)
        flags.add_argument("--rounds", type=int)
        given = flags.parse_args()
        medians = worker(given.steps, given.rounds)
        print("MEDIANS " + json.dumps(medians), flush=True)
    else:
        sys.exit(main())
