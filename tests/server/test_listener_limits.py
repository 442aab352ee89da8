"""The HTTP port's limits, attacked with real sockets: heads over ``max_head_bytes`` in any
chunking, the deadline of a connection without a token, the cap on unauthenticated connections,
and readiness (``/healthz?ready=1``)."""

from __future__ import annotations

import random
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.faults.hostile import head_chunkings, oversized_head, status_after
from tests.server.live import TOKENS, ThreadServer, call, test_config

MAX_HEAD = 32 << 10


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ThreadServer]:
    config = test_config(
        tmp_path_factory.mktemp("limits"),
        max_head_bytes=MAX_HEAD,
        unauthenticated_timeout_s=1.0,
        max_unauthenticated_connections=8,
    )
    running = ThreadServer(config).start()
    yield running
    running.stop()


@pytest.mark.parametrize("size", [MAX_HEAD + 1, 40_800, 62_900, 128 << 10, 256 << 10])
def test_a_head_over_the_cap_is_refused_in_any_chunking(server: ThreadServer, size: int) -> None:
    rng = random.Random(size)
    data = oversized_head(TOKENS["alice"], size)
    assert len(data) >= size
    for name, chunks in head_chunkings(len(data), rng).items():
        status = status_after(server.port, data, chunks)
        assert status in (431, None), f"{size} bytes, {name}: answered {status}"


def test_a_head_over_the_cap_is_refused_byte_by_byte(server: ThreadServer) -> None:
    data = oversized_head(TOKENS["alice"], MAX_HEAD + 100)
    assert status_after(server.port, data, [1] * len(data)) in (431, None)


def test_a_head_under_the_cap_with_its_body_in_one_read_is_served(server: ThreadServer) -> None:
    data = oversized_head(TOKENS["alice"], MAX_HEAD - 200)
    assert status_after(server.port, data, [len(data)]) == 200


@pytest.mark.slow(reason="waits out an unauthenticated connection's deadline, then a read timeout")
def test_a_keep_alive_connection_without_a_token_is_closed_after_its_deadline(
    server: ThreadServer,
) -> None:
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        assert sock.recv(4096).startswith(b"HTTP/1.1 200")
        sock.settimeout(10)
        # The server ends it (keep-alive is 75 s): recv returns the end of stream.
        assert sock.recv(4096) == b""
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        auth = f"Authorization: Bearer {TOKENS['alice']}\r\n".encode()
        sock.sendall(b"GET /v1/stats HTTP/1.1\r\nHost: x\r\n" + auth + b"\r\n")
        assert sock.recv(65536).startswith(b"HTTP/1.1 200")
        sock.settimeout(2.5)  # past the 1 s deadline: a known connection stays open
        with pytest.raises(TimeoutError):
            sock.recv(4096)


def test_unauthenticated_connections_are_capped_oldest_first(server: ThreadServer) -> None:
    silent = [socket.create_connection(("127.0.0.1", server.port), timeout=5) for _ in range(12)]
    try:
        # The first four made room for the last four.
        for sock in silent[:4]:
            assert sock.recv(1) == b""
        status, _, _ = call(server.url, "GET", "/v1/stats", token=TOKENS["alice"])
        assert status == 200
        status, _, body = call(server.url, "GET", "/healthz?ready=1")
        assert status == 200, body
    finally:
        for sock in silent:
            sock.close()


def test_connections_shed_and_deadlines_are_counted(server: ThreadServer, tmp_path: Path) -> None:
    time.sleep(0.1)
    status, _, body = call(server.url, "GET", "/metrics", token=TOKENS["ops"])
    assert status == 200
    text = body.decode()
    assert 'cachetier_http_connections_shed_total{reason="unauthenticated_cap"}' in text
    assert "cachetier_listener_up{" in text
