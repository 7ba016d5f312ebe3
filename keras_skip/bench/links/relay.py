"""Slow links without root: every connection between workers passes a relay
that delays it and limits its rate.

TensorFlow's server listens on all interfaces on the port its own
``TF_CONFIG`` entry names, and reaches its peers at whatever addresses the
cluster names for them. So each worker ``i`` is given a cluster in which its
own entry is its real address and every peer ``j`` is a port of this relay,
one per direction ``i -> j``. The relay, a thread of the launching process,
forwards each connection to the real address and emulates, for every worker,
a link of ``bandwidth`` in each direction (bytes from ``i`` to ``j`` use
``i``'s uplink and ``j``'s downlink, serially) followed by a one-way delay of
``latency``: a round trip between two workers takes ``2 * latency`` more than
without it. Use as a context manager::

    with RelayNetwork(4, bandwidth="100mbit", latency="25ms") as network:
        launcher.launch(command, 4, cluster=network.cluster)

The relay costs CPU in the launching process (it copies every byte once), a
few percent of a core at 100 Mbit/s per worker. It buffers what a sender has
written and its links have not carried yet, as a long link's routers would
if the senders' windows allowed it.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import socket
import threading
from collections.abc import Sequence

from keras_skip._units import parse_duration, parse_rate

_CHUNK = 1 << 16


def enter_namespace(name: str) -> None:
    """Moves the calling thread (only it) into network namespace ``name``:
    the sockets it opens from then on live there."""
    path = f"/var/run/netns/{name}"
    fd = os.open(path, os.O_RDONLY)
    try:
        if hasattr(os, "setns"):  # Python 3.12+
            try:
                os.setns(fd, os.CLONE_NEWNET)
            except OSError as error:
                raise OSError(error.errno, error.strerror, path) from None
            return
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.setns(fd, 0x40000000) != 0:  # CLONE_NEWNET
            error = ctypes.get_errno()
            raise OSError(error, os.strerror(error), path)
    finally:
        os.close(fd)


class _Link:
    """One direction of one worker's link: busy until ``free_at``."""

    def __init__(self):
        self.free_at = 0.0
        self.bytes = 0


class RelayNetwork:
    """``n`` workers whose connections to each other pass a slow relay.

    Args:
        n: Number of workers.
        bandwidth: Rate of every worker's link in each direction (``tc``
            syntax, such as ``'100mbit'``), or None for no limit.
        latency: One-way delay added to every byte between two workers
            (``'25ms'``; ``'0ms'`` for none).
        hosts: The address each worker listens on (default ``127.0.0.1``
            for all); the relay connects there.
        listen: The address the relay listens on, reachable from every
            worker.
        namespace: A network namespace (a name from ``ip netns list``) in
            which the relay's thread listens and connects, as a host of its
            own on the workers' network; None for this process's own.
    """

    def __init__(
        self,
        n: int,
        bandwidth: str | None = None,
        latency: str = "0ms",
        hosts: Sequence[str] | None = None,
        listen: str = "127.0.0.1",
        namespace: str | None = None,
    ):
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ValueError(f"`n` must be a positive integer. Received: n={n!r}")
        hosts = list(hosts) if hosts is not None else ["127.0.0.1"] * n
        if len(hosts) != n:
            raise ValueError(f"`hosts` must have {n} entries. Received: {hosts!r}")
        self.n = n
        self.bandwidth = bandwidth
        self.latency = latency
        self.hosts = hosts
        self.listen = listen
        self.namespace = namespace
        self._rate = None if bandwidth is None else parse_rate(bandwidth) / 8.0
        self._delay = parse_duration(latency)
        self._uplinks = [_Link() for _ in range(n)]
        self._downlinks = [_Link() for _ in range(n)]
        self._ports: list[int] = []
        self._relay_ports: dict[tuple[int, int], int] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._servers: list[asyncio.AbstractServer] = []

    # -- what the launcher needs --------------------------------------------

    def cluster(self, i: int) -> list[str]:
        """The workers' addresses as worker ``i`` is to see them: its own real
        address, and a relay port for every peer."""
        return [
            f"{self.hosts[i]}:{self._ports[i]}"
            if j == i
            else f"{self.listen}:{self._relay_ports[i, j]}"
            for j in range(self.n)
        ]

    def forward(self, i: int, j: int, port: int) -> str:
        """An address through which worker ``i`` reaches ``port`` on worker
        ``j``'s host over the same links (a round-trip probe uses it)."""
        return f"{self.listen}:{self._call(self._listen(i, j, port))}"

    def transmitted_bytes(self) -> list[int]:
        """Bytes each worker has sent to its peers so far."""
        return [link.bytes for link in self._uplinks]

    def describe(self) -> str:
        rate = self.bandwidth or "unlimited"
        return f"{rate} links with {self.latency} one-way latency (user-space relay)"

    # -- lifetime -------------------------------------------------------------

    def __enter__(self) -> RelayNetwork:
        from keras_skip.bench.workers import launcher

        self._ports = launcher.free_ports(self.n)
        self._loop = asyncio.new_event_loop()
        entered: list[BaseException | None] = []
        ready = threading.Event()

        def run() -> None:
            try:
                if self.namespace is not None:
                    enter_namespace(self.namespace)
            except BaseException as error:  # reported by __enter__
                entered.append(error)
                ready.set()
                return
            entered.append(None)
            ready.set()
            self._loop.run_forever()

        self._thread = threading.Thread(
            target=run, name="keras-skip-relay", daemon=True
        )
        self._thread.start()
        ready.wait()
        if entered[0] is not None:
            self._thread.join()
            self._loop.close()
            self._loop = None
            raise RuntimeError(
                f"the relay cannot enter network namespace {self.namespace!r}: "
                f"{entered[0]}"
            ) from entered[0]
        try:
            for i in range(self.n):
                for j in range(self.n):
                    if i != j:
                        self._relay_ports[i, j] = self._call(self._listen(i, j))
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        loop, self._loop = self._loop, None
        if loop is None:
            return

        async def stop():
            for server in self._servers:
                server.close()
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(stop(), loop).result(timeout=10)
        loop.call_soon_threadsafe(loop.stop)
        self._thread.join(timeout=10)
        loop.close()
        self._servers = []

    def _call(self, coroutine, timeout: float = 30.0):
        if self._loop is None:
            coroutine.close()
            raise RuntimeError("the relay is not running (use it as a context manager)")
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result(timeout)

    # -- the relay ------------------------------------------------------------

    async def _listen(self, i: int, j: int, target_port: int | None = None) -> int:
        host = self.hosts[j]
        port = self._ports[j] if target_port is None else target_port

        async def connected(reader, writer):
            try:
                up_reader, up_writer = await asyncio.open_connection(host, port)
            except OSError:
                writer.close()
                return
            for stream in (writer, up_writer):
                sock = stream.get_extra_info("socket")
                if sock is not None:
                    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            # Cancelled when the relay closes: end quietly then.
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.gather(
                    self._pipe(reader, up_writer, self._uplinks[i], self._downlinks[j]),
                    self._pipe(up_reader, writer, self._uplinks[j], self._downlinks[i]),
                    return_exceptions=True,
                )

        server = await asyncio.start_server(connected, self.listen, 0)
        self._servers.append(server)
        return server.sockets[0].getsockname()[1]

    async def _pipe(self, reader, writer, uplink: _Link, downlink: _Link) -> None:
        """Forwards one direction of a connection, each chunk leaving once the
        links have carried it and the delay has passed, in order."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()

        async def deliver():
            while True:
                due, data = await queue.get()
                wait = due - loop.time()
                if wait > 0:
                    await asyncio.sleep(wait)
                if data is None:
                    break
                writer.write(data)
                await writer.drain()
            with contextlib.suppress(OSError):
                writer.write_eof()

        delivering = asyncio.ensure_future(deliver())
        try:
            while True:
                try:
                    data = await reader.read(_CHUNK)
                except OSError:
                    data = b""
                now = loop.time()
                if not data:
                    await queue.put((now + self._delay, None))
                    break
                done = now
                if self._rate is not None:
                    start = max(now, uplink.free_at, downlink.free_at)
                    done = start + len(data) / self._rate
                    uplink.free_at = downlink.free_at = done
                uplink.bytes += len(data)
                await queue.put((done + self._delay, data))
            await delivering
        except (OSError, asyncio.CancelledError):
            delivering.cancel()
            raise
        finally:
            with contextlib.suppress(Exception):
                writer.close()
