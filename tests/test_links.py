"""Slow links for the benchmark: the relay (rate and latency without root), the
round-trip probe, and the benchmark's options for them."""

import errno
import json
import os
import pathlib
import socket
import subprocess
import threading
import time

import numpy as np
import pytest

from keras_skip.bench import harness, links
from keras_skip.bench.links import netem, relay
from keras_skip.bench.workers import launcher

EMULATION = netem.unavailable_reason()
needs_emulation = pytest.mark.skipif(
    EMULATION is not None, reason=f"slow-link emulation unavailable: {EMULATION}"
)


def send_through(address: str, megabytes: int) -> None:
    """Sends `megabytes` MiB to `address` (a `sink` on the other side)."""
    host, port = address.rsplit(":", 1)
    with socket.create_connection((host, int(port))) as c:
        for _ in range(megabytes):
            c.sendall(b"x" * (1 << 20))


def sink():
    """A server that counts what it receives; returns (port, result, thread)."""
    server = socket.create_server(("127.0.0.1", 0))
    result = {}

    def serve():
        connection, _ = server.accept()
        received, first = 0, None
        while data := connection.recv(1 << 20):
            first = first or time.perf_counter()
            received += len(data)
        result["mbit"] = received * 8 / (time.perf_counter() - first) / 1e6
        result["bytes"] = received
        connection.close()
        server.close()

    thread = threading.Thread(target=serve)
    thread.start()
    return server.getsockname()[1], result, thread


@pytest.mark.parametrize(
    "text, seconds", [("25ms", 0.025), ("0ms", 0.0), ("1.5s", 1.5), ("250us", 2.5e-4)]
)
def test_durations_need_a_unit(text, seconds):
    assert relay.parse_duration(text) == pytest.approx(seconds)


@pytest.mark.parametrize("text", ["25", "-3ms", "fast", "ms", "", "1h"])
def test_malformed_latencies_are_refused_with_the_value(text):
    with pytest.raises(ValueError, match=r"`latency` must be a non-negative"):
        relay.parse_duration(text)


@pytest.mark.parametrize("text", ["100", "-100mbit", "0mbit", "fast", "100 mb"])
def test_malformed_rates_are_refused_with_the_value(text):
    with pytest.raises(ValueError, match=r"`bandwidth` must be a positive rate"):
        relay.parse_rate(text)
    assert relay.parse_rate("100mbit") == 1e8


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--latency", "25"], "--latency: must be a non-negative duration"),
        (["--latency=-3ms"], "--latency: must be a non-negative duration"),
        (["--bandwidth", "100"], "--bandwidth: must be a positive tc rate"),
        (["--bandwidth", "fast"], "--bandwidth: must be a positive tc rate"),
        (["--links", "carrier-pigeon"], "--links: invalid choice"),
    ],
)
def test_bad_link_options_are_usage_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as stop:
        harness.build_parser().parse_args(argv)
    assert stop.value.code == 2
    assert message in capsys.readouterr().err


def test_link_options_are_validated_before_anything_is_created(
    tmp_path, monkeypatch, capsys
):
    from keras_skip import cli

    made = []
    monkeypatch.setattr(
        harness.tempfile, "mkdtemp", lambda **kwargs: made.append(kwargs) or "x"
    )
    for argv in (["bench", "--latency", "10"], ["demo", "--bandwidth", "100"]):
        with pytest.raises(SystemExit) as stop:
            cli.main(argv)
        assert stop.value.code == 2
    assert made == []
    assert "must be" in capsys.readouterr().err


def test_the_mechanism_follows_what_is_asked_and_possible(monkeypatch):
    assert links.choose(None, "0ms") == (None, None)  # plain loopback
    assert links.choose(None, "10ms") == ("relay", None)
    assert links.choose("100mbit", "0ms", "relay") == ("relay", None)
    monkeypatch.setattr(netem, "unavailable_reason", lambda: "no root here")
    mechanism, note = links.choose("100mbit", "25ms")
    assert mechanism == "relay"
    assert "no root here" in note and "user-space relay" in note
    with pytest.raises(RuntimeError, match="--links tc is not possible here"):
        links.choose("100mbit", "0ms", "tc")
    monkeypatch.setattr(netem, "unavailable_reason", lambda: None)
    assert links.choose("100mbit", "25ms") == ("tc", None)
    with pytest.raises(ValueError, match="`links` must be one of auto, tc, relay"):
        links.choose("100mbit", "0ms", "udp")


def test_the_relay_delays_every_round_trip_by_twice_the_latency():
    with links.SlowLinks(2, None, "40ms", "relay") as network:
        measured = network.round_trip()
    assert 0.080 <= measured < 0.120, measured
    with links.SlowLinks(2, None, "0ms", "relay") as network:
        assert network.round_trip() < 0.020


def test_the_relay_limits_the_rate_and_counts_the_bytes():
    port, result, thread = sink()
    with relay.RelayNetwork(2, "20mbit", "5ms") as network:
        send_through(network.forward(0, 1, port), 8)
        thread.join(timeout=60)
        sent = network.transmitted_bytes()
    assert result["bytes"] == 8 << 20
    assert 16 < result["mbit"] < 21, result
    assert sent == [8 << 20, 0]


def test_the_cluster_each_worker_sees_names_the_relay_for_its_peers():
    with relay.RelayNetwork(3, None, "1ms") as network:
        clusters = [network.cluster(i) for i in range(3)]
    own = [clusters[i][i] for i in range(3)]
    assert len(set(own)) == 3  # every worker's real address, once each
    for i, cluster in enumerate(clusters):
        peers = [a for j, a in enumerate(cluster) if j != i]
        assert not set(peers) & set(own)  # peers are reached through the relay
    every_relay_port = [a for i, c in enumerate(clusters) for j, a in enumerate(c)]
    assert len(set(every_relay_port)) == 3 + 6  # one relay port per direction


def test_the_relay_refuses_bad_arguments_and_use_outside_its_block():
    with pytest.raises(ValueError, match=r"`n` must be a positive integer.*n=0"):
        relay.RelayNetwork(0)
    with pytest.raises(ValueError, match=r"`hosts` must have 2 entries"):
        relay.RelayNetwork(2, hosts=["127.0.0.1"])
    network = relay.RelayNetwork(2)
    with pytest.raises(RuntimeError, match="not running"):
        network.forward(0, 1, 1234)
    with (
        pytest.raises(RuntimeError, match="cannot enter network namespace 'absent'"),
        relay.RelayNetwork(2, namespace="absent"),
    ):
        pass


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root for /var/run/netns")
def test_a_file_that_is_no_namespace_is_refused_and_moves_no_thread():
    """``setns`` itself fails (the name exists but is no network namespace):
    `enter_namespace` raises the system's error naming the path, the thread
    stays where it was, and the relay refuses to start."""
    name = f"keras-skip-test-not-a-namespace-{os.getpid()}"
    path = pathlib.Path("/var/run/netns") / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("")
    try:
        before = os.readlink(f"/proc/self/task/{threading.get_native_id()}/ns/net")
        with pytest.raises(OSError, match=name) as raised:
            relay.enter_namespace(name)
        assert raised.value.errno == errno.EINVAL
        after = os.readlink(f"/proc/self/task/{threading.get_native_id()}/ns/net")
        assert after == before
        refused = f"cannot enter network namespace {name!r}"
        with (
            pytest.raises(RuntimeError, match=refused),
            relay.RelayNetwork(2, namespace=name),
        ):
            pass
    finally:
        path.unlink()


@needs_emulation
def test_namespaced_links_with_latency_round_trip_through_the_relay():
    """The relay runs in a hub namespace on the workers' bridge: the root
    namespace has no address or route on their network, so its routes and
    firewall cannot drop the workers' packets."""
    with links.SlowLinks(2, "50mbit", "20ms", "tc") as network:
        assert network.relay is not None and network.namespaces is not None
        hub = network.namespaces.hub
        assert (
            hub
            in subprocess.run(
                ["ip", "netns", "list"], capture_output=True, text=True
            ).stdout
        )
        root = subprocess.run(
            ["ip", "-o", "addr", "show"], capture_output=True, text=True
        ).stdout
        assert network.namespaces.subnet + "." not in root
        measured = network.round_trip()
        assert network.launch_arguments().keys() == {"hosts", "wrap", "cluster"}
    assert 0.040 <= measured < 0.070, measured
    assert (
        hub
        not in subprocess.run(
            ["ip", "netns", "list"], capture_output=True, text=True
        ).stdout
    )
    with links.SlowLinks(2, "50mbit", "0ms", "tc") as network:
        assert network.relay is None
        assert network.round_trip() < 0.010


@pytest.mark.slow
def test_two_workers_train_through_the_relay_and_only_averages_wait(tmp_path):
    """Through a relay with 100 ms of one-way latency, two MWMS workers
    train to the same weights; local steps take far less than a round trip,
    while every step that averages waits for it."""
    from test_multi_worker import WORKER, outputs

    config = {"interval": 4, "epochs": 1, "out": str(tmp_path)}
    with links.SlowLinks(2, None, "100ms", "relay") as network:
        result = launcher.launch(
            [*WORKER, json.dumps(config)],
            2,
            timeout=300,
            log_dir=tmp_path,
            **network.launch_arguments(),
        )
    assert result.ok, result.failure_report()
    results = outputs(tmp_path, 2)
    np.testing.assert_array_equal(results[0]["weights"], results[1]["weights"])
    seconds = results[0]["seconds"]  # 16 steps, averages after steps 4, 8, ...
    averaging = [seconds[i] for i in range(len(seconds)) if (i + 1) % 4 == 0]
    local = [seconds[i] for i in range(1, len(seconds)) if (i + 1) % 4 != 0]
    # A step that waited on the other worker would take a round trip.
    assert np.median(local) < 0.05, seconds
    assert max(local) < 0.2, seconds
    assert min(averaging) > 0.2, seconds


def test_delayed_averages_send_no_more_bytes_than_the_same_averages(tmp_path):
    """overlap=3 at interval 4 takes the same averages as no overlap, and
    puts no more on the wire: its buffers (twice the model) are not
    broadcast from worker 0 when they are created, as every other variable's
    initial value is under MultiWorkerMirroredStrategy."""
    from test_multi_worker import WORKER

    width = 4096
    model_bytes = 4 * (6 * width + width + width + 1)
    sent = {}
    for overlap in (False, 3):
        config = {
            "interval": 4,
            "epochs": 2,
            "width": width,
            "overlap": overlap,
            "out": str(tmp_path / str(overlap)),
        }
        (tmp_path / str(overlap)).mkdir()
        with relay.RelayNetwork(2, bandwidth=None, latency="0ms") as network:
            result = launcher.launch(
                [*WORKER, json.dumps(config)],
                2,
                timeout=300,
                log_dir=tmp_path / str(overlap),
                cluster=network.cluster,
            )
            sent[overlap] = max(network.transmitted_bytes())
        assert result.ok, result.failure_report()
    # 8 averages of the model each way, whatever the overlap.
    assert sent[False] > 8 * model_bytes
    assert sent[3] < sent[False] + model_bytes / 4, sent


def test_an_optimizers_variables_cross_no_link_when_created(tmp_path):
    """Momentum slots, the outer step's period starts and its momentum
    start from zeros on every worker: creating them sends nothing
    (MultiWorkerMirroredStrategy would broadcast each from worker 0, a copy
    of the model apiece), so the same averages cost the same bytes with them
    and without."""
    from test_multi_worker import WORKER

    width = 4096
    model_bytes = 4 * (6 * width + width + width + 1)
    plain = {"correction": 1.0, "momentum": 0.0}
    richer = {"correction": 1.0, "momentum": 0.9, "outer": [0.7, 0.9]}
    sent = {}
    for name, options in (("plain", plain), ("richer", richer)):
        config = {
            "interval": 4,
            "epochs": 2,
            "width": width,
            "out": str(tmp_path / name),
            **options,
        }
        (tmp_path / name).mkdir()
        with relay.RelayNetwork(2, bandwidth=None, latency="0ms") as network:
            result = launcher.launch(
                [*WORKER, json.dumps(config)],
                2,
                timeout=300,
                log_dir=tmp_path / name,
                cluster=network.cluster,
            )
            sent[name] = max(network.transmitted_bytes())
        assert result.ok, result.failure_report()
    assert sent["plain"] > 8 * model_bytes  # the averages
    assert sent["richer"] < sent["plain"] + model_bytes / 4, sent
