"""Records are immutable (a key names its KV): a put of a key the server holds keeps the first
record, and the answer says which records were stored and which were already present."""

from __future__ import annotations

import json
import socket
import struct
import threading
from collections.abc import Iterator

import numpy as np
import pytest

from cachetier.errors import TierUnavailableError
from cachetier.primitives.keys import Namespace
from cachetier.protocol.http_batch import RECORD_MEDIA_TYPE
from cachetier.protocol.transfer_frames import HELLO, REPLY, REQUEST, Status
from cachetier.record import KVBlock, encode_parts, encode_record
from cachetier.tiers.remote.transfer import TransferClient, TransferPeer
from tests.server.batches import put_batch, read_batch
from tests.server.live import TOKENS, ThreadServer, call, test_config
from tests.support import make_blocks

# Long enough for a loaded machine; a bad reply's test waits this long for nothing at most.
WAIT_S = 10.0


def _other_payload(block: KVBlock) -> KVBlock:
    """The same key with other bytes: what a client that lies (or a stale one) would send."""
    data = np.frombuffer(bytes(block.data), dtype=np.uint8) ^ 0xFF
    return KVBlock(
        block.key, block.fingerprint, block.dtype, block.shape, block.num_tokens, data.tobytes()
    )


def test_a_batch_put_says_which_keys_were_already_present_and_keeps_the_first_record(
    shared_server: ThreadServer, own_namespace: Namespace
) -> None:
    ns = own_namespace.id
    blocks = make_blocks(own_namespace, 4, seed=3)
    status, first = put_batch(shared_server.url, ns, blocks[:2])
    assert status == 200 and first["already_present"] == [False, False]
    assert first["num_already_present"] == 0 and first["num_stored"] == 2
    # Two held keys sent again with other payloads, and two new ones.
    again = [_other_payload(blocks[0]), blocks[2], _other_payload(blocks[1]), blocks[3]]
    status, second = put_batch(shared_server.url, ns, again)
    assert status == 200, second
    assert second["already_present"] == [True, False, True, False]
    assert second["num_already_present"] == 2 and second["num_stored"] == 4
    keys = {"keys": [b.key.hex() for b in blocks]}
    status, _, body = call(
        shared_server.url,
        "POST",
        f"/v1/namespaces/{ns}/batch/get",
        json.dumps(keys).encode(),
        token=TOKENS["alice"],
        content_type="application/json",
    )
    assert status == 200
    got = read_batch(body)
    # The first records are kept: the put of other bytes changed nothing.
    assert all(g is not None for g in got)
    assert [bytes(g) for g in got if g is not None] == [encode_record(b) for b in blocks]


def test_a_single_put_of_a_held_key_is_answered_as_already_present(
    shared_server: ThreadServer, own_namespace: Namespace
) -> None:
    block = make_blocks(own_namespace, 1, seed=4)[0]
    path = f"/v1/namespaces/{own_namespace.id}/blocks/{block.key.hex()}"
    answers = []
    for sent in (block, _other_payload(block)):
        status, _, body = call(
            shared_server.url,
            "PUT",
            path,
            encode_record(sent),
            token=TOKENS["alice"],
            content_type=RECORD_MEDIA_TYPE,
        )
        assert status == 200, body
        answers.append(body)
    first, second = (json.loads(a) for a in answers)
    assert first["already_present"] == [False] and second["already_present"] == [True]


@pytest.fixture(scope="module")
def transfer_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ThreadServer]:
    """A sidecar with a transfer port, for this module's transfer tests (own namespaces)."""
    config = test_config(tmp_path_factory.mktemp("put-answers"), transfer_port=0)
    server = ThreadServer(config).start()
    yield server
    server.stop()


def _client(port: int, timeout_s: float = WAIT_S) -> TransferClient:
    """Alice's transfer client with one connection (so every request reuses it)."""
    peer = TransferPeer(
        ("127.0.0.1", port),
        None,
        token=TOKENS["alice"],
        tenant=None,
        connect_timeout_s=WAIT_S,
        timeout_s=timeout_s,
    )
    return TransferClient(peer, max_connections=1, max_record_bytes=1 << 20)


def test_a_transfer_put_says_which_records_were_already_present(
    transfer_server: ThreadServer, own_namespace: Namespace
) -> None:
    port = transfer_server.config.transfer_port
    assert port is not None
    ns = own_namespace.id
    blocks = make_blocks(own_namespace, 5, seed=5)
    client = _client(port)
    try:
        first = client.put_reporting(ns, [encode_parts(b) for b in blocks[:3]])
        assert (first.stored, first.already_present) == (3, [False, False, False])
        # The three held ones (one with other bytes: the first record stays), then two new.
        again = [blocks[0], _other_payload(blocks[1]), blocks[2], blocks[3], blocks[4]]
        second = client.put_reporting(ns, [encode_parts(b) for b in again])
        assert (second.stored, second.already_present) == (5, [True, True, True, False, False])
        # Same connection (one in the pool): the flags were read to their end, so the next
        # exchange is in step.
        got = client.get(ns, [b.key for b in blocks])
        assert [g and bytes(g.data) for g in got.blocks] == [b.data for b in blocks]
        assert client.put_blocks(ns, blocks[3:]) == 2  # the count alone, as before
    finally:
        client.close()


class _BadPutServer:
    """A real socket server that speaks the transfer port's hello, then answers a put with a
    head that says OK and the flags ``flags``; closes after them if ``close``, else waits for
    the client to close (and records that it did)."""

    def __init__(self, flags: bytes, close: bool) -> None:
        self.flags = flags
        self.close = close
        self.client_closed = False
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(WAIT_S)
        self.port: int = self._listener.getsockname()[1]
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        conn, _ = self._listener.accept()
        with conn:
            conn.settimeout(WAIT_S)
            _, token_len, tenant_len = HELLO.unpack(_recv(conn, HELLO.size))
            _recv(conn, token_len + tenant_len)
            conn.sendall(REPLY.pack(Status.OK, 7))  # any server id: the client asks for none
            _, name_len, count = REQUEST.unpack(_recv(conn, REQUEST.size))
            lengths = struct.unpack(f"<{count}Q", _recv(conn, name_len + 8 * count)[name_len:])
            _recv(conn, sum(lengths))
            conn.sendall(REPLY.pack(Status.OK, count) + self.flags)
            if not self.close:
                try:
                    self.client_closed = conn.recv(1) == b""
                except TimeoutError:
                    self.client_closed = False

    def join(self) -> None:
        # Longer than any one of its waits (each WAIT_S at most), so that it has decided.
        self._thread.join(3 * WAIT_S)
        self._listener.close()


def _recv(conn: socket.socket, nbytes: int) -> bytes:
    out = b""
    while len(out) < nbytes:
        chunk = conn.recv(nbytes - len(out))
        assert chunk, "the client closed early"
        out += chunk
    return out


@pytest.mark.parametrize(
    "flags, close",
    [
        (b"\x00\x01", False),  # one flag short, the connection left open: the read times out
        (b"\x00\x01", True),  # one flag short, then closed
        (b"\x00\x02\x01", False),  # as many bytes as records, one of them not a flag
    ],
    ids=["short-open", "short-closed", "not-a-flag"],
)
def test_the_client_refuses_a_put_reply_with_bad_flags_and_drops_the_connection(
    own_namespace: Namespace, flags: bytes, close: bool
) -> None:
    server = _BadPutServer(flags, close)
    client = _client(server.port, timeout_s=0.5)
    try:
        records = [encode_parts(b) for b in make_blocks(own_namespace, 3, seed=6)]
        with pytest.raises(TierUnavailableError, match="put reply .*already-present flag"):
            client.put_reporting(own_namespace.id, records)
        server.join()  # before the client's close: the failed put itself dropped it
    finally:
        client.close()
        server.join()
    assert close or server.client_closed, "the client kept a connection that is out of step"
