"""The block transfer port against a real server: what the remote tier does over it, the
tenancy and limits it enforces, and what it does with bad or stalled clients (raw sockets)."""

from __future__ import annotations

import json
import os
import shutil
import socket
import struct
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from cachetier.errors import RequestRefusedError, TierUnavailableError
from cachetier.primitives.keys import KVLayout, Namespace
from cachetier.protocol.transfer_frames import REPLY, Op, Status, hello, request
from cachetier.record import encode_parts, encode_record
from cachetier.server.service import BlockService
from cachetier.server.transfer import TransferServer
from cachetier.store.config import build_store
from cachetier.tiers.remote import RemoteTier, RemoteTierConfig
from cachetier.tiers.remote.transfer import TransferClient, TransferPeer
from tests.server.live import TOKENS, ThreadServer, call, test_config
from tests.support import make_blocks

# 4 layers x K/V x 64 tokens x 2 heads x 64 dims, fp16: 128 KiB per block.
LAYOUT = KVLayout("float16", block_size=64, num_layers=4, num_kv_heads=2, head_dim=64)
NS = Namespace("transfer-model", LAYOUT)


@pytest.fixture
def server(tmp_path: Path) -> Iterator[ThreadServer]:
    srv = ThreadServer(test_config(tmp_path / "srv", transfer_port=0)).start()
    yield srv
    srv.stop()


def client_for(port: int, who: str = "alice", **options: object) -> TransferClient:
    """A transfer client with ``who``'s token (``options`` override any setting)."""
    settings: dict = dict(token=TOKENS[who], tenant=None, connect_timeout_s=1.0, timeout_s=2.0)
    limits: dict = dict(max_connections=4, max_record_bytes=1 << 20)
    for name, value in options.items():
        (limits if name in limits else settings)[name] = value
    return TransferClient(TransferPeer(("127.0.0.1", port), None, **settings), **limits)


def tier_for(server: ThreadServer, tenant: str = "alice", **options: object) -> RemoteTier:
    return RemoteTier(RemoteTierConfig(url=server.url, token=TOKENS[tenant], **options))  # type: ignore[arg-type]


def test_limits_name_the_port(server: ThreadServer) -> None:
    status, _, body = call(server.url, "GET", "/v1/limits")
    assert status == 200 and f'"transfer_port":{server.config.transfer_port}' in body.decode()


def test_the_tier_puts_and_gets_over_the_port_into_caller_buffers(server: ThreadServer) -> None:
    blocks = make_blocks(NS, 12)
    keys = [b.key for b in blocks]
    tier = tier_for(server)
    try:
        assert tier.put_many(NS.id, blocks) == 12
        dests = [memoryview(np.zeros(len(b.data), dtype=np.uint8)) for b in blocks]
        got = tier.get_into(NS.id, keys, dests)
        for block, dest, found in zip(blocks, dests, got, strict=True):
            assert found is not None and found.data is dest and bytes(dest) == block.data
        stats = tier.stats()
        assert (stats["puts"], stats["hits"], stats["errors"]) == (12, 12, 0)
        assert stats["bytes_out"] == sum(len(encode_record(b)) for b in blocks)
    finally:
        tier.close()
    # What went over the port is what HTTP serves.
    http_only = tier_for(server, transfer=False)
    try:
        assert [g and bytes(g.data) for g in http_only.get_many(NS.id, keys)] == [
            b.data for b in blocks
        ]
    finally:
        http_only.close()


def test_a_get_larger_than_the_server_budget_comes_in_several_answers(
    tmp_path: Path,
) -> None:
    # 40 blocks of 128 KiB against a 1 MiB batch budget: the server answers the leading ~8,
    # the tier asks again for the rest.
    config = test_config(tmp_path, transfer_port=0, max_batch_bytes=1 << 20)
    server = ThreadServer(config).start()
    blocks = make_blocks(NS, 40, seed=1)
    tier = tier_for(server)
    try:
        assert tier.put_many(NS.id, blocks) == 40
        assert [g and bytes(g.data) for g in tier.get_many(NS.id, [b.key for b in blocks])] == [
            b.data for b in blocks
        ]
    finally:
        tier.close()
        server.stop()


def test_tenants_are_apart_and_tokens_are_checked(server: ThreadServer) -> None:
    port = server.config.transfer_port
    assert port is not None
    blocks = make_blocks(NS, 3)
    alice, bob = client_for(port), client_for(port, "bob")
    try:
        assert alice.put(NS.id, [encode_parts(b) for b in blocks]) == 3
        assert bob.get(NS.id, [b.key for b in blocks]).blocks == [None] * 3
        with pytest.raises(RequestRefusedError, match="unauthorized"):
            client_for(port, token="not-a-token-of-anyone").get(NS.id, [blocks[0].key])
        with pytest.raises(RequestRefusedError, match="forbidden"):
            client_for(port, tenant="bob").get(NS.id, [blocks[0].key])  # alice's token
    finally:
        alice.close()
        bob.close()


def test_a_bad_record_refuses_the_whole_put_and_the_connection_stays_usable(
    server: ThreadServer,
) -> None:
    port = server.config.transfer_port
    assert port is not None
    good = make_blocks(NS, 2)
    other_model = make_blocks(Namespace("another-model", LAYOUT), 1)[0]
    flipped = bytearray(encode_record(good[1]))
    flipped[-3] ^= 1
    client = client_for(port, max_connections=1)  # one connection: the same one throughout
    try:
        # Under a Namespace.id, a record of another model is refused like a flipped byte.
        for bad in (encode_record(other_model), bytes(flipped)):
            with pytest.raises(RequestRefusedError, match="bad_request: record 1"):
                client.put(NS.id, [encode_parts(good[0]), [bad]])
        assert client.get(NS.id, [good[0].key]).blocks == [None]  # nothing of it was kept
        assert client.put(NS.id, [encode_parts(b) for b in good]) == 2
    finally:
        client.close()
    _, _, body = call(server.url, "GET", "/v1/stats", token=TOKENS["alice"])
    assert '"rejected":4' in body.decode()


def test_oversized_requests_are_refused_before_they_are_read(server: ThreadServer) -> None:
    port = server.config.transfer_port
    assert port is not None
    config = server.config
    with _raw(port) as sock:
        # More keys than max_batch_blocks: refused on the head alone, nothing else read.
        sock.sendall(request(Op.GET, NS.id, config.max_batch_blocks + 1))
        assert _reply(sock)[0] == Status.TOO_LARGE
    with _raw(port) as sock:
        sock.sendall(request(Op.PUT, NS.id, 1) + struct.pack("<Q", config.max_block_bytes + 1))
        assert _reply(sock)[0] == Status.TOO_LARGE
    with _raw(port) as sock:
        n = config.max_batch_bytes // config.max_block_bytes + 1
        lengths = struct.pack(f"<{n}Q", *[config.max_block_bytes] * n)
        sock.sendall(request(Op.PUT, NS.id, n) + lengths)
        assert _reply(sock)[0] == Status.TOO_LARGE


@pytest.mark.parametrize(
    "first_bytes, status",
    [
        (b"GET / HTTP/1.1\r\n\r\n", Status.BAD_REQUEST),  # an HTTP client on the wrong port
        (hello("x" * 16, None), Status.UNAUTHORIZED),
        (b"CTX1" + struct.pack("<HH", 5000, 0), Status.BAD_REQUEST),  # oversized token
    ],
)
def test_a_bad_hello_is_answered_and_closed(
    server: ThreadServer, first_bytes: bytes, status: Status
) -> None:
    port = server.config.transfer_port
    assert port is not None
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.sendall(first_bytes)
        assert _reply(sock)[0] == status
        assert sock.recv(1) == b""  # closed


@pytest.mark.parametrize(
    "body, status",
    [
        (struct.pack("<BBI", 9, 2, 0) + b"ns", Status.BAD_REQUEST),  # unknown op
        (struct.pack("<BBI", Op.GET, 4, 1) + b"a/b\n", Status.BAD_REQUEST),  # bad namespace
        (struct.pack("<BBI", Op.PUT, 2, 1) + b"ns" + struct.pack("<Q", 0), Status.BAD_REQUEST),
    ],
)
def test_malformed_requests_are_answered_and_closed(
    server: ThreadServer, body: bytes, status: Status
) -> None:
    port = server.config.transfer_port
    assert port is not None
    with _raw(port) as sock:
        sock.sendall(body)
        assert _reply(sock)[0] == status
        assert sock.recv(1) == b""


def test_stalled_and_idle_clients_are_dropped_and_stop_is_prompt(tmp_path: Path) -> None:
    config = test_config(tmp_path, open_mode=True)
    service = BlockService(config, build_store(config.store))
    transfer = TransferServer(service, "127.0.0.1", 0, idle_timeout_s=0.5, io_timeout_s=0.3)
    port = transfer.start().port
    assert port is not None
    try:
        with _raw(port, token=None) as idle:
            assert idle.recv(1) == b""  # nothing asked within idle_timeout_s: closed
        with _raw(port, token=None) as stalled:
            stalled.sendall(request(Op.PUT, "ns", 1) + struct.pack("<Q", 1000) + b"partial")
            assert stalled.recv(1) == b""  # the rest never came within io_timeout_s
        waiting = _raw(port, token=None)  # a connection open while the server stops
        start = time.monotonic()
        transfer.stop()
        assert time.monotonic() - start < 5
        assert waiting.recv(1) == b""
        waiting.close()
    finally:
        transfer.stop()
        service.close()


def test_connections_beyond_the_limit_are_told_busy(tmp_path: Path) -> None:
    server = ThreadServer(test_config(tmp_path, transfer_port=0, transfer_connections=1))
    server.start()
    port = server.config.transfer_port
    try:
        with _raw(port):
            with socket.create_connection(("127.0.0.1", port), timeout=5) as second:
                assert _reply(second)[0] == Status.BUSY
            client = client_for(port)
            with pytest.raises(TierUnavailableError, match="busy"):
                client.get(NS.id, [bytes(32)])
            client.close()
    finally:
        server.stop()


def test_a_server_restarted_on_another_port_is_found_again(tmp_path: Path) -> None:
    server = ThreadServer(test_config(tmp_path, transfer_port=0)).start()
    blocks = make_blocks(NS, 2)
    tier = tier_for(server)
    try:
        assert tier.put_many(NS.id, blocks) == 2
        # A new id and a new free port (a restart would keep the port port 0 became); the
        # blocks are on the server's disk.
        server.stop()
        server = server.with_config(transfer_port=0).start()
        # The first attempt fails on the old port; the retry reads /v1/limits again.
        got = tier.get_many(NS.id, [b.key for b in blocks])
        assert [g and bytes(g.data) for g in got] == [b.data for b in blocks]
        assert tier.stats()["retries"] >= 1
    finally:
        tier.close()
        server.stop()


@pytest.fixture
def short_dir() -> Iterator[Path]:
    """A folder with a short path: a Unix socket path must fit in 107 bytes."""
    path = Path(tempfile.mkdtemp(prefix="ct-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_a_same_host_client_uses_the_unix_socket(tmp_path: Path, short_dir: Path) -> None:
    sock_path = str(short_dir / "transfer.sock")
    server = ThreadServer(test_config(tmp_path, transfer_socket=sock_path)).start()
    blocks = make_blocks(NS, 6)
    tier = tier_for(server)
    try:
        _, _, body = call(server.url, "GET", "/v1/limits")
        limits = json.loads(body)
        assert (limits["transfer_port"], limits["transfer_socket"]) == (None, sock_path)
        assert tier.put_many(NS.id, blocks) == 6
        got = tier.get_many(NS.id, [b.key for b in blocks])
        assert [g and bytes(g.data) for g in got] == [b.data for b in blocks]
        assert tier.stats()["errors"] == 0
    finally:
        tier.close()
        server.stop()
    assert not os.path.exists(sock_path)  # removed on stop


def test_a_socket_of_another_server_is_refused(tmp_path: Path, short_dir: Path) -> None:
    sock_path = str(short_dir / "transfer.sock")
    server = ThreadServer(test_config(tmp_path, transfer_socket=sock_path)).start()
    try:
        _, _, body = call(server.url, "GET", "/v1/limits")
        server_id = json.loads(body)["transfer_id"]
        settings = dict(token=TOKENS["alice"], tenant=None, connect_timeout_s=1.0, timeout_s=2.0)
        limits = dict(max_connections=1, max_record_bytes=1 << 20)
        right = TransferClient(TransferPeer(sock_path, server_id, **settings), **limits)  # type: ignore[arg-type]
        assert right.get(NS.id, [bytes(32)]).blocks == [None]
        right.close()
        wrong = TransferClient(TransferPeer(sock_path, server_id ^ 1, **settings), **limits)  # type: ignore[arg-type]
        with pytest.raises(TierUnavailableError, match="another server"):
            wrong.get(NS.id, [bytes(32)])
        wrong.close()
    finally:
        server.stop()


def test_a_stale_socket_file_is_replaced_and_any_other_file_is_kept(
    tmp_path: Path, short_dir: Path
) -> None:
    config = test_config(tmp_path, open_mode=True)
    service = BlockService(config, build_store(config.store))
    try:
        stale = short_dir / "stale.sock"
        left = socket.socket(socket.AF_UNIX)
        left.bind(str(stale))  # bound, never listening: what a killed server leaves
        left.close()
        transfer = TransferServer(service, "127.0.0.1", None, str(stale))
        assert transfer.start().socket_path == str(stale)
        transfer.stop()
        precious = short_dir / "data.bin"
        precious.write_bytes(b"keep me")
        with pytest.raises(FileExistsError):
            TransferServer(service, "127.0.0.1", None, str(precious)).start()
        assert precious.read_bytes() == b"keep me"
    finally:
        service.close()


def test_transfers_stay_off_when_disabled() -> None:
    # An https url transfers too, over TLS, if the server says its port speaks it (test_tls.py).
    assert RemoteTierConfig(url="https://cache:8470").transfer_host == "cache"
    assert RemoteTierConfig(url="https://cache:8470", transfer=False).transfer_host is None
    assert RemoteTierConfig(url="http://cache:8470", transfer=False).transfer_host is None
    assert RemoteTierConfig(url="http://cache:8470").transfer_host == "cache"


class _raw:
    """A raw socket past a good hello (as alice, or open mode with ``token=None``)."""

    def __init__(self, port: int, token: str | None = TOKENS["alice"]) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=5)
        self.sock.sendall(hello(token, None))
        assert _reply(self.sock)[0] == Status.OK

    def __enter__(self) -> socket.socket:
        return self.sock

    def __exit__(self, *exc: object) -> None:
        self.sock.close()

    def recv(self, n: int) -> bytes:
        return self.sock.recv(n)

    def close(self) -> None:
        self.sock.close()


def _reply(sock: socket.socket) -> tuple[int, int]:
    head = b""
    while len(head) < REPLY.size:
        chunk = sock.recv(REPLY.size - len(head))
        assert chunk, "the server closed without a reply"
        head += chunk
    status, value = REPLY.unpack(head)
    if status != Status.OK:
        sock.recv(value)  # the message
    return status, value
