"""``keras-skip bench --peer torch``: PyTorch on the links of the Keras methods.

The harness checks the option before it creates anything
(:func:`check`), has the Keras workers write their initial weights, and
after the Keras methods runs ``benchmarks/torch_peer.py`` as a subprocess
(:func:`run`) on the same links, with the same data, shards, batch, learning
rate, interval and weights. Nothing here imports PyTorch: the script does,
in its own processes.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import pathlib
import signal
import subprocess
import sys
from collections.abc import Callable

from keras_skip._units import parse_duration

#: The script, in a clone of the repository (it is not part of the package).
SCRIPT = pathlib.Path(__file__).resolve().parents[3] / "benchmarks" / "torch_peer.py"
#: What ``--peer torch`` needs installed.
MODULES = ("torch", "torchft")
INSTALL = 'pip install -e ".[peer]"'


def missing_modules() -> list[str]:
    """The modules of :data:`MODULES` not installed here (or blocked, with
    ``sys.modules[name] = None``)."""
    missing = []
    for name in MODULES:
        try:
            found = importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            missing.append(name)
    return missing


def check(args: argparse.Namespace, mechanism: str | None) -> None:
    """Ends the run with a SystemExit saying why, if ``--peer`` cannot run
    with these options; nothing when ``--peer`` is not given."""
    if args.peer is None:
        return
    if args.workload != "mlp":
        raise SystemExit(
            f"--peer {args.peer} runs the MLP on IID shards only: use "
            f"--workload mlp, not {args.workload}."
        )
    if parse_duration(args.latency) > 0 or mechanism == "relay":
        raise SystemExit(
            f"--peer {args.peer} needs links of network namespaces and tc (as "
            "root) without latency, or no limit at all (--bandwidth none): "
            "PyTorch's workers connect on ports chosen at run time, which a "
            "relay cannot forward."
        )
    if args.interval % args.peer_fragments:
        raise SystemExit(
            f"--interval ({args.interval}) must be divisible by --peer-fragments "
            f"({args.peer_fragments})."
        )
    per_fragment = args.interval // args.peer_fragments
    if not 0 <= args.peer_sync_delay < per_fragment:
        raise SystemExit(
            f"--peer-sync-delay must be in [0, {per_fragment}) (--interval over "
            f"--peer-fragments), got {args.peer_sync_delay}."
        )
    missing = missing_modules()
    if missing:
        raise SystemExit(
            f"--peer {args.peer} needs {' and '.join(missing)}, not installed "
            f"here: install them with `{INSTALL}` (PyTorch's CPU build and "
            "torchft). Allowed values of --peer: torch."
        )
    if not SCRIPT.exists():
        raise SystemExit(
            f"--peer {args.peer} runs benchmarks/torch_peer.py of a clone of the "
            "keras-skip repository, which this installation does not have."
        )


def command(
    args: argparse.Namespace, weights: pathlib.Path, out_dir: pathlib.Path, network
) -> list[str]:
    """The script's command line for the run of ``args``: the links of
    ``network`` (a :class:`keras_skip.bench.links.SlowLinks`, or None for
    loopback), the Keras workers' ``weights``, results under ``out_dir``."""
    line = [
        sys.executable,
        str(SCRIPT),
        *("--workers", str(args.workers)),
        *("--bandwidth", args.bandwidth or "none"),
        *("--epochs", str(args.epochs)),
        *("--hidden", *map(str, args.hidden)),
        *("--batch-per-worker", str(args.batch_per_worker)),
        *("--learning-rate", repr(args.learning_rate)),
        *("--interval", str(args.interval)),
        *("--seed", str(args.seed)),
        *("--fragments", str(args.peer_fragments)),
        *("--sync-delay", str(args.peer_sync_delay)),
        *("--outer-learning-rate", repr(args.outer_learning_rate)),
        *("--outer-momentum", repr(args.outer_momentum)),
        *("--timeout", repr(args.timeout)),
        *("--weights", str(weights)),
        *("--json", str(out_dir / "peer.json")),
        *("--out", str(out_dir / "peer")),
    ]
    if args.peer_sync_epochs:
        line += ["--sync-epochs", str(args.peer_sync_epochs)]
    if args.peer_time_budget:
        line += ["--time-budget", repr(args.peer_time_budget)]
    if args.stop_at_target:
        line += ["--target", repr(args.target), "--stop-at-target"]
    namespaces = getattr(network, "namespaces", None)
    if namespaces is not None:
        line += ["--namespaces", *namespaces.namespaces]
        line += ["--hosts", *namespaces.hosts]
    return line


def run(
    args: argparse.Namespace,
    weights: pathlib.Path,
    out_dir: pathlib.Path,
    network,
    print_fn: Callable[[str], None],
) -> dict:
    """Runs the script, passing on its output, and returns what it wrote:
    ``framework``, ``versions``, ``link``, ``methods``, and the
    ``arguments`` it ran with (without the paths of this machine)."""
    line = command(args, weights, out_dir, network)
    log = out_dir / "peer.log"
    with open(log, "w") as errors:
        process = subprocess.Popen(
            line, stdout=subprocess.PIPE, stderr=errors, text=True
        )
        try:
            for text in process.stdout:
                if text.startswith("[torch ") or text.startswith("PyTorch peer"):
                    print_fn(text.rstrip("\n"))
            process.wait()
        finally:
            _end(process)
    if process.returncode != 0:
        raise RuntimeError(
            f"--peer {args.peer} failed (exit code {process.returncode}):\n"
            + log.read_text()[-3000:]
        )
    result = json.loads((out_dir / "peer.json").read_text())
    result["arguments"] = _arguments(line)
    return result


def _arguments(line: list[str]) -> list[str]:
    """The script's options, without the interpreter, the paths and the
    namespaces of this run."""
    kept, skip = ["benchmarks/torch_peer.py"], False
    local = ("--weights", "--json", "--out", "--namespaces", "--hosts")
    for word in line[2:]:
        if word.startswith("--"):
            skip = word in local
        if not skip:
            kept.append(word)
    return kept


def _end(process: subprocess.Popen) -> None:
    """Ends the script; a SIGTERM first, so that it ends its workers."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(timeout=10)
