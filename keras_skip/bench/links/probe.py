"""A round-trip probe between two workers' hosts, run as two processes.

    python -m keras_skip.bench.links.probe serve HOST      # prints "PORT <port>"
    python -m keras_skip.bench.links.probe ping HOST:PORT [SAMPLES]

``serve`` echoes every byte it receives on a free port of ``HOST``; ``ping``
sends one byte at a time and prints the median round trip in seconds. The
benchmark runs them in worker 1's and worker 0's place (their network
namespaces, through the relay if there is one), so the round trip measured
is the one the workers' messages see.
"""

from __future__ import annotations

import socket
import sys
import time


def serve(host: str) -> None:
    with socket.create_server((host, 0)) as server:
        print(f"PORT {server.getsockname()[1]}", flush=True)
        while True:
            connection, _ = server.accept()
            with connection:
                connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                while data := connection.recv(1 << 16):
                    connection.sendall(data)


def ping(address: str, samples: int = 7) -> float:
    """The median seconds of ``samples`` 1-byte round trips to ``address``."""
    host, port = address.rsplit(":", 1)
    times = []
    with socket.create_connection((host, int(port)), timeout=30) as s:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for _ in range(samples):
            began = time.perf_counter()
            s.sendall(b"x")
            if not s.recv(1):
                raise RuntimeError(f"{address} closed the round-trip probe")
            times.append(time.perf_counter() - began)
    return sorted(times)[len(times) // 2]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) >= 2 and argv[0] == "serve":
        serve(argv[1])
        return 0
    if len(argv) >= 2 and argv[0] == "ping":
        print(f"RTT {ping(argv[1], int(argv[2]) if len(argv) > 2 else 7)!r}")
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
