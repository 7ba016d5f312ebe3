"""PyTorch on the benchmark's links: the peer ``keras-skip bench --peer torch`` runs.

    pip install -e ".[peer]"
    python benchmarks/torch_peer.py [--workers 4] [--bandwidth 100mbit]
        [--links auto] [--epochs 12] [--hidden 1024 1024]
        [--batch-per-worker 32] [--learning-rate 0.05] [--interval 32]
        [--methods ddp post-local diloco] [--fragments 2] [--sync-delay 1]
        [--target 0.88] [--stop-at-target] [--json F]

Starts ``--workers`` PyTorch processes (gloo, one thread each) per method,
with the benchmark's launcher and over the links ``keras-skip bench``
emulates (as root, one network namespace per worker behind a ``tbf`` rate
limit; no latency: PyTorch's peers connect on ports chosen at run time,
which the latency relay cannot know). The workers train the benchmark's MLP
on the same MNIST subset, from the same initial weights (the Keras model's,
its kernels transposed into ``Linear`` weights), on the same batches of the
same shards (:mod:`keras_skip.bench.workers.export`), with plain SGD at the
same learning rate:

- ``ddp``: synchronous ``DistributedDataParallel``;
- ``post-local``: ``PostLocalSGDOptimizer`` with a ``PeriodicModelAverager``
  of period ``--interval`` (no synchronous warm-up, as keras-skip's local
  SGD);
- ``diloco``: torchft's streaming DiLoCo: the model in ``--fragments``
  fragments by layer, each averaged once per ``--interval`` steps at its own
  offset, its all-reduce started ``--sync-delay`` steps before it is needed,
  and an outer Nesterov SGD (``--outer-learning-rate``,
  ``--outer-momentum``), each worker a replica group of its own under one
  ``torchft_lighthouse``.

After every epoch, every worker evaluates the mean of the workers' models on
the test set (one all-reduce; the models of ``ddp`` are equal already);
that time and the bytes it sends are left out of the measurements, as
validation is left out of the Keras methods'. Each method's result has the
layout of ``keras_skip.bench.reports.results.MethodResult``; ``--json``
writes them all.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import time

METHODS = ("ddp", "post-local", "diloco")
#: Bytes a worker's link has sent, read in the worker's own namespace.
TX_BYTES = "/sys/class/net/eth0/statistics/tx_bytes"
WORKER_FLAG = "KERAS_SKIP_TORCH_PEER_WORKER"


# The workers: PyTorch only (and NumPy), no TensorFlow.


def torch_linear_weights(keras_weights):
    """``[weight_0, bias_0, ...]`` of ``Linear`` layers from Keras ``Dense``
    weights ``[kernel_0, bias_0, ...]``: a kernel is ``(inputs, outputs)``, a
    ``Linear`` weight ``(outputs, inputs)``."""
    import numpy as np

    return [
        np.ascontiguousarray(w.T) if i % 2 == 0 else np.asarray(w)
        for i, w in enumerate(keras_weights)
    ]


def torch_mlp(keras_weights):
    """The benchmark's MLP as a ``torch.nn.Sequential`` holding ``keras_weights``."""
    import torch

    weights = torch_linear_weights(keras_weights)
    layers = []
    for i in range(0, len(weights), 2):
        outputs, inputs = weights[i].shape
        linear = torch.nn.Linear(inputs, outputs)
        with torch.no_grad():
            linear.weight.copy_(torch.from_numpy(weights[i]))
            linear.bias.copy_(torch.from_numpy(weights[i + 1]))
        layers.append(linear)
        if i + 2 < len(weights):
            layers.append(torch.nn.ReLU())
    return torch.nn.Sequential(*layers)


def evaluate(model, x, y) -> tuple[float, float]:
    """``(accuracy, mean cross-entropy)`` of ``model`` on ``x``, ``y``."""
    import torch

    with torch.no_grad():
        logits = model(x)
        loss = torch.nn.functional.cross_entropy(logits, y).item()
        accuracy = (logits.argmax(dim=1) == y).float().mean().item()
    return accuracy, loss


def fragments_of(model, count: int):
    """``count`` contiguous groups of ``model``'s layers (``Linear`` with the
    activation after it), as even in parameters as the layers allow."""
    import torch

    groups, current = [], []
    for layer in model:
        if isinstance(layer, torch.nn.Linear) and current:
            groups.append(current)
            current = []
        current.append(layer)
    groups.append(current)
    if not 1 <= count <= len(groups):
        raise ValueError(
            f"`fragments` must be between 1 and the {len(groups)} layers of the "
            f"model. Received: fragments={count}"
        )
    sizes = [sum(p.numel() for m in g for p in m.parameters()) for g in groups]
    total, bounds, running = sum(sizes), [], 0
    for i, size in enumerate(sizes[:-1]):
        running += size
        left = len(groups) - i - 1
        if len(bounds) < count - 1 and (
            running >= total * (len(bounds) + 1) / count
            or left == count - 1 - len(bounds)
        ):
            bounds.append(i + 1)
    edges = [0, *bounds, len(groups)]
    return [
        torch.nn.Sequential(*[m for g in groups[a:b] for m in g])
        for a, b in itertools.pairwise(edges)
    ]


class _Worker:
    """One worker of one method: its data, model, process groups and records."""

    def __init__(self, config: dict):
        import numpy as np
        import torch

        torch.set_num_threads(1)
        with contextlib.suppress(RuntimeError):
            torch.set_num_interop_threads(1)
        self.config = config
        self.index = int(os.environ["KERAS_SKIP_WORKER"])
        cluster = json.loads(os.environ["TF_CONFIG"])["cluster"]["worker"]
        self.hosts = [address.rsplit(":", 1)[0] for address in cluster]
        self.workers = len(self.hosts)
        with np.load(config["data"]) as archive:
            data = {name: archive[name] for name in archive.files}
        self.x = torch.from_numpy(data["x"])
        self.y = torch.from_numpy(data["y"].astype("int64"))
        self.x_test = torch.from_numpy(data["x_test"])
        self.y_test = torch.from_numpy(data["y_test"].astype("int64"))
        self.order = torch.from_numpy(data["order"][:, :, self.index].astype("int64"))
        layers = sum(1 for name in data if name.startswith("kernel_"))
        keras_weights = [
            data[f"{kind}_{i}"] for i in range(layers) for kind in ("kernel", "bias")
        ]
        self.model = torch_mlp(keras_weights)
        self.initial = evaluate(self.model, self.x_test, self.y_test)
        self.records: list[dict] = []
        self.validation_seconds = 0.0
        self.validation_bytes = 0

    def tx_bytes(self) -> int:
        if not self.config["count_bytes"]:
            return 0
        return int(pathlib.Path(TX_BYTES).read_text())

    def init_default_group(self) -> None:
        import torch.distributed as dist

        dist.init_process_group(
            "gloo",
            init_method=f"tcp://{self.hosts[0]}:{self.config['ports']['store']}",
            rank=self.index,
            world_size=self.workers,
        )

    def validate(self, epoch: int, start: float, average: bool, steps: int) -> bool:
        """Evaluates the workers' mean model after ``epoch``, records the
        epoch and returns whether every worker stops (the stop is agreed on
        in one all-reduce, so that no worker waits for another forever)."""
        import copy

        import torch
        import torch.distributed as dist

        began, sent = time.perf_counter(), self.tx_bytes()
        trained = began - start - self.validation_seconds
        model = self.model
        if average:
            model = copy.deepcopy(self.model)
            with torch.no_grad():
                for p in model.parameters():
                    dist.all_reduce(p.data)
                    p.data /= self.workers
        accuracy, loss = evaluate(model, self.x_test, self.y_test)
        flag = torch.tensor([1.0 if self._stop(accuracy, trained) else 0.0])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        self.validation_seconds += time.perf_counter() - began
        self.validation_bytes += self.tx_bytes() - sent
        # As the Keras workers' records: wall time since training began at
        # the end of the epoch's validation, and the validation time in it.
        record = {
            "epoch": epoch,
            "seconds": time.perf_counter() - start,
            "validation_seconds": self.validation_seconds,
            "val_accuracy": accuracy,
            "val_loss": loss,
            "iterations": steps,
        }
        self.records.append(record)
        if self.index == 0:
            print(
                f"PROGRESS epoch {epoch}/{self.config['epochs']} "
                f"time {trained:.1f}s val_accuracy {accuracy:.4f}",
                flush=True,
            )
        return bool(flag.item())

    def _stop(self, accuracy: float, trained: float) -> bool:
        config = self.config
        if config["stop_at"] is not None and accuracy >= config["stop_at"]:
            return True
        budget = config["time_budget"]
        return budget is not None and trained >= budget

    def batches(self, epoch: int):
        for rows in self.order[epoch]:
            yield self.x[rows], self.y[rows]

    def train(self) -> dict:
        method = self.config["method"]
        train = {
            "ddp": self._ddp,
            "post-local": self._post_local,
            "diloco": self._diloco,
        }[method]
        synchronizations, payload = train()
        return {
            "epochs": self.records,
            "synchronizations": synchronizations,
            "payload_bytes": payload,
            "initial": {"val_accuracy": self.initial[0], "val_loss": self.initial[1]},
            "validation_bytes": self.validation_bytes,
        }

    @property
    def model_bytes(self) -> int:
        return 4 * sum(p.numel() for p in self.model.parameters())

    def _loop(self, optimizer, model) -> int:
        import torch

        steps = 0
        start = time.perf_counter()
        for epoch in range(self.config["epochs"]):
            for x, y in self.batches(epoch):
                optimizer.zero_grad()
                loss = torch.nn.functional.cross_entropy(model(x), y)
                loss.backward()
                optimizer.step()
                steps += 1
            average = self.config["method"] != "ddp"
            if self.validate(epoch + 1, start, average, steps):
                break
        return steps

    def _ddp(self) -> tuple[int, int]:
        import torch

        self.init_default_group()
        model = torch.nn.parallel.DistributedDataParallel(self.model)
        optimizer = torch.optim.SGD(model.parameters(), lr=self.config["lr"])
        steps = self._loop(optimizer, model)
        return steps, steps * self.model_bytes

    def _post_local(self) -> tuple[int, int]:
        import torch
        from torch.distributed.algorithms.model_averaging.averagers import (
            PeriodicModelAverager,
        )
        from torch.distributed.optim import PostLocalSGDOptimizer

        self.init_default_group()
        averager = PeriodicModelAverager(period=self.config["interval"])
        optimizer = PostLocalSGDOptimizer(
            torch.optim.SGD(self.model.parameters(), lr=self.config["lr"]), averager
        )
        steps = self._loop(optimizer, self.model)
        # The averager averages at its steps 0, period, 2 period...
        averages = (steps - 1) // self.config["interval"] + 1 if steps else 0
        return averages, averages * self.model_bytes

    def _diloco(self) -> tuple[int, int]:
        import datetime

        import torch
        import torch.distributed as dist
        from torchft.local_sgd import DiLoCo
        from torchft.manager import Manager
        from torchft.process_group import ProcessGroupGloo

        config, ports = self.config, self.config["ports"]
        host = self.hosts[self.index]
        # The replica group's own store (each worker is a group of one).
        store = dist.TCPStore(
            host, ports["groups"][self.index], is_master=True, wait_for_workers=False
        )
        self.init_default_group()  # for the validation's mean model only
        hours = datetime.timedelta(hours=1)
        inner = torch.optim.SGD(self.model.parameters(), lr=config["lr"])
        fragments = fragments_of(self.model, config["fragments"])
        outer = [
            torch.optim.SGD(
                f.parameters(),
                lr=config["outer_lr"],
                momentum=config["outer_momentum"],
                nesterov=True,
            )
            for f in fragments
        ]
        manager = Manager(
            pg=ProcessGroupGloo(timeout=hours),
            load_state_dict=None,
            state_dict=None,
            min_replica_size=self.workers,
            use_async_quorum=False,
            timeout=hours,
            quorum_timeout=hours,
            connect_timeout=datetime.timedelta(seconds=60),
            rank=0,
            world_size=1,
            store_addr=host,
            store_port=ports["groups"][self.index],
            lighthouse_addr=f"http://{self.hosts[0]}:{ports['lighthouse']}",
            replica_id=f"worker{self.index}",
            port=ports["managers"][self.index],
            hostname=host,
            # Every replica starts from the same weights: nothing to send.
            init_sync=False,
        )
        try:
            with DiLoCo(
                manager,
                fragments,
                inner,
                outer,
                sync_every=config["interval"],
                fragment_sync_delay=config["sync_delay"],
            ):
                self._loop(inner, self.model)
        finally:
            manager.shutdown(wait=False)
            del store
        # One fragment is averaged every interval / fragments steps, in turn
        # (the fragment of commit k is k % fragments).
        syncs = manager.current_step()
        sizes = [4 * sum(p.numel() for p in f.parameters()) for f in fragments]
        return syncs, sum(sizes[k % len(sizes)] for k in range(syncs))


def worker_main(config: dict) -> int:
    import torch.distributed as dist

    worker = _Worker(config)
    result = worker.train()
    result["worker"] = worker.index
    path = pathlib.Path(config["out"]) / f"worker-{worker.index}.json"
    path.write_text(json.dumps(result, indent=1))
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


# The coordinator: starts the workers of each method over the links.


def build_parser() -> argparse.ArgumentParser:
    from keras_skip.bench import links, options

    parser = argparse.ArgumentParser(
        prog="python benchmarks/torch_peer.py",
        description=__doc__.split("\n")[0],
        formatter_class=options.HelpFormatter,
    )
    add = parser.add_argument
    add("--workers", type=options.positive_int, default=4, help="worker processes")
    add(
        "--bandwidth",
        type=options.bandwidth,
        default="100mbit",
        help="rate of every worker's link, in tc's bit units, or 'none'",
    )
    add("--links", choices=links.MECHANISMS, default="auto", help="as in bench")
    add("--epochs", type=options.positive_int, default=12, help="epoch budget")
    add(
        "--sync-epochs",
        type=options.positive_int,
        default=None,
        help="epoch budget of ddp (default: --epochs)",
    )
    add(
        "--time-budget",
        type=options.positive_float,
        default=None,
        help="seconds of training after which a method stops at its epoch's end",
    )
    add("--hidden", type=options.positive_int, nargs="+", default=[1024, 1024])
    add("--batch-per-worker", type=options.positive_int, default=32)
    add("--learning-rate", type=options.positive_float, default=0.05)
    add("--interval", type=options.positive_int, default=32)
    add("--seed", type=int, default=0)
    add(
        "--methods",
        nargs="+",
        choices=METHODS,
        default=list(METHODS),
        metavar="METHOD",
        help=f"methods to run, in order, among: {', '.join(METHODS)}",
    )
    add("--fragments", type=options.positive_int, default=2, help="DiLoCo fragments")
    add(
        "--sync-delay",
        type=int,
        default=1,
        help="steps a DiLoCo fragment's all-reduce runs beside before it is "
        "needed (torchft's fragment_sync_delay)",
    )
    add("--outer-learning-rate", type=options.positive_float, default=0.7)
    add("--outer-momentum", type=options.fraction, default=0.9)
    add("--target", type=options.accuracy, default=None, help="accuracy to reach")
    add("--stop-at-target", action="store_true", help="stop once --target reached")
    add("--timeout", type=options.positive_float, default=3600)
    add(
        "--weights",
        default=None,
        help="initial weights (.npz, kernel_<i> and bias_<i>, Keras' layout; "
        "default: the Keras model the benchmark builds with --seed)",
    )
    add("--json", type=pathlib.Path, default=None, help="write the results here")
    add("--out", default=None, help="directory for the workers' logs")
    # Set by `keras-skip bench --peer torch`: the links it holds already.
    add("--namespaces", nargs="+", default=None, help=argparse.SUPPRESS)
    add("--hosts", nargs="+", default=None, help=argparse.SUPPRESS)
    return parser


class _AttachedLinks:
    """The network namespaces of links another process created and removes."""

    def __init__(self, namespaces: list[str], hosts: list[str]):
        self.namespaces, self.hosts = namespaces, hosts

    def wrap(self, i: int) -> list[str]:
        return ["ip", "netns", "exec", self.namespaces[i]]

    def launch_arguments(self) -> dict:
        return {"hosts": self.hosts, "wrap": self.wrap}

    def transmitted_bytes(self) -> list[int]:
        return [
            int(
                subprocess.run(
                    [*self.wrap(i), "cat", TX_BYTES],
                    check=True,
                    capture_output=True,
                    text=True,
                ).stdout
            )
            for i in range(len(self.namespaces))
        ]


def _labels(args: argparse.Namespace) -> dict[str, str]:
    return {
        "ddp": "DDP (synchronous)",
        "post-local": f"PostLocalSGD, PeriodicModelAverager (period {args.interval})",
        "diloco": f"torchft streaming DiLoCo ({args.fragments} fragments, delay "
        f"{args.sync_delay}, interval {args.interval})",
    }


def check(args: argparse.Namespace) -> None:
    """What cannot run ends the run here, before anything is created."""
    needed = ["torch", *(["torchft"] if "diloco" in args.methods else [])]
    missing = [name for name in needed if not _importable(name)]
    if missing:
        raise SystemExit(
            f"{' and '.join(missing)} not installed: install the peer with "
            '`pip install -e ".[peer]"`.'
        )
    if "diloco" in args.methods:
        per_fragment = args.interval // args.fragments
        if args.interval % args.fragments or not 0 <= args.sync_delay < per_fragment:
            raise SystemExit(
                f"diloco needs --interval ({args.interval}) divisible by "
                f"--fragments ({args.fragments}) and 0 <= --sync-delay < "
                f"{max(per_fragment, 1)}."
            )
        if shutil.which("torchft_lighthouse", path=_bin_path()) is None:
            raise SystemExit("torchft_lighthouse not found beside the interpreter.")


def _importable(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None


def _bin_path() -> str:
    return os.pathsep.join(
        [str(pathlib.Path(sys.executable).parent), os.environ.get("PATH", "")]
    )


def run(args: argparse.Namespace, print_fn=print) -> dict:
    """Every method's result; with ``args.json``, also written there."""
    from keras_skip.bench import links
    from keras_skip.bench.workers import export

    check(args)
    out = pathlib.Path(args.out or tempfile.mkdtemp(prefix="keras-skip-torch-peer-"))
    out.mkdir(parents=True, exist_ok=True)
    epochs = max(args.epochs, args.sync_epochs or 0)
    data = out / "inputs.npz"
    weights = export.load_weights(args.weights) if args.weights else None
    export.export(
        data,
        hidden=args.hidden,
        seed=args.seed,
        workers=args.workers,
        batch=args.batch_per_worker,
        epochs=epochs,
        weights=weights,
    )
    if args.namespaces:
        network, close = _AttachedLinks(args.namespaces, args.hosts), None
        link = f"{args.bandwidth} links (network namespaces and tc)"
    else:
        try:
            mechanism, note = links.choose(args.bandwidth, "0ms", args.links)
        except RuntimeError as error:
            raise SystemExit(str(error)) from error
        if mechanism == "relay":
            raise SystemExit(
                "the torch peer needs the links of network namespaces and tc "
                f"(root), or no limit (--bandwidth none): {note or 'relay asked'}"
            )
        network = (
            links.SlowLinks(args.workers, args.bandwidth, "0ms", mechanism)
            if mechanism
            else None
        )
        close = network
        if network:
            network.__enter__()
        link = network.describe() if network else "loopback"
    print_fn(f"PyTorch peer: {args.workers} workers, {link}")
    methods = []
    try:
        for method in args.methods:
            methods.append(_run_method(method, args, network, data, out, print_fn))
    finally:
        if close is not None:
            close.close()
    result = {
        "framework": "PyTorch",
        "versions": _versions(args),
        "link": link,
        "methods": methods,
    }
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    return result


def _versions(args: argparse.Namespace) -> dict:
    from importlib.metadata import version

    found = {"torch": version("torch")}
    if "diloco" in args.methods:
        found["torchft"] = version("torchft")
    return found


def _run_method(method, args, network, data, out, print_fn) -> dict:
    from keras_skip.bench.workers import launcher

    label = _labels(args)[method]
    directory = out / method
    directory.mkdir(parents=True, exist_ok=True)
    count = args.workers
    ports = launcher.free_ports(2 * count + 2)
    config = {
        "method": method,
        "data": str(data),
        "out": str(directory),
        "epochs": args.sync_epochs or args.epochs if method == "ddp" else args.epochs,
        "lr": args.learning_rate,
        "interval": args.interval,
        "fragments": args.fragments,
        "sync_delay": args.sync_delay,
        "outer_lr": args.outer_learning_rate,
        "outer_momentum": args.outer_momentum,
        "stop_at": args.target if args.stop_at_target else None,
        "time_budget": args.time_budget,
        "count_bytes": network is not None,
        "ports": {
            "store": ports[0],
            "lighthouse": ports[1],
            "groups": ports[2 : 2 + count],
            "managers": ports[2 + count :],
        },
    }
    arguments = network.launch_arguments() if network else {}
    env = {WORKER_FLAG: "1", "GLOO_SOCKET_IFNAME": "eth0" if network else "lo"}
    print_fn(f"[torch {method}] {label}: starting {count} workers")
    lighthouse = None
    with contextlib.ExitStack() as stack:
        if method == "diloco":
            lighthouse = _start_lighthouse(
                count, config["ports"]["lighthouse"], arguments, directory
            )
            stack.callback(_end, lighthouse)
        before = network.transmitted_bytes() if network else None
        start = time.monotonic()
        result = launcher.launch(
            [sys.executable, os.path.abspath(__file__), json.dumps(config)],
            count,
            timeout=args.timeout,
            log_dir=directory,
            env=env,
            on_progress=lambda worker, line: (
                worker == 0
                and line.startswith("PROGRESS")
                and print_fn(
                    f"[torch {method}] {line.removeprefix('PROGRESS ').strip()}"
                )
            ),
            **arguments,
        )
        seconds = time.monotonic() - start
        after = network.transmitted_bytes() if network else None
    if not result.ok:
        raise RuntimeError(
            f"torch method {method!r} failed:\n{result.failure_report()}"
        )
    measured = [
        json.loads((directory / f"worker-{i}.json").read_text()) for i in range(count)
    ]
    wire = None
    if before is not None:
        wire = max(
            a - b - m["validation_bytes"]
            for a, b, m in zip(after, before, measured, strict=True)
        )
    first = measured[0]
    return {
        "name": f"torch-{method}",
        "label": label,
        "epochs": first["epochs"],
        "synchronizations": first["synchronizations"],
        "payload_bytes": first["payload_bytes"],
        "wire_bytes": wire,
        "intervals": [1 if method == "ddp" else args.interval],
        "decision": None,
        "seconds": seconds,
        "initial": first["initial"],
    }


def _start_lighthouse(count, port, arguments, directory) -> subprocess.Popen:
    """torchft's lighthouse in worker 0's place, at its address."""
    host = arguments["hosts"][0] if "hosts" in arguments else "127.0.0.1"
    prefix = arguments["wrap"](0) if "wrap" in arguments else []
    binary = shutil.which("torchft_lighthouse", path=_bin_path())
    log = open(directory / "lighthouse.log", "w")  # noqa: SIM115
    process = subprocess.Popen(
        [
            *prefix,
            binary,
            "--bind",
            f"{host}:{port}",
            "--min_replicas",
            str(count),
            "--join_timeout_ms",
            "60000",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    log.close()
    return process


def _end(process: subprocess.Popen) -> None:
    import signal

    if process.poll() is None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(process.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(timeout=30)


def main(argv=None) -> int:
    import signal

    def stop(signum, frame):
        raise KeyboardInterrupt

    # `keras-skip bench --peer` ends the script by SIGTERM: the launcher and
    # the links then end the workers and remove the namespaces.
    signal.signal(signal.SIGTERM, stop)
    args = build_parser().parse_args(argv)
    result = run(args)
    for m in result["methods"]:
        last = m["epochs"][-1] if m["epochs"] else {}
        print(
            f"{m['label']}: {len(m['epochs'])} epochs, final accuracy "
            f"{last.get('val_accuracy', float('nan')):.4f}"
        )
    return 0


if __name__ == "__main__":
    if os.environ.get(WORKER_FLAG):
        sys.exit(worker_main(json.loads(sys.argv[1])))
    sys.exit(main())
