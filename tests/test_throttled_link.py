"""The slow link the cost-model tests stand on: bytes pass unchanged, and it is never faster
than its bandwidth and latency allow (lower bounds on time only: a busy machine is slower, never
faster)."""

from __future__ import annotations

import os
import socket
import socketserver
import threading
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest
import redis

from tests.support import refusing_port
from tests.throttled_link import SlowLink


class _Echo(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        while data := self.request.recv(1 << 16):
            self.request.sendall(data)


@pytest.fixture(scope="module")
def echo() -> Iterator[tuple[str, int]]:
    server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), _Echo)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server.server_address  # type: ignore[misc]
    server.shutdown()
    server.server_close()


def _round_trip(port: int, payload: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sender = threading.Thread(target=sock.sendall, args=(payload,))
        sender.start()
        got = bytearray()
        while len(got) < len(payload):
            chunk = sock.recv(1 << 16)
            assert chunk, "the link closed early"
            got += chunk
        sender.join()
        sock.shutdown(socket.SHUT_WR)
        assert sock.recv(1) == b""  # our half-close reached the echo server and came back
    return bytes(got)


def test_bytes_pass_unchanged_both_ways_on_many_connections(echo: tuple[str, int]) -> None:
    payloads = [os.urandom(size) for size in (1, 1000, 3 << 20, 1 << 20) * 4]
    with SlowLink(echo) as link, ThreadPoolExecutor(8) as pool:
        got = list(pool.map(lambda p: _round_trip(link.port, p), payloads))
        assert got == payloads
        assert link.bytes_forwarded == 2 * sum(len(p) for p in payloads)


def test_redis_works_through_the_link(redis_url: str) -> None:
    key = f"slow-link-{uuid.uuid4().hex}"
    host, port = redis_url.split("//")[1].split("/")[0].split(":")
    value = os.urandom(1 << 20)
    with SlowLink((host, int(port)), 50e6, 0.001) as link:
        client = redis.Redis.from_url(link.url("redis"))
        try:
            client.set(key, value)
            assert client.get(key) == value
        finally:
            client.delete(key)
            client.close()


def test_a_throttled_transfer_takes_at_least_its_serialization_time(
    echo: tuple[str, int],
) -> None:
    payload = os.urandom(2 << 20)
    with SlowLink(echo, bandwidth_bytes_per_s=4e6) as link:
        start = time.perf_counter()
        assert _round_trip(link.port, payload) == payload
        # 2 MiB each way at 4 MB/s: the two directions overlap, so at least one direction's
        # 0.52 s.
        assert time.perf_counter() - start >= 0.5


def test_latency_is_paid_each_way_but_once_per_stream(echo: tuple[str, int]) -> None:
    with SlowLink(echo, latency_s=0.05) as link:
        with socket.create_connection(("127.0.0.1", link.port)) as sock:
            start = time.perf_counter()
            sock.sendall(b"ping")
            assert sock.recv(4) == b"ping"
            assert time.perf_counter() - start >= 0.1  # 50 ms there, 50 ms back
        # 64 chunks pipelined: still about one round trip, not 64 of them.
        payload = os.urandom(64 << 16)
        start = time.perf_counter()
        assert _round_trip(link.port, payload) == payload
        assert time.perf_counter() - start >= 0.1


def test_set_changes_the_pace(echo: tuple[str, int]) -> None:
    payload = os.urandom(1 << 20)
    with SlowLink(echo, bandwidth_bytes_per_s=1e9) as link:
        assert _round_trip(link.port, payload) == payload
        link.set(bandwidth_bytes_per_s=2e6, latency_s=0.0)
        start = time.perf_counter()
        assert _round_trip(link.port, payload) == payload
        assert time.perf_counter() - start >= 0.5
        with pytest.raises(ValueError):
            link.set(bandwidth_bytes_per_s=-1, latency_s=0)


def test_exit_does_not_wait_for_idle_clients(echo: tuple[str, int]) -> None:
    link = SlowLink(echo, latency_s=0.01)
    with link:
        idle = socket.create_connection(("127.0.0.1", link.port))
        idle.sendall(b"x")
        assert idle.recv(1) == b"x"
    # Back promptly: the idle connection was closed under the client, not waited for.
    idle.settimeout(5)
    assert idle.recv(1) == b""
    idle.close()


def test_a_target_that_refuses_closes_the_client() -> None:
    with refusing_port() as dead_port:
        with SlowLink(("127.0.0.1", dead_port)) as link:
            with socket.create_connection(("127.0.0.1", link.port)) as sock:
                sock.settimeout(5)
                try:
                    assert sock.recv(1) == b""
                except ConnectionResetError:
                    pass  # closed with a reset: also a clean refusal
