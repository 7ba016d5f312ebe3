"""Starts N local worker processes with the right TF_CONFIG, and always cleans up.

    python -m keras_skip.bench.workers.launcher -n 2 -- python my_training.py --epochs 3

Every worker gets ``TF_CONFIG`` (a cluster of ``n`` workers on free ports of
``127.0.0.1``, or of the given hosts; with ``--chief`` the first of them is
the ``chief`` task and the others form the ``worker`` job), one thread pool of
``threads_per_worker`` threads, and its own log file. The launcher waits for
all of them, up to a timeout, and then ends every process it started, also on
error, timeout or Ctrl-C. The tests, the benchmark and the tutorials use it.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import pathlib
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence


@dataclasses.dataclass
class Kill:
    """Fault injection: SIGKILL worker ``worker`` once its log contains ``when``
    (or at once if ``when`` is None), ``delay`` seconds later."""

    worker: int
    when: str | None = None
    delay: float = 0.0


@dataclasses.dataclass
class WorkerResult:
    index: int
    returncode: int | None
    log_path: pathlib.Path
    killed: bool = False
    #: Seconds from launch to exit.
    seconds: float | None = None

    @property
    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


@dataclasses.dataclass
class LaunchResult:
    workers: list[WorkerResult]
    seconds: float
    timed_out: bool
    #: Seconds from launch to the injected kill, if any.
    killed_at: float | None = None

    @property
    def ok(self) -> bool:
        return not self.timed_out and all(w.returncode == 0 for w in self.workers)

    def failure_report(self, tail: int = 3000) -> str:
        parts = [f"timed out: {self.timed_out}"]
        for w in self.workers:
            parts.append(
                f"--- worker {w.index}: exit code {w.returncode}\n{w.log[-tail:]}"
            )
        return "\n".join(parts)


def free_ports(n: int) -> list[int]:
    """``n`` distinct ports that are free on this machine right now."""
    sockets = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("", 0))
            sockets.append(s)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def tf_config(addresses: Sequence[str], index: int, chief: bool = False) -> str:
    """``TF_CONFIG`` of process ``index`` in a cluster of ``addresses``.

    Without ``chief`` every process is a ``worker`` task. With ``chief`` the
    first address is the ``chief`` task and process ``i > 0`` is ``worker``
    task ``i - 1``, so ``index`` is still TensorFlow's index of the process
    among all the workers (`keras_skip.multi_worker.worker_index`).
    """
    if not chief:
        cluster = {"worker": list(addresses)}
        task = {"type": "worker", "index": index}
    else:
        cluster = {"chief": list(addresses[:1])}
        if len(addresses) > 1:
            cluster["worker"] = list(addresses[1:])
        task = (
            {"type": "chief", "index": 0}
            if index == 0
            else {"type": "worker", "index": index - 1}
        )
    return json.dumps({"cluster": cluster, "task": task})


def worker_env(
    addresses: Sequence[str],
    index: int,
    env: dict[str, str] | None = None,
    threads_per_worker: int | None = 1,
    chief: bool = False,
) -> dict[str, str]:
    """The environment of worker ``index`` of the cluster ``addresses``: this
    process's environment, ``env``, ``TF_CONFIG`` (see :func:`tf_config`),
    ``KERAS_SKIP_WORKER``, unbuffered output, TensorFlow's C++ log level 2
    unless set, and ``threads_per_worker`` intra- and inter-op threads (None
    keeps TensorFlow's default)."""
    environment = {**os.environ, **(env or {})}
    environment["TF_CONFIG"] = tf_config(addresses, index, chief=chief)
    environment["KERAS_SKIP_WORKER"] = str(index)
    environment["PYTHONUNBUFFERED"] = "1"
    environment.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    if threads_per_worker:
        environment["TF_NUM_INTRAOP_THREADS"] = str(threads_per_worker)
        environment["TF_NUM_INTEROP_THREADS"] = str(threads_per_worker)
    return environment


def launch(
    command: Sequence[str],
    num_workers: int,
    *,
    timeout: float = 600.0,
    log_dir: str | os.PathLike | None = None,
    env: dict[str, str] | None = None,
    threads_per_worker: int | None = 1,
    hosts: Sequence[str] | None = None,
    wrap: Callable[[int], Sequence[str]] | None = None,
    kill: Kill | None = None,
    on_progress: Callable[[int, str], None] | None = None,
    chief: bool = False,
    cluster: Callable[[int], Sequence[str]] | None = None,
) -> LaunchResult:
    """Runs ``command`` as ``num_workers`` MultiWorkerMirroredStrategy workers.

    Args:
        command: The worker command, for example
            ``[sys.executable, "train.py", "--epochs", "3"]``. Every worker
            runs the same command; it learns its index from ``TF_CONFIG``
            (and from ``KERAS_SKIP_WORKER``).
        num_workers: Number of worker processes.
        timeout: Seconds after which every worker still running is killed.
        log_dir: Where ``worker-<i>.log`` files go (default: a new temporary
            directory, kept for inspection).
        env: Extra environment variables for every worker.
        threads_per_worker: TensorFlow intra- and inter-op threads per worker
            (default 1, right when workers share a few cores); None keeps
            TensorFlow's default.
        hosts: One address per worker (default ``127.0.0.1`` for all); ports
            are chosen free on each.
        wrap: ``wrap(i)`` returns a prefix for worker ``i``'s command, such as
            ``["ip", "netns", "exec", "ns0"]``.
        kill: Optional fault injection.
        on_progress: Called with ``(worker, line)`` for every new log line.
        chief: Make worker 0 the ``chief`` task of ``TF_CONFIG`` and the
            others the ``worker`` job (see :func:`tf_config`). Indices,
            ``KERAS_SKIP_WORKER`` and log names count all processes from 0
            either way.
        cluster: ``cluster(i)`` returns the ``num_workers`` addresses of the
            cluster as worker ``i`` is to see them, instead of ``hosts`` and
            free ports: its own entry is where it listens, the others where
            it reaches its peers (a relay, for example
            :class:`keras_skip.bench.links.relay.RelayNetwork`).

    Returns:
        A :class:`LaunchResult` with every worker's exit code and log. Every
        process is ended when this returns or raises.
    """
    cluster = _cluster_of(num_workers, hosts, cluster)
    log_dir = pathlib.Path(log_dir or tempfile.mkdtemp(prefix="keras-skip-workers-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    workers = _Workers(num_workers, log_dir)
    try:
        for i in range(num_workers):
            workers.start(i, command, cluster(i), env, threads_per_worker, wrap, chief)
        timed_out = workers.wait(timeout, kill, on_progress)
    finally:
        workers.end()
    return workers.result(timed_out, kill)


def _cluster_of(
    num_workers: int,
    hosts: Sequence[str] | None,
    cluster: Callable[[int], Sequence[str]] | None,
) -> Callable[[int], Sequence[str]]:
    """``cluster``, or one cluster that every worker sees: free ports on
    ``hosts``, checked to name one host per worker."""
    hosts = list(hosts or ["127.0.0.1"] * num_workers)
    if len(hosts) != num_workers:
        raise ValueError(
            f"`hosts` must have {num_workers} entries. Received: {hosts!r}"
        )
    if cluster is not None:
        return cluster
    ports = free_ports(num_workers)
    addresses = [f"{h}:{p}" for h, p in zip(hosts, ports, strict=True)]
    return lambda i: addresses


class _Workers:
    """The processes of one launch, their logs, and when each exited."""

    def __init__(self, num_workers: int, log_dir: pathlib.Path):
        self.num_workers = num_workers
        self.log_dir = log_dir
        self.processes: list[subprocess.Popen] = []
        self.logs = []
        self.start_time = time.monotonic()
        self.killed_at: float | None = None
        self.exited_at: dict[int, float] = {}
        self.offsets = [0] * num_workers

    def log_path(self, i: int) -> pathlib.Path:
        return self.log_dir / f"worker-{i}.log"

    def start(
        self,
        i: int,
        command: Sequence[str],
        addresses: Sequence[str],
        env: dict[str, str] | None,
        threads_per_worker: int | None,
        wrap: Callable[[int], Sequence[str]] | None,
        chief: bool,
    ) -> None:
        """Starts worker ``i`` in its own session, its output to its log."""
        seen = list(addresses)
        if len(seen) != self.num_workers:
            raise ValueError(
                f"`cluster({i})` must return {self.num_workers} addresses. "
                f"Received: {seen!r}"
            )
        environment = worker_env(seen, i, env, threads_per_worker, chief)
        log = open(self.log_path(i), "w")  # noqa: SIM115
        self.logs.append(log)
        prefix = list(wrap(i)) if wrap else []
        self.processes.append(
            subprocess.Popen(
                [*prefix, *command],
                env=environment,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        )

    def wait(
        self,
        timeout: float,
        kill: Kill | None,
        on_progress: Callable[[int, str], None] | None,
    ) -> bool:
        """Polls until every worker has exited or ``timeout`` has passed
        (then returns True), passing on new log lines and injecting ``kill``."""
        while True:
            time.sleep(0.1)
            if on_progress:
                for i in range(self.num_workers):
                    self.offsets[i] = _emit_new_lines(
                        self.log_path(i), self.offsets[i], i, on_progress
                    )
            if kill is not None and self.killed_at is None:
                self._inject(kill)
            for i, p in enumerate(self.processes):
                if p.poll() is not None and i not in self.exited_at:
                    self.exited_at[i] = time.monotonic() - self.start_time
            # Counted from `exited_at`, not polled again: a worker that exits
            # between the two would be left without its exit code.
            if len(self.exited_at) == self.num_workers:
                return False
            if time.monotonic() - self.start_time > timeout:
                return True

    def _inject(self, kill: Kill) -> None:
        if self.processes[kill.worker].poll() is not None:
            return
        text = self.log_path(kill.worker).read_text(errors="replace")
        if kill.when is None or kill.when in text:
            time.sleep(kill.delay)
            _kill_group(self.processes[kill.worker])
            self.killed_at = time.monotonic() - self.start_time

    def end(self) -> None:
        """Ends every process started and closes the logs."""
        for p in self.processes:
            _kill_group(p)
        for p in self.processes:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=30)
        for log in self.logs:
            log.close()

    def result(self, timed_out: bool, kill: Kill | None) -> LaunchResult:
        killed = kill is not None and self.killed_at is not None
        return LaunchResult(
            workers=[
                WorkerResult(
                    i,
                    p.returncode if i in self.exited_at else None,
                    self.log_path(i),
                    killed=killed and kill.worker == i,
                    seconds=self.exited_at.get(i),
                )
                for i, p in enumerate(self.processes)
            ],
            seconds=time.monotonic() - self.start_time,
            timed_out=timed_out,
            killed_at=self.killed_at,
        )


def _kill_group(process: subprocess.Popen) -> None:
    if process.poll() is None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(process.pid, signal.SIGKILL)


def _emit_new_lines(path: pathlib.Path, offset: int, worker: int, callback) -> int:
    with contextlib.suppress(OSError), open(path, errors="replace") as f:
        f.seek(offset)
        chunk = f.read()
        complete = chunk.rfind("\n") + 1
        for line in chunk[:complete].splitlines():
            callback(worker, line)
        return offset + complete
    return offset


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--" not in argv:
        print(
            "usage: python -m keras_skip.bench.workers.launcher [-n N] [--timeout S] "
            "[--chief] -- COMMAND ...",
            file=sys.stderr,
        )
        return 2
    split = argv.index("--")
    parser = argparse.ArgumentParser(prog="python -m keras_skip.bench.workers.launcher")
    parser.add_argument("-n", "--num-workers", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=3600)
    parser.add_argument("--log-dir")
    parser.add_argument(
        "--chief", action="store_true", help="make worker 0 the 'chief' task"
    )
    args = parser.parse_args(argv[:split])
    command = argv[split + 1 :]

    def stop(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)
    result = launch(
        command,
        args.num_workers,
        timeout=args.timeout,
        log_dir=args.log_dir,
        on_progress=lambda i, line: print(f"[worker {i}] {line}", flush=True),
        chief=args.chief,
    )
    for w in result.workers:
        print(f"worker {w.index}: exit code {w.returncode}, log {w.log_path}")
    if result.timed_out:
        print(f"timed out after {args.timeout:g} s; all workers were killed")
    return 0 if result.ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
