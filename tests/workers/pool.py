"""Worker processes that train one job after another, for the tests.

Starting a MultiWorkerMirroredStrategy worker costs more than most of the
tests' trainings: importing TensorFlow and Keras and joining the cluster.
A `Pool` starts its workers once (real processes on 127.0.0.1, as the
launcher starts them) and hands every job to all of them in turn: each
builds a fresh model under the one strategy it holds, trains, writes its
results and its own log, and waits for the next job. A job lasts until
every worker has answered or ended, as a launch waits for every process, so
each worker's own error reaches its log. A job that fails or times out ends
the workers, and the next job starts new ones, so a failure never leaves a
worker behind in a collective its peer will not join.

The protocol is files in one directory: the test writes ``job-<k>.json``;
worker ``i`` answers with ``job-<k>.worker-<i>``, holding ``ok`` or
``failed`` (the traceback is in the job's log).
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback

from keras_skip.bench.workers import launcher

#: Seconds between looks at the job directory.
POLL = 0.02


class Pool:
    """`num_workers` processes running ``[*command, "--serve", directory]``."""

    def __init__(self, command, num_workers: int):
        self.command = list(command)
        self.num_workers = num_workers
        self.processes: list[subprocess.Popen] = []
        self.directory: pathlib.Path | None = None
        self.jobs = 0

    def start(self) -> None:
        self.directory = pathlib.Path(tempfile.mkdtemp(prefix="keras-skip-pool-"))
        self.jobs = 0
        ports = launcher.free_ports(self.num_workers)
        addresses = [f"127.0.0.1:{p}" for p in ports]
        for i in range(self.num_workers):
            env = launcher.worker_env(addresses, i)
            with open(self.directory / f"pool-{i}.log", "w") as log:
                self.processes.append(
                    subprocess.Popen(
                        [*self.command, "--serve", str(self.directory)],
                        env=env,
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        start_new_session=True,
                    )
                )

    def close(self) -> None:
        for p in self.processes:
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(p.pid, signal.SIGKILL)
        for p in self.processes:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=30)
        self.processes = []
        if self.directory is not None:
            shutil.rmtree(self.directory, ignore_errors=True)

    def run(self, config: dict, log_dir, timeout: float) -> launcher.LaunchResult:
        """Runs one job on every worker; the result reads as a launch's."""
        if any(p.poll() is not None for p in self.processes):
            self.close()  # one ended between jobs: its peer is of no use alone
        if not self.processes:
            self.start()
        log_dir = pathlib.Path(log_dir)
        log_dir.mkdir(parents=True, exist_ok=True)
        k = self.jobs
        self.jobs += 1
        job = self.directory / f"job-{k}.json"
        pending = self.directory / f"job-{k}.pending"
        pending.write_text(json.dumps({"config": config, "log_dir": str(log_dir)}))
        os.replace(pending, job)

        begin = time.monotonic()
        status: dict[int, str] = {}
        timed_out = False
        while len(status) < self.num_workers:
            time.sleep(POLL)
            for i, p in enumerate(self.processes):
                answer = self.directory / f"job-{k}.worker-{i}"
                if i not in status and answer.exists():
                    status[i] = answer.read_text()
                elif i not in status and p.poll() is not None:
                    status[i] = f"exited with code {p.returncode}"
            # A failed worker does not end the wait for its peers: as in a
            # launch, each one's own error must reach its own log (a peer
            # stuck in a collective ends within the peer timeout).
            if time.monotonic() - begin > timeout:
                timed_out = True
                break
        seconds = time.monotonic() - begin
        if len(status) < self.num_workers or any(s != "ok" for s in status.values()):
            for i in range(self.num_workers):
                log = log_dir / f"worker-{i}.log"
                if not log.exists():  # it ended before the job began
                    shutil.copyfile(self.directory / f"pool-{i}.log", log)
            self.close()  # a peer may wait in a collective: start afresh
        return launcher.LaunchResult(
            workers=[
                launcher.WorkerResult(
                    i, _exit_code(status.get(i)), log_dir / f"worker-{i}.log"
                )
                for i in range(self.num_workers)
            ],
            seconds=seconds,
            timed_out=timed_out,
        )


def _exit_code(answer: str | None) -> int | None:
    """As a launch reports it: 0 for a job done, 1 for a job failed (or a
    process ended), None for a job still running when it was given up."""
    if answer is None:
        return None
    return 0 if answer == "ok" else 1


_SHARED: dict[tuple, Pool] = {}


def shared(command, num_workers: int) -> Pool:
    """One pool per command and size in this process, ended at exit."""
    key = (tuple(command), num_workers)
    if key not in _SHARED:
        _SHARED[key] = Pool(command, num_workers)
        atexit.register(_SHARED[key].close)
    return _SHARED[key]


def serve(directory: pathlib.Path, defaults, start, configure, train) -> None:
    """The worker's side: `start(defaults)` once, then
    `train(configure(job, index), strategy, index)` for every job, each with
    its stdout and stderr in the job's log. Exits after a failed job, and
    as soon as the process that started the pool is gone."""
    import keras

    index = int(os.environ["KERAS_SKIP_WORKER"])
    parent = os.getppid()
    # Also while a job waits in a collective whose peer is gone with it.
    threading.Thread(target=_end_with, args=(parent,), daemon=True).start()
    strategy = start(dict(defaults))
    console = os.dup(1), os.dup(2)
    for k in itertools.count():
        job = directory / f"job-{k}.json"
        while not job.exists():
            time.sleep(POLL)
        spec = json.loads(job.read_text())
        log_path = pathlib.Path(spec["log_dir"]) / f"worker-{index}.log"
        with open(log_path, "w") as log:
            os.dup2(log.fileno(), 1)
            os.dup2(log.fileno(), 2)
            try:
                keras.backend.clear_session()  # names and dtype policy anew
                train(configure(spec["config"], index), strategy, index)
                status = "ok"
            except BaseException:
                traceback.print_exc()
                status = "failed"
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os.dup2(console[0], 1)
                os.dup2(console[1], 2)
        pending = directory / f"job-{k}.worker-{index}.pending"
        pending.write_text(status)
        os.replace(pending, directory / f"job-{k}.worker-{index}")
        if status != "ok":
            sys.exit(1)


def _end_with(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(1.0)
    os._exit(1)
