"""Shared pieces of the hostile-client tests (``test_hostile_*.py``): a real server with short
deadlines, raw HTTP and transfer-port sockets that can lie, and the figures they report.

The figures (``tests/faults/conftest.py``): ``hostile_inputs``, ``hostile_5xx``,
``decompressed_over_limit_accepted``, ``unauthenticated_body_bytes_read_max``,
``slow_client_max_open_s`` against ``slow_client_deadline_s``, and
``authenticated_clients_refused_during_flood``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import random
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from cachetier.protocol.transfer_frames import REPLY, Op, Status, hello, request
from cachetier.record import Compression, KVBlock, encode_record
from cachetier.server.config import ServerConfig
from tests.faults.conftest import FaultFigures
from tests.faults.fuzzing import FUZZ_NS, reseal
from tests.server.live import TOKENS, ThreadServer, call, test_config

ALICE = TOKENS["alice"]
DEADLINE_S = 2.0  # every deadline of the hostile server: head, body, idle, hello
SLACK_S = 1.0  # how much later than its deadline a connection may be closed
WAIT_S = DEADLINE_S + 5.0  # longest a test waits for the server to act


def hostile_config(folder: Path, **overrides: Any) -> ServerConfig:
    """``test_config`` with the transfer port on and every deadline ``DEADLINE_S``."""
    values: dict[str, Any] = dict(
        transfer_port=0,  # the OS picks; server.config.transfer_port says which
        head_timeout_s=DEADLINE_S,
        body_timeout_s=DEADLINE_S,
        idle_timeout_s=DEADLINE_S,
        transfer_hello_timeout_s=DEADLINE_S,
        transfer_connections=8,
        transfer_unauthenticated_connections=8,
    )
    values.update(overrides)
    return test_config(folder, **values)


def max_figure(figures: FaultFigures, name: str, value: float) -> None:
    """Keep the largest value any test reported under ``name``."""
    figures.set(name, max(figures.values.get(name, 0), value))


def min_figure(figures: FaultFigures, name: str, value: float) -> None:
    """Keep the smallest value any test reported under ``name``."""
    figures.set(name, min(figures.values.get(name, value), value))


def metric(server: ThreadServer, name: str) -> float:
    """One sample of the server's Prometheus metrics (read as the admin tenant), 0 if absent."""
    status, _, body = call(server.url, "GET", "/metrics", token=TOKENS["ops"])
    assert status == 200, body[:200]
    for line in body.decode().splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def rejected(server: ThreadServer, tenant: str = "alice") -> int:
    """The ``rejected`` count of a tenant (uploads that failed their checks)."""
    status, _, body = call(server.url, "GET", "/v1/stats", token=TOKENS[tenant])
    assert status == 200, body[:200]
    return int(json.loads(body)["tenants"][tenant]["rejected"])


def http_head(method: str, path: str, headers: dict[str, str]) -> bytes:
    """A raw request head (the caller adds any Content-Length or Transfer-Encoding)."""
    lines = [f"{method} {path} HTTP/1.1", "Host: 127.0.0.1"]
    lines += [f"{name}: {value}" for name, value in headers.items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


def read_status(sock: socket.socket) -> int | None:
    """The status of the first answer on ``sock``, ``None`` if it closed without one."""
    got = b""
    while b"\r\n" not in got and len(got) < 4096:
        try:
            chunk = sock.recv(4096)
        except (ConnectionResetError, TimeoutError):
            return None
        if not chunk:
            return None
        got += chunk
    parts = got.split(b" ", 2)
    assert parts[0].startswith(b"HTTP/1."), got[:100]
    return int(parts[1])


def http_exchange(
    port: int,
    data: bytes,
    *,
    half_close: bool = False,
    read: Callable[[socket.socket], Any] = read_status,
) -> Any:
    """Send ``data`` as it is, then read the answer with ``read`` (by default the first
    answer's status, ``None`` if the server closed without answering).

    Args:
        port: the server's HTTP port.
        data: the bytes to send, head and body.
        half_close: end the sending side after ``data`` (for a body that promised more than it
            holds: the server sees it end instead of waiting out its deadline). uvicorn closes
            a connection whose client ended its side, answered or not.
        read: what to read back (``read_to_end`` for every answer until the server closes).
    """
    with socket.create_connection(("127.0.0.1", port), timeout=WAIT_S) as sock:
        try:
            sock.sendall(data)
            if half_close:
                sock.shutdown(socket.SHUT_WR)
        except OSError:
            pass  # the server answered and closed while this was sending: read it
        return read(sock)


def read_to_end(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes (or resets, or the timeout passes)."""
    data = b""
    try:
        while chunk := sock.recv(1 << 16):
            data += chunk
    except (ConnectionResetError, TimeoutError):
        pass
    return data


def time_until_closed(
    sock: socket.socket, feed: Callable[[socket.socket, threading.Event], None] | None = None
) -> float:
    """Seconds from now until the server closes ``sock`` (end of stream or reset), while
    ``feed`` sends on it from another thread; at most ``WAIT_S``.

    Args:
        sock: a connected socket.
        feed: sends on ``sock`` until the event is set or a send fails; ``None``: silence.
    """
    start = time.monotonic()
    stop = threading.Event()
    feeder = None
    if feed is not None:
        feeder = threading.Thread(target=feed, args=(sock, stop), daemon=True)
        feeder.start()
    sock.settimeout(0.05)
    try:
        while time.monotonic() - start < WAIT_S:
            try:
                if not sock.recv(65536):
                    break
            except TimeoutError:
                continue
            except OSError:
                break  # reset: closed all the same
        return time.monotonic() - start
    finally:
        stop.set()
        if feeder is not None:
            feeder.join(WAIT_S)


def trickle(data: bytes, every_s: float = 1.0) -> Callable[[socket.socket, threading.Event], None]:
    """A ``feed`` that sends ``data`` one byte every ``every_s`` seconds."""

    def feed(sock: socket.socket, stop: threading.Event) -> None:
        for i in range(len(data)):
            if stop.wait(0 if i == 0 else every_s):
                return
            try:
                sock.send(data[i : i + 1])
            except OSError:
                return

    return feed


def transfer_reply(sock: socket.socket) -> tuple[int, bytes] | None:
    """The next reply on a transfer connection, ``None`` if it closed (or reset) first."""
    head = read_exactly(sock, REPLY.size)
    if head is None:
        return None
    status, value = REPLY.unpack(head)
    if status == Status.OK:
        return status, b""
    return status, read_exactly(sock, value) or b""


def read_exactly(sock: socket.socket, nbytes: int) -> bytes | None:
    """``nbytes`` from ``sock``, ``None`` if it closed, reset or went quiet first."""
    out = b""
    while len(out) < nbytes:
        try:
            chunk = sock.recv(nbytes - len(out))
        except (ConnectionResetError, TimeoutError):
            return None
        if not chunk:
            return None
        out += chunk
    return out


def transfer_session(port: int, token: str | None = ALICE) -> socket.socket:
    """A transfer connection past a good hello (asserts it was accepted)."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=WAIT_S)
    sock.sendall(hello(token, None))
    got = transfer_reply(sock)
    assert got is not None and got[0] == Status.OK, got
    return sock


def transfer_put(sock: socket.socket, namespace: str, records: list[bytes]) -> tuple[int, bytes]:
    """A put over a session; returns its reply (asserts there was one), its already-present
    flags read so that the session stays in step."""
    lengths = b"".join(len(r).to_bytes(8, "little") for r in records)
    sock.sendall(request(Op.PUT, namespace, len(records)) + lengths + b"".join(records))
    got = transfer_reply(sock)
    assert got is not None, "the server closed instead of answering the put"
    if got[0] == Status.OK:
        flags = read_exactly(sock, len(records))  # one per record
        assert flags is not None, "the server closed inside the put reply's flags"
    return got


def bomb(block: KVBlock, raw_len: int | None = None) -> bytes:
    """An lz4 record of ``block`` made of zeros; with ``raw_len``, its header claims that
    decompressed size instead (and a shape that matches it), resealed so that its checksum
    passes: the lie reaches the size checks.

    Args:
        block: gives the key, fingerprint, dtype and shape (its payload is replaced by zeros).
        raw_len: the raw length to claim, ``None`` for the true one.
    """
    zeros = dataclasses.replace(block, data=bytes(len(block.data)))
    record = bytearray(encode_record(zeros, Compression.LZ4))
    assert record[6] == Compression.LZ4, "zeros compress"
    if raw_len is not None:
        ndim = len(block.shape)
        record[90:98] = raw_len.to_bytes(8, "little")
        width = len(block.data) // max(1, math.prod(block.shape))
        record[98:106] = (raw_len // width).to_bytes(8, "little")
        for dim in range(1, ndim):
            record[98 + 8 * dim : 106 + 8 * dim] = (1).to_bytes(8, "little")
        reseal(record, 98 + 8 * ndim)
    return bytes(record)


def zeros_block(num_bytes: int, seed_block: KVBlock) -> KVBlock:
    """A float16 block of ``num_bytes`` zero bytes with ``seed_block``'s key and fingerprint
    (a payload lz4 shrinks about 250 times)."""
    return KVBlock(
        seed_block.key,
        FUZZ_NS.fingerprint,
        "float16",
        (num_bytes // 2,),
        seed_block.num_tokens,
        bytes(num_bytes),
    )


def oversized_head(token: str, size: int) -> bytes:
    """A GET head of ``size`` bytes with a valid token, padded with one long header."""
    start = b"GET /v1/stats HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + token.encode()
    filler = b"\r\nX-Pad: " + b"a" * max(0, size - len(start) - 13) + b"\r\n\r\n"
    return start + filler


def status_after(port: int, data: bytes, chunks: list[int]) -> int | None:
    """Send ``data`` to an HTTP port in ``chunks`` and read the status of the answer
    (``None`` if the connection closed without one)."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        at = 0
        try:
            for size in chunks:
                sock.sendall(data[at : at + size])
                at += size
        except OSError:
            pass  # refused and closed while sending: read the answer
        got = b""
        try:
            while b"\r\n" not in got:
                chunk = sock.recv(4096)
                if not chunk:
                    return None
                got += chunk
        except (ConnectionResetError, TimeoutError):
            return None
        return int(got.split(b" ", 2)[1])


def head_chunkings(n: int, rng: random.Random) -> dict[str, list[int]]:
    """Ways to send ``n`` bytes: in one read, in random chunks, and 64 bytes at a time."""
    randoms = []
    left = n
    while left:
        randoms.append(min(left, rng.randint(1, 9000)))
        left -= randoms[-1]
    return {"one_read": [n], "random": randoms, "small": [64] * (n // 64) + [n % 64]}
