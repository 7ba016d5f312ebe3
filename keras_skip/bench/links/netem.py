"""Slow links between local workers: network namespaces joined by rate-limited veths.

Each worker runs in its own network namespace with one interface, ``eth0``,
whose veth peer sits on a bridge in the root namespace. A token-bucket filter
(``tc qdisc ... tbf``) limits both directions of every link to the given
rate, as if each worker had its own ``--bandwidth`` link to a switch. Needs
root and ``ip`` / ``tc`` from iproute2. Everything is removed on exit, also on
error or Ctrl-C; namespaces left over by a killed run are removed by
:func:`remove_leftovers`.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import re
import shutil
import subprocess
from collections.abc import Sequence

PREFIX = "kskip"
_RATE = re.compile(r"^\d+(\.\d+)?(bit|kbit|mbit|gbit|tbit|bps|kbps|mbps|gbps)$")


def check_rate(rate: str) -> str:
    if not isinstance(rate, str) or not _RATE.match(rate.lower()):
        raise ValueError(
            "`bandwidth` must be a tc rate such as '100mbit', '1gbit' or '500kbit'. "
            f"Received: bandwidth={rate!r}"
        )
    return rate.lower()


def unavailable_reason() -> str | None:
    """Why emulated links cannot be made here, or None if they can."""
    if os.geteuid() != 0:
        return "emulating slow links needs root (network namespaces and tc)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"emulating slow links needs `{tool}` (iproute2), not installed here"

    probe = f"{PREFIX}probe{os.getpid()}"
    try:
        _run(["ip", "netns", "add", probe])
        _run(["ip", "netns", "del", probe])
    except subprocess.CalledProcessError as error:
        return f"cannot create network namespaces here: {error.stderr.strip()}"
    return None


def _run(command: Sequence[str], namespace: str | None = None) -> str:
    if namespace:
        command = ["ip", "netns", "exec", namespace, *command]
    return subprocess.run(command, check=True, capture_output=True, text=True).stdout


class EmulatedNetwork:
    """``n`` namespaces on a bridge, every link limited to ``bandwidth``.

    With ``hub=True`` one more namespace, :attr:`hub`, sits on the bridge
    at :attr:`hub_address` behind an unlimited link: a relay that adds
    latency runs there, so that every packet between workers crosses the
    bridge only, as packets between workers without a relay do, and none
    depends on the root namespace's routes or firewall.

    Use as a context manager::

        with EmulatedNetwork(4, "100mbit") as network:
            launcher.launch(command, 4, hosts=network.hosts, wrap=network.wrap)
    """

    def __init__(
        self,
        n: int,
        bandwidth: str = "100mbit",
        burst: str = "256kb",
        latency: str = "50ms",
        hub: bool = False,
    ):
        self.n = n
        self.bandwidth = check_rate(bandwidth)
        self.burst, self.latency = burst, latency
        tag = f"{os.getpid() % 100000}"
        self.namespaces = [f"{PREFIX}{tag}n{i}" for i in range(n)]
        self.veths = [f"{PREFIX}{tag}v{i}" for i in range(n)]
        self.bridge = f"{PREFIX}{tag}br"
        self.subnet = f"10.{77 + os.getpid() % 100}.0"
        self.hosts = [f"{self.subnet}.{i + 1}" for i in range(n)]
        #: The hub's namespace and address (None without ``hub``).
        self.hub = f"{PREFIX}{tag}hub" if hub else None
        self.hub_address = f"{self.subnet}.254" if hub else None
        self._hub_veth = f"{PREFIX}{tag}vh"
        self._up = False

    def wrap(self, i: int) -> list[str]:
        """The command prefix that runs a program in worker ``i``'s namespace."""
        return ["ip", "netns", "exec", self.namespaces[i]]

    def _attach(self, ns: str, veth: str, host: str) -> None:
        """A new namespace ``ns`` whose ``eth0`` at ``host`` is joined to the
        bridge by ``veth``."""
        _run(["ip", "netns", "add", ns])
        _run(
            [
                "ip",
                "link",
                "add",
                veth,
                "type",
                "veth",
                "peer",
                "name",
                "eth0",
                "netns",
                ns,
            ]
        )
        _run(["ip", "link", "set", veth, "master", self.bridge])
        _run(["ip", "link", "set", veth, "up"])
        _run(["ip", "addr", "add", f"{host}/24", "dev", "eth0"], ns)
        _run(["ip", "link", "set", "eth0", "up"], ns)
        _run(["ip", "link", "set", "lo", "up"], ns)

    def __enter__(self) -> EmulatedNetwork:
        reason = unavailable_reason()
        if reason:
            raise RuntimeError(reason)
        atexit.register(self.close)
        self._up = True
        try:
            _run(["ip", "link", "add", self.bridge, "type", "bridge"])
            _run(["ip", "link", "set", self.bridge, "up"])
            if self.hub is not None:
                self._attach(self.hub, self._hub_veth, self.hub_address)
            for ns, veth, host in zip(
                self.namespaces, self.veths, self.hosts, strict=True
            ):
                self._attach(ns, veth, host)
                tbf = [
                    "root",
                    "tbf",
                    "rate",
                    self.bandwidth,
                    "burst",
                    self.burst,
                    "latency",
                    self.latency,
                ]
                _run(["tc", "qdisc", "add", "dev", veth, *tbf])
                _run(["tc", "qdisc", "add", "dev", "eth0", *tbf], ns)
        except BaseException:
            self.close()
            raise
        return self

    def transmitted_bytes(self) -> list[int]:
        """Bytes each worker's ``eth0`` has sent so far."""
        return [
            int(_run(["cat", "/sys/class/net/eth0/statistics/tx_bytes"], ns))
            for ns in self.namespaces
        ]

    def close(self) -> None:
        if not self._up:
            return
        self._up = False
        for ns in [*self.namespaces, *([self.hub] if self.hub else [])]:
            with contextlib.suppress(subprocess.CalledProcessError, FileNotFoundError):
                _run(["ip", "netns", "del", ns])
        for veth in [*self.veths, self._hub_veth]:
            with contextlib.suppress(subprocess.CalledProcessError, FileNotFoundError):
                _run(["ip", "link", "del", veth])
        with contextlib.suppress(subprocess.CalledProcessError, FileNotFoundError):
            _run(["ip", "link", "del", self.bridge])

    def __exit__(self, *exc) -> None:
        self.close()


def remove_leftovers() -> list[str]:
    """Removes namespaces and links named by this module that a killed run left."""
    removed = []
    if os.geteuid() != 0 or shutil.which("ip") is None:
        return removed
    for line in _run(["ip", "netns", "list"]).splitlines():
        name = line.split()[0] if line.strip() else ""
        if name.startswith(PREFIX):
            with contextlib.suppress(subprocess.CalledProcessError):
                _run(["ip", "netns", "del", name])
                removed.append(name)
    for line in _run(["ip", "-o", "link", "show"]).splitlines():
        match = re.match(r"\d+: ([^:@]+)", line)
        if match and match.group(1).startswith(PREFIX):
            with contextlib.suppress(subprocess.CalledProcessError):
                _run(["ip", "link", "del", match.group(1)])
                removed.append(match.group(1))
    return removed
