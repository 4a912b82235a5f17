"""Multi-region stack pieces without the stack: region names, the remote region's plan,
and the emulated link as its own process (``meridian link``), cut and restored by
signals while a real TCP peer talks through it."""
from __future__ import annotations

import json
import signal
import socket
import socketserver
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from meridian import regions
from meridian.stack import StackConfig, spawn_listener


@pytest.mark.parametrize("text, expected", [("a", ["a"]), ("a,b", ["a", "b"]), (" eu , us1 ", ["eu", "us1"])])
def test_region_names_parse(text: str, expected: list[str]) -> None:
    assert regions.parse_regions(text) == expected


@pytest.mark.parametrize("text", ["", ",", "a,a", "A", "a-b", "1a", "a" * 17])
def test_bad_region_names_are_refused_with_the_reason(text: str) -> None:
    with pytest.raises(ValueError, match="region"):
        regions.parse_regions(text)
    with pytest.raises(ValueError, match="region"):
        StackConfig(regions=text)


def test_a_remote_region_reads_from_its_relay_and_writes_to_the_home_stream(tmp_path: Path) -> None:
    args = regions.rollout_args("b", "builtin", "redis://127.0.0.1:7/0", "127.0.0.1:9001", "127.0.0.1:9002")
    assert args[args.index("--weightsync") + 1] == "127.0.0.1:9001"
    assert args[args.index("--envsandbox") + 1] == "127.0.0.1:9002"
    assert args[args.index("--redis-url") + 1] == "redis://127.0.0.1:7/0"
    assert args[args.index("--region") + 1] == "b"
    relay = regions.relay_args("b", "127.0.0.1:9100", tmp_path)
    assert relay[relay.index("--role") + 1] == "relay" and relay[relay.index("--upstream") + 1] == "127.0.0.1:9100"
    assert regions.remote_regions({"rollout": "x", "rollout_http": "y", "rollout-b": "z", "rollout-c": "w"}) == ["b", "c"]


class _Echo(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True


class _EchoHandler(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        while data := self.request.recv(65536):
            self.request.sendall(data)


@pytest.fixture()
def echo() -> Iterator[str]:
    server = _Echo(("127.0.0.1", 0), _EchoHandler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def _round_trip(address: str, payload: bytes) -> float:
    host, _, port = address.rpartition(":")
    started = time.monotonic()
    with socket.create_connection((host, int(port)), timeout=5) as s:
        s.sendall(payload)
        got = b""
        while len(got) < len(payload):
            chunk = s.recv(65536)
            if not chunk:
                raise ConnectionError("closed")
            got += chunk
    assert got == payload
    return time.monotonic() - started


def _refused(address: str) -> bool:
    try:
        _round_trip(address, b"x")
    except OSError:
        return True
    return False


def test_the_link_process_delays_counts_cuts_and_restores(echo: str, tmp_path: Path) -> None:
    stats = tmp_path / "link.json"
    argv = [sys.executable, "-m", "meridian.cli", "link", "--target", echo, "--latency-ms", "100", "--mbit-s", "0", "--stats-file", str(stats)]
    proc, address, log = spawn_listener("link", argv, tmp_path / "link.log", {})
    try:
        # One round trip crosses the link twice: at least 2 x 100 ms.
        assert _round_trip(address, b"hello" * 100) >= 0.2
        proc.send_signal(signal.SIGUSR1)
        deadline = time.monotonic() + 5
        while not _refused(address):
            assert time.monotonic() < deadline, "the link still carries traffic after SIGUSR1"
            time.sleep(0.05)
        proc.send_signal(signal.SIGUSR2)
        deadline = time.monotonic() + 5
        while _refused(address):
            assert time.monotonic() < deadline, "the link did not come back after SIGUSR2"
            time.sleep(0.05)
        time.sleep(1.5)  # the counters are written once a second
        counters = json.loads(stats.read_text())
        assert counters["cuts"] == 1 and not counters["cut_now"]
        assert counters["bytes_up"] >= 500 and counters["bytes_down"] >= 500
        assert counters["latency_s"] == pytest.approx(0.1)
    finally:
        proc.terminate()
        assert proc.wait(10) == 0, log.read_text()


def test_the_link_process_refuses_a_bad_target(tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, "-m", "meridian.cli", "link", "--target", "nowhere"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "host:port" in out.stderr


def test_region_status_reads_each_region_from_its_own_services(tmp_path: Path) -> None:
    """`meridian status` per region: the version a region's rollout serves, what its own
    weightsync (the relay, for a remote region) holds, how far the rollout is behind the
    origin's newest version, and the link's counters; a rollout out of reach is shown as
    unknown, not as caught up."""
    import asyncio

    from meridian.v1 import rollout_pb2, weightsync_pb2

    addresses = {"weightsync": "o:1", "rollout": "r:1", "weightsync-b": "w:2", "rollout-b": "r:2", "weightsync-c": "w:3", "rollout-c": "r:3"}
    replies = {
        "o:1": weightsync_pb2.WeightSyncStatus(latest_version=9),
        "r:1": rollout_pb2.RolloutStatus(policy_version=8),
        "w:2": weightsync_pb2.WeightSyncStatus(latest_version=7),
        "r:2": rollout_pb2.RolloutStatus(policy_version=5),
        "w:3": weightsync_pb2.WeightSyncStatus(latest_version=9),
        # region c's rollout does not answer
    }
    regions.stats_path(tmp_path, "b").write_text(json.dumps({"bytes_down": 123, "cuts": 1}))  # as the link process writes it

    async def status_of(service: str, address: str) -> object | None:
        return replies.get(address)

    got = asyncio.run(regions.region_status(tmp_path, addresses, "a", status_of))
    assert got["a"] == {"served_version": 8, "weightsync_version": 9, "lag_versions": 1}
    assert got["b"] == {"served_version": 5, "weightsync_version": 7, "lag_versions": 4, "link": {"bytes_down": 123, "cuts": 1}}
    assert got["c"] == {"served_version": None, "weightsync_version": 9, "lag_versions": None, "link": None}
