"""The RESP bulk path against real Redis: records into the caller's buffers, staying in step
after misses, error replies and corrupt records, spreading a batch over connections, logging in,
Unix sockets, and dropping connections Redis closed. Garbage on the wire comes from a real TCP
listener that is not Redis (the one thing a real Redis never sends)."""

from __future__ import annotations

import socket
import threading
from pathlib import Path

import numpy as np
import pytest
import redis

from cachetier.primitives.keys import KVLayout, Namespace
from cachetier.record import Compression, KVBlock, encode_parts, encode_record
from cachetier.tiers.redis.resp import (
    CORRUPT,
    Endpoint,
    ErrorReply,
    Hit,
    RespClient,
    RespConnection,
    RespProtocolError,
    command,
)
from cachetier.util.tls import client_context
from tests.support import PrivateRedis, make_blocks

# 4 layers x K/V x 64 tokens x 2 heads x 64 dims, fp16: 128 KiB, above the connection's
# 64 KiB buffer, so payloads take the direct read into the destination.
BIG = KVLayout("float16", block_size=64, num_layers=4, num_kv_heads=2, head_dim=64)


def pool_for(url: str, streams: int = 4, timeout_s: float = 2.0) -> RespClient:
    endpoint = Endpoint.from_url(url, timeout_s, timeout_s)
    assert endpoint is not None
    return RespClient(endpoint, max_connections=8, streams=streams)


@pytest.fixture
def big_blocks() -> list[KVBlock]:
    return make_blocks(Namespace("resp-model", BIG), 9, seed=3)


def names(prefix: str, blocks: list[KVBlock]) -> list[bytes]:
    return [f"{prefix}:{b.key.hex()}".encode() for b in blocks]


@pytest.mark.parametrize("streams", [1, 4])
def test_set_then_get_into_buffers_keeps_order_and_bytes(
    redis_url: str, redis_prefix: str, big_blocks: list[KVBlock], streams: int
) -> None:
    pool = pool_for(redis_url, streams)
    skeys = names(redis_prefix, big_blocks)
    assert pool.set_records(skeys, lambda i: encode_parts(big_blocks[i]), None) == [True] * 9
    dests = [memoryview(np.zeros(len(b.data), dtype=np.uint8)) for b in big_blocks]
    got = pool.get_records(skeys, [b.key for b in big_blocks], dests)
    for block, dest, result in zip(big_blocks, dests, got, strict=True):
        assert isinstance(result, Hit)
        assert result.block.data is dest  # read straight into the caller's buffer
        assert bytes(dest) == block.data
        assert result.nbytes == len(encode_record(block))
    fresh = pool.get_records(skeys, [b.key for b in big_blocks])
    assert [bytes(r.block.data) for r in fresh if isinstance(r, Hit)] == [
        b.data for b in big_blocks
    ]
    pool.close()


def test_a_batch_stays_in_step_past_misses_errors_and_corrupt_records(
    redis_url: str, redis_prefix: str, raw: redis.Redis, big_blocks: list[KVBlock]
) -> None:
    pool = pool_for(redis_url, streams=1)  # one connection: every reply follows the last
    skeys = names(redis_prefix, big_blocks)
    records = [encode_record(b) for b in big_blocks]
    for skey, record in zip(skeys, records):
        raw.set(skey, record)
    raw.delete(skeys[1])  # a miss
    raw.delete(skeys[2])
    raw.rpush(skeys[2], b"x")  # a list: GET answers WRONGTYPE, an error reply
    flipped = bytearray(records[3])
    flipped[-5] ^= 0x40
    raw.set(skeys[3], bytes(flipped))  # fails its checksum
    raw.set(skeys[4], records[5])  # another key's record
    raw.set(skeys[6], b"not a record at all")
    raw.set(skeys[7], records[7][:-100])  # truncated
    got = pool.get_records(skeys, [b.key for b in big_blocks])
    assert got[1] is None
    assert isinstance(got[2], ErrorReply) and "WRONGTYPE" in got[2].message
    assert [got[i] for i in (3, 4, 6, 7)] == [CORRUPT] * 4
    for i in (0, 5, 8):
        result = got[i]
        assert isinstance(result, Hit) and bytes(result.block.data) == big_blocks[i].data
    # The connection is still in step: the next exchange on it reads its own replies.
    again = pool.get_records(skeys[:1], [big_blocks[0].key])
    assert isinstance(again[0], Hit)
    pool.close()


def test_a_compressed_record_and_a_wrong_sized_destination_come_back_fresh(
    redis_url: str, redis_prefix: str, big_blocks: list[KVBlock]
) -> None:
    pool = pool_for(redis_url)
    zeros = KVBlock(
        big_blocks[0].key,
        big_blocks[0].fingerprint,
        "float16",
        big_blocks[0].shape,
        64,
        bytes(len(big_blocks[0].data)),
    )
    blocks = [zeros, big_blocks[1]]
    skeys = names(redis_prefix, blocks)
    records = [encode_parts(zeros, Compression.LZ4), encode_parts(blocks[1])]
    pool.set_records(skeys, records.__getitem__, None)
    dests = [memoryview(bytearray(len(zeros.data))), memoryview(bytearray(10))]
    got = pool.get_records(skeys, [b.key for b in blocks], dests)
    assert all(isinstance(r, Hit) for r in got)
    assert [r.block.data is d for r, d in zip(got, dests)] == [False, False]  # type: ignore[union-attr]
    assert [bytes(r.block.data) for r in got] == [b.data for b in blocks]  # type: ignore[union-attr]
    pool.close()


def test_set_with_expiry_and_a_refused_set(
    tmp_path: Path, redis_prefix: str, big_blocks: list[KVBlock]
) -> None:
    server = PrivateRedis(tmp_path)
    server.start()
    try:
        client = redis.Redis.from_url(server.url)
        pool = pool_for(server.url, streams=1)
        skeys = names(redis_prefix, big_blocks[:2])
        parts = [encode_parts(b) for b in big_blocks[:2]]
        assert pool.set_records(skeys[:1], parts.__getitem__, px_ms=60_000) == [True]
        assert 0 < client.pttl(skeys[0]) <= 60_000
        client.config_set("maxmemory", 1)  # every further write is refused (noeviction)
        [refused] = pool.set_records(skeys[1:], parts[1:].__getitem__, None)
        assert isinstance(refused, ErrorReply) and refused.message.startswith("OOM")
        client.config_set("maxmemory", 0)
        assert pool.set_records(skeys[1:], parts[1:].__getitem__, None) == [True]  # still in step
        pool.close()
        client.close()
    finally:
        server.stop()


def test_password_and_unix_socket(tmp_path: Path, big_blocks: list[KVBlock]) -> None:
    server = PrivateRedis(tmp_path, password="s3cret pass")
    server.start()
    try:
        urls = [
            f"redis://:s3cret%20pass@127.0.0.1:{server.port}/2",
            f"unix://:s3cret%20pass@{server.socket_path}?db=2",
        ]
        for url in urls:
            pool = pool_for(url)
            assert pool.set_records([b"k"], lambda _: encode_parts(big_blocks[0]), None) == [True]
            [hit] = pool.get_records([b"k"], [big_blocks[0].key])
            assert isinstance(hit, Hit)
            pool.close()
        client = redis.Redis(port=server.port, password="s3cret pass", db=2)
        assert client.exists(b"k") == 1  # it was SELECTed into db 2
        client.close()
        wrong = pool_for(f"redis://:nope@127.0.0.1:{server.port}/0")
        with pytest.raises(RespProtocolError, match="refused the login"):
            wrong.get_records([b"k"], [big_blocks[0].key])
        wrong.close()
    finally:
        server.stop()


def test_a_connection_redis_closed_is_replaced(
    redis_url: str, redis_prefix: str, raw: redis.Redis, big_blocks: list[KVBlock]
) -> None:
    pool = pool_for(redis_url, streams=1)
    skeys = names(redis_prefix, big_blocks[:1])
    pool.set_records(skeys, lambda _: encode_parts(big_blocks[0]), None)
    with pool.connection() as conn:
        conn.io.send([command("CLIENT", "SETNAME", "resp-victim")])
        assert conn.read_line() == b"+OK"
    victims = [c["id"] for c in raw.client_list() if c.get("name") == "resp-victim"]
    assert len(victims) == 1
    raw.client_kill_filter(_id=victims[0])
    [hit] = pool.get_records(skeys, [big_blocks[0].key])  # a new connection, no error
    assert isinstance(hit, Hit)
    pool.close()


def test_a_url_over_tls_needs_a_tls_context_and_hides_its_password() -> None:
    # rediss:// runs the bulk path over TLS (tests/cachetier/test_redis_tls.py), never plaintext.
    with pytest.raises(ValueError, match="TLS context"):
        Endpoint.from_url("rediss://127.0.0.1:6379/0", 1, 1)
    with pytest.raises(ValueError, match="rediss://"):
        Endpoint.from_url("redis://127.0.0.1:6379/0", 1, 1, client_context())
    endpoint = Endpoint.from_url("rediss://:hunter2-pw@127.0.0.1:6379/0", 1, 1, client_context())
    assert endpoint.tls is not None and endpoint.password == "hunter2-pw"
    assert "hunter2" not in repr(endpoint)


class Liar:
    """A TCP listener that answers every connection with fixed bytes, then idles."""

    def __init__(self, answer: bytes) -> None:
        self._answer = answer
        self._server = socket.create_server(("127.0.0.1", 0))
        self.port = self._server.getsockname()[1]
        self._conns: list[socket.socket] = []
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self._server.accept()
            except OSError:
                return
            self._conns.append(conn)
            conn.sendall(self._answer)

    def close(self) -> None:
        self._server.close()
        for conn in self._conns:
            conn.close()


@pytest.mark.parametrize(
    "answer, error",
    [
        (b"*1\r\n$3\r\nabc\r\n", RespProtocolError),  # not a bulk string
        (b"$abc\r\n", RespProtocolError),  # a bad length
        (b"$-7\r\n", RespProtocolError),
        (b"$999999999999\r\n", RespProtocolError),  # longer than any record
        (b"$4\r\nabcdXY", RespProtocolError),  # no CRLF after the bulk
        (b"+" + b"x" * 70_000, RespProtocolError),  # a line without end
        (b"$100\r\nshort", TimeoutError),  # then silence: the socket timeout ends the wait
        (b"", TimeoutError),  # silence
    ],
)
def test_garbage_or_silence_raises_and_drops_the_connection(
    answer: bytes, error: type[Exception]
) -> None:
    liar = Liar(answer)
    pool = pool_for(f"redis://127.0.0.1:{liar.port}/0", streams=1, timeout_s=0.3)
    try:
        with pytest.raises(error):
            pool.get_records([b"k"], [bytes(32)])
        assert pool.num_idle == 0  # a connection out of step is never reused
    finally:
        pool.close()
        liar.close()


def test_a_connection_closed_mid_reply_is_an_error_not_a_corrupt_record() -> None:
    liar = Liar(b"$100\r\nshort")
    liar_closes = threading.Timer(0.05, liar.close)
    liar_closes.start()
    pool = pool_for(f"redis://127.0.0.1:{liar.port}/0", streams=1, timeout_s=2)
    try:
        with pytest.raises(ConnectionError):
            pool.get_records([b"k"], [bytes(32)])
    finally:
        liar_closes.join()
        pool.close()


def test_send_survives_partial_writes(redis_url: str, redis_prefix: str) -> None:
    # 600 buffers (more than one sendmsg takes) of mixed sizes, then one reply per SET.
    pool = pool_for(redis_url, streams=1)
    conn = RespConnection(pool.endpoint)
    try:
        parts: list[bytes | memoryview] = []
        values = [bytes([i % 251]) * (1 + (i * 7919) % 300_000) for i in range(200)]
        for i, value in enumerate(values):
            key = f"{redis_prefix}:p{i}".encode()
            parts += [b"*3\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$%d\r\n" % (len(key), key, len(value))]
            parts += [memoryview(value), b"\r\n"]
        conn.io.send(parts)
        assert all(conn.read_line() == b"+OK" for _ in values)
        client = redis.Redis.from_url(redis_url)
        assert client.get(f"{redis_prefix}:p199") == values[199]
        client.close()
    finally:
        conn.close()
        pool.close()


class PatientServer:
    """A TCP listener that answers GETs with misses only once the client has stopped sending
    for a moment, and records how many GETs were waiting then (the client's pipeline depth)."""

    def __init__(self) -> None:
        self.most_waiting = 0
        self._server = socket.create_server(("127.0.0.1", 0))
        self.port = self._server.getsockname()[1]
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        conn, _ = self._server.accept()
        conn.settimeout(0.05)
        waiting = 0
        while True:
            try:
                data = conn.recv(1 << 16)
                if not data:
                    return
                waiting += data.count(b"$3\r\nGET\r\n")
                continue
            except TimeoutError:
                pass  # quiet: the client waits for answers
            if waiting:
                self.most_waiting = max(self.most_waiting, waiting)
                conn.sendall(b"$-1\r\n" * waiting)
                waiting = 0

    def close(self) -> None:
        self._server.close()


def test_gets_are_pipelined_a_bounded_window_at_a_time() -> None:
    # Unbounded, Redis would copy every reply of the batch before writing the first byte: for
    # 256 SmolLM2 blocks in an engine restore that took longer than the socket timeout.
    server = PatientServer()
    pool = pool_for(f"redis://127.0.0.1:{server.port}/0", streams=1)
    try:
        got = pool.get_records([b"k%d" % i for i in range(100)], [bytes(32)] * 100)
        assert got == [None] * 100
        assert 0 < server.most_waiting <= 16  # this window and the next (8 keys each)
    finally:
        pool.close()
        server.close()
