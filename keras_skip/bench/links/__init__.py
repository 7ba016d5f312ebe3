"""The benchmark's slow links: a rate and a one-way latency for every worker.

Two mechanisms, chosen by :func:`choose`:

- ``tc``: each worker in its own network namespace behind a ``tbf``-limited
  veth (:mod:`keras_skip.bench.links.netem`). Needs root and iproute2. This
  kernel-side limit is the closest to a real link. The kernel here has no
  ``netem`` qdisc, so latency, if any, is added by a relay in one more
  namespace on the same bridge (a hub), so that workers' packets cross the
  bridge only, whatever the root namespace's routes and firewall.
- ``relay``: no root needed. A user-space relay in the launching process
  (:mod:`keras_skip.bench.links.relay`) carries every connection between workers
  and emulates both the rate and the latency.

:class:`SlowLinks` puts them behind one interface for the launcher and
measures the round trip between two workers' places with
:mod:`keras_skip.bench.links.probe`.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys

from keras_skip import _units
from keras_skip._units import parse_duration
from keras_skip.bench.links import netem
from keras_skip.bench.links.relay import RelayNetwork

MECHANISMS = ("auto", "tc", "relay")


def check_bandwidth(text: str) -> str | None:
    """A ``--bandwidth`` value: a positive ``tc`` rate in bit units, or
    ``'none'`` (None: no limit). Byte units (``'100mbps'``, which ``tc``
    reads as 800 Mbit/s) are refused: people who write them mostly mean
    bits."""
    if isinstance(text, str) and text.strip().lower() == "none":
        return None
    _units.parse_bit_rate(text, "bandwidth")
    return text.strip().lower()


def check_latency(text: str) -> str:
    """A ``--latency`` value: a non-negative duration with a unit."""
    parse_duration(text, "latency")
    return text.strip().lower()


def choose(bandwidth: str | None, latency: str, mechanism: str = "auto"):
    """``(mechanism, note)``: how to emulate the links, None for plain
    loopback (no rate and no latency), and a sentence for the user when
    ``auto`` could not have ``tc``. ``tc`` asked for and unavailable raises
    a RuntimeError that says why."""
    if mechanism not in MECHANISMS:
        raise ValueError(
            f"`links` must be one of {', '.join(MECHANISMS)}. "
            f"Received: links={mechanism!r}"
        )
    if bandwidth is None and parse_duration(latency) == 0:
        return None, None
    if mechanism == "relay" or bandwidth is None:
        return "relay", None
    reason = netem.unavailable_reason()
    if reason is None:
        return "tc", None
    if mechanism == "tc":
        raise RuntimeError(f"--links tc is not possible here: {reason}")
    return "relay", f"{reason}; a user-space relay emulates the links instead"


class SlowLinks:
    """``n`` workers' links of ``bandwidth`` each way and ``latency`` one way.

    Use as a context manager; pass ``hosts``, ``wrap`` and ``cluster`` to
    :func:`keras_skip.bench.workers.launcher.launch`::

        with SlowLinks(4, "100mbit", "25ms", "relay") as links:
            print(links.round_trip())
            launcher.launch(command, 4, **links.launch_arguments())
    """

    def __init__(
        self, n: int, bandwidth: str | None, latency: str, mechanism: str
    ) -> None:
        if mechanism not in ("tc", "relay"):
            raise ValueError(
                f"`mechanism` must be 'tc' or 'relay'. Received: {mechanism!r}"
            )
        self.n = n
        self.bandwidth = bandwidth
        self.latency = latency
        self.mechanism = mechanism
        self.namespaces: netem.EmulatedNetwork | None = None
        self.relay: RelayNetwork | None = None

    def __enter__(self) -> SlowLinks:
        try:
            if self.mechanism == "tc":
                delayed = parse_duration(self.latency) > 0
                self.namespaces = netem.EmulatedNetwork(
                    self.n, self.bandwidth, hub=delayed
                )
                self.namespaces.__enter__()
                if delayed:
                    self.relay = RelayNetwork(
                        self.n,
                        None,
                        self.latency,
                        hosts=self.namespaces.hosts,
                        listen=self.namespaces.hub_address,
                        namespace=self.namespaces.hub,
                    ).__enter__()
            else:
                self.relay = RelayNetwork(
                    self.n, self.bandwidth, self.latency
                ).__enter__()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        if self.relay is not None:
            self.relay.close()
            self.relay = None
        if self.namespaces is not None:
            self.namespaces.close()
            self.namespaces = None

    def launch_arguments(self) -> dict:
        """``hosts``, ``wrap`` and ``cluster`` for the launcher."""
        arguments = {}
        if self.namespaces is not None:
            arguments.update(hosts=self.namespaces.hosts, wrap=self.namespaces.wrap)
        if self.relay is not None:
            arguments["cluster"] = self.relay.cluster
        return arguments

    def transmitted_bytes(self) -> list[int]:
        """Bytes each worker has sent so far: counted by its interface under
        ``tc`` (headers included), by the relay otherwise (payload only)."""
        if self.namespaces is not None:
            return self.namespaces.transmitted_bytes()
        return self.relay.transmitted_bytes()

    def describe(self) -> str:
        rate = self.bandwidth or "unlimited"
        how = (
            "network namespaces and tc"
            + (", latency by a relay" if parse_duration(self.latency) > 0 else "")
            if self.mechanism == "tc"
            else "a user-space relay"
        )
        return f"{rate} links, {self.latency} one-way latency ({how})"

    def round_trip(self, samples: int = 7) -> float:
        """The median seconds of a 1-byte round trip from worker 0's place to
        worker 1's over the idle links, measured by two probe processes (in
        the workers' namespaces under ``tc``): ``2 * latency`` plus what the
        path itself costs."""
        if self.n < 2:
            return 0.0
        wrap = self.namespaces.wrap if self.namespaces is not None else (lambda i: [])
        host = self.namespaces.hosts[1] if self.namespaces is not None else "127.0.0.1"
        probe = [sys.executable, "-m", "keras_skip.bench.links.probe"]
        server = subprocess.Popen(
            [*wrap(1), *probe, "serve", host],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            line = server.stdout.readline()
            if not line.startswith("PORT "):
                raise RuntimeError(
                    f"the round-trip probe did not start: {line}{server.stderr.read()}"
                )
            port = int(line.split()[1])
            address = (
                self.relay.forward(0, 1, port)
                if self.relay is not None
                else f"{host}:{port}"
            )
            pinged = subprocess.run(
                [*wrap(0), *probe, "ping", address, str(samples)],
                capture_output=True,
                text=True,
                timeout=120,
            )
            if pinged.returncode != 0 or not pinged.stdout.startswith("RTT "):
                raise RuntimeError(f"the round-trip probe failed: {pinged.stderr}")
            return float(pinged.stdout.split()[1])
        finally:
            server.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                server.wait(timeout=10)
