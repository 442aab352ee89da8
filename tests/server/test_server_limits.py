"""Bad input: malformed, truncated, oversized and forged requests get a 4xx with a JSON error
that says what is wrong; never a 500, never a stored bad block. And the server's own bounds:
every body's size by its route, bytes in flight over all requests (503 / ``BUSY`` past them),
the write queues in bytes, and the transfer port's budget of connections before their hello.
(The hostile clients themselves, and what they are measured at: ``tests/faults``.)"""

from __future__ import annotations

import http.client
import json
import socket
import struct
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cachetier.primitives.keys import KVLayout, Namespace
from cachetier.protocol.http_batch import BATCH_MAGIC, BATCH_MEDIA_TYPE
from cachetier.protocol.transfer_frames import REPLY, Op, Status, hello, request
from cachetier.record import FORMAT_VERSION, KVBlock, encode_record, reseal
from tests.server.batches import batch_body, get_batch
from tests.server.live import TOKENS, ThreadServer, call, call_json, test_config
from tests.support import SMALL_LAYOUT, make_blocks

ALICE = TOKENS["alice"]


def post_batch(server: ThreadServer, ns: str, body: bytes, **kw: object) -> tuple[int, dict]:
    kw.setdefault("content_type", BATCH_MEDIA_TYPE)
    status, headers, answer = call(
        server.url, "POST", f"/v1/namespaces/{ns}/batch/put", body, token=ALICE, **kw
    )
    assert headers["content-type"] == "application/json", answer[:200]
    return status, json.loads(answer)


def frame(records: list[bytes]) -> bytes:
    head = struct.pack(f"<4sI{len(records)}Q", BATCH_MAGIC, len(records), *map(len, records))
    return head + b"".join(records)


def nothing_stored(server: ThreadServer, ns: Namespace, blocks: list[KVBlock]) -> bool:
    return get_batch(server.url, ns.id, [b.key for b in blocks]) == [None] * len(blocks)


def rechecksummed(record: bytearray) -> bytes:
    """``record`` with its checksum recomputed: a forgery that passes the checksum."""
    reseal(record)
    return bytes(record)


def test_malformed_batches_are_refused_and_nothing_is_stored(
    shared_server: ThreadServer, own_namespace: Namespace
) -> None:
    blocks = make_blocks(own_namespace, 3)
    good = batch_body(blocks)
    records = [encode_record(b) for b in blocks]
    flipped = bytearray(records[1])
    flipped[len(flipped) // 2] ^= 0x01
    cases = {
        "truncated": (good[:-5], 400, "ended after"),
        "trailing bytes": (good + b"x", 400, "after its 3 records"),
        "bad magic": (b"XXXX" + good[4:], 400, "must start with"),
        "only a head": (good[:6], 400, "inside its head"),
        "flipped byte": (
            frame([records[0], bytes(flipped), records[2]]),
            400,
            "record 1: record checksum",
        ),
        "empty record": (frame([records[0], b""]), 400, "record 1: it is empty"),
        "garbage record": (frame([records[0], b"CTKV" + b"\0" * 200]), 400, "record 1"),
    }
    for name, (body, status, says) in cases.items():
        got, answer = post_batch(shared_server, own_namespace.id, body)
        assert (got, answer["error"][:4]) == (status, "bad_"), (name, answer)
        assert says in answer["message"], (name, answer)
    assert nothing_stored(shared_server, own_namespace, blocks)
    _, stats = call_json(shared_server.url, "GET", "/v1/stats", token=ALICE)
    assert stats["tenants"]["alice"]["rejected"] >= 7  # the records of the last three cases


def test_oversized_requests_are_refused_before_they_are_read(
    shared_server: ThreadServer, own_namespace: Namespace
) -> None:
    limits = shared_server.config
    big_layout = KVLayout("float16", block_size=256, num_layers=8, num_kv_heads=2, head_dim=64)
    big_ns = Namespace(own_namespace.model_fingerprint, big_layout)
    big = make_blocks(big_ns, 1)[0]  # 1 MiB of payload: over max_block_bytes with its header
    assert len(encode_record(big)) > limits.max_block_bytes
    status, answer = post_batch(shared_server, big_ns.id, batch_body([big]))
    assert status == 413 and "record 0 is" in answer["message"]
    huge_count = struct.pack("<4sI", BATCH_MAGIC, limits.max_batch_blocks + 1)
    status, answer = post_batch(shared_server, own_namespace.id, huge_count)
    assert status == 413 and "records, at most" in answer["message"]
    # A head promising more than max_batch_bytes is refused without reading what follows.
    liar = struct.pack("<4sI4Q", BATCH_MAGIC, 4, *([limits.max_block_bytes] * 4))
    status, answer = post_batch(shared_server, own_namespace.id, liar)
    assert status == 413 and "at most" in answer["message"]
    status, answer = post_batch(
        shared_server, own_namespace.id, b"", headers={"Content-Length": str(1 << 40)}
    )
    assert status == 413
    path = f"/v1/namespaces/{big_ns.id}/blocks/{big.key.hex()}"
    status, _, body = call(
        shared_server.url,
        "PUT",
        path,
        encode_record(big),
        token=ALICE,
        content_type="application/octet-stream",
    )
    assert status == 413 and b"too_large" in body
    keys = {"keys": ["00" * 32] * (limits.max_keys + 1)}
    status, _, body = call(
        shared_server.url,
        "POST",
        f"/v1/namespaces/{own_namespace.id}/lookup",
        json.dumps(keys).encode(),
        token=ALICE,
        content_type="application/json",
    )
    assert status == 413 and b"at most" in body


def test_a_chunked_upload_is_cut_off_at_the_limit(
    shared_server: ThreadServer, own_namespace: Namespace
) -> None:
    limit = shared_server.config.max_batch_bytes
    chunk = struct.pack("<4sI", BATCH_MAGIC, 1) + struct.pack("<Q", 1000) + b"\0" * 1000
    conn = http.client.HTTPConnection("127.0.0.1", shared_server.config.port, timeout=30)
    body = iter([chunk] + [b"\0" * (1 << 20)] * (limit // (1 << 20) + 2))
    try:
        conn.request(
            "POST",
            f"/v1/namespaces/{own_namespace.id}/batch/put",
            body=body,
            encode_chunked=True,
            headers={"Authorization": f"Bearer {ALICE}", "Content-Type": BATCH_MEDIA_TYPE},
        )
        status = conn.getresponse().status
    except (BrokenPipeError, ConnectionResetError):
        status = 413  # the server answered and hung up before the client had sent it all
    finally:
        conn.close()
    assert status in (400, 413)
    assert call(shared_server.url, "GET", "/healthz")[0] == 200


def test_forged_records_are_refused(shared_server: ThreadServer, own_namespace: Namespace) -> None:
    block = make_blocks(own_namespace, 1)[0]
    record = bytearray(encode_record(block))
    newer = bytearray(record)
    newer[4:6] = struct.pack("<H", FORMAT_VERSION + 1)  # a version this server does not know
    other_model = Namespace(own_namespace.model_fingerprint + "-x", own_namespace.layout)
    foreign = encode_record(make_blocks(other_model, 1)[0])  # another namespace's fingerprint
    for name, body, says in [
        ("version", rechecksummed(newer), f"format version {FORMAT_VERSION + 1}"),
        ("fingerprint", foreign, "another namespace"),
    ]:
        status, answer = post_batch(shared_server, own_namespace.id, frame([body]))
        assert status == 400 and says in answer["message"], (name, answer)
    assert nothing_stored(shared_server, own_namespace, [block])


@pytest.mark.parametrize(
    "method,path,body,ctype,status,code",
    [
        (
            "POST",
            "/v1/namespaces/{ns}/batch/put",
            b"x",
            "application/json",
            415,
            "unsupported_media_type",
        ),
        ("PUT", "/v1/namespaces/{ns}/blocks/abc", b"x", "application/octet-stream", 400, "bad_key"),
        (
            "PUT",
            "/v1/namespaces/{ns}/blocks/" + "zz" * 32,
            b"x",
            "application/octet-stream",
            400,
            "bad_key",
        ),
        (
            "POST",
            "/v1/namespaces/{ns}/lookup",
            b"not json",
            "application/json",
            422,
            "invalid_request",
        ),
        (
            "POST",
            "/v1/namespaces/{ns}/lookup",
            b'{"keys": ["abc"]}',
            "application/json",
            422,
            "invalid_request",
        ),
        (
            "POST",
            "/v1/namespaces/{ns}/lookup",
            b'{"keys": 5}',
            "application/json",
            422,
            "invalid_request",
        ),
        (
            "POST",
            "/v1/namespaces/{ns}/lookup",
            b'{"keys": [], "x": 1}',
            "application/json",
            422,
            "invalid_request",
        ),
        (
            "POST",
            "/v1/namespaces/-bad/lookup",
            b'{"keys": []}',
            "application/json",
            400,
            "bad_namespace",
        ),
        (
            "POST",
            "/v1/namespaces/" + "a" * 129 + "/lookup",
            b'{"keys": []}',
            "application/json",
            400,
            "bad_namespace",
        ),
        ("GET", "/v1/nothing-here", None, None, 404, "not_found"),
        ("PATCH", "/v1/namespaces/{ns}/lookup", None, None, 405, "method_not_allowed"),
    ],
)
def test_bad_requests_get_a_json_error(
    shared_server: ThreadServer,
    own_namespace: Namespace,
    method: str,
    path: str,
    body: bytes | None,
    ctype: str | None,
    status: int,
    code: str,
) -> None:
    got, headers, answer = call(
        shared_server.url,
        method,
        path.format(ns=own_namespace.id),
        body,
        token=ALICE,
        content_type=ctype,
    )
    assert got == status and headers["content-type"] == "application/json", answer
    error = json.loads(answer)
    assert error["error"] == code and error["message"]


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.data())
def test_mutated_batches_never_cause_a_500_or_a_bad_block(
    shared_server: ThreadServer, own_namespace: Namespace, data: st.DataObject
) -> None:
    blocks = make_blocks(own_namespace, 2)
    body = bytearray(batch_body(blocks))
    how = data.draw(st.sampled_from(["flip", "cut", "splice"]))
    at = data.draw(st.integers(0, len(body) - 1))
    if how == "flip":
        body[at] ^= data.draw(st.integers(1, 255))
    elif how == "cut":
        del body[at:]
    else:
        body[at:at] = data.draw(st.binary(min_size=1, max_size=64))
    status, answer = post_batch(shared_server, own_namespace.id, bytes(body))
    assert status in (400, 413), answer
    assert nothing_stored(shared_server, own_namespace, blocks)


@pytest.mark.parametrize(
    "field,value",
    [
        ("head_timeout_s", 0),
        ("body_timeout_s", -1.0),
        ("idle_timeout_s", True),
        ("transfer_hello_timeout_s", "five"),
        ("transfer_unauthenticated_connections", 0),
        ("max_head_bytes", 0),
        ("max_inflight_bytes", 1 << 20),  # below max_batch_bytes
        ("write_queue_bytes", -1),
    ],
)
def test_bounds_are_checked_in_the_config(tmp_path: Path, field: str, value: object) -> None:
    with pytest.raises(ValueError, match=field):
        test_config(tmp_path, max_batch_bytes=4 << 20, **{field: value})


def test_every_body_is_bounded_by_its_route_whatever_its_type(
    shared_server: ThreadServer, own_namespace: Namespace
) -> None:
    ns = own_namespace.id
    limits = shared_server.config
    json_limit = 128 * max(limits.max_keys, limits.max_batch_blocks) + (64 << 10)
    over_json = b"\0" * (json_limit + 1)
    for method, path, ctype in [
        ("POST", f"/v1/namespaces/{ns}/lookup", "application/octet-stream"),
        ("POST", f"/v1/namespaces/{ns}/batch/get", BATCH_MEDIA_TYPE),
        ("POST", f"/v1/namespaces/{ns}/batch/exists", "text/plain"),
        ("DELETE", f"/v1/namespaces/{ns}", "application/octet-stream"),
        ("GET", "/v1/stats", "application/octet-stream"),
        ("POST", "/healthz", "application/octet-stream"),  # a public path: no token needed
    ]:
        status, _, answer = call(
            shared_server.url, method, path, over_json, token=ALICE, content_type=ctype
        )
        assert status == 413 and b"too_large" in answer, (method, path, answer[:200])
    # The record and batch routes take their own, larger limits.
    record_path = f"/v1/namespaces/{ns}/blocks/{'00' * 32}"
    status, _, answer = call(
        shared_server.url,
        "PUT",
        record_path,
        b"\0" * (limits.max_block_bytes + 1),
        token=ALICE,
        content_type="application/json",
    )
    assert status == 413, answer[:200]


def _wait_for(check: object, what: str) -> None:
    """Poll ``check()`` until it is true (bounded: a server thread is to act first)."""
    deadline = time.monotonic() + 10
    while not check():  # type: ignore[operator]
        assert time.monotonic() < deadline, f"still not {what}"
        time.sleep(0.02)


def _inflight(server: ThreadServer) -> float:
    _, _, body = call(server.url, "GET", "/metrics", token=TOKENS["ops"])
    for line in body.decode().splitlines():
        if line.startswith("cachetier_inflight_bytes "):
            return float(line.split()[1])
    raise AssertionError("no cachetier_inflight_bytes in /metrics")


def _transfer_reply(sock: socket.socket) -> tuple[int, int]:
    head = sock.recv(REPLY.size, socket.MSG_WAITALL)
    assert len(head) == REPLY.size, "the server closed without a reply"
    status, value = REPLY.unpack(head)
    if status != Status.OK:
        sock.recv(value, socket.MSG_WAITALL)
    return status, value


def test_uploads_past_the_bytes_in_flight_are_answered_busy(tmp_path: Path) -> None:
    config = test_config(
        tmp_path, transfer_port=0, max_batch_bytes=4 << 20, max_inflight_bytes=4 << 20
    )
    server = ThreadServer(config).start()
    ns = Namespace("busy-model", SMALL_LAYOUT)
    block = make_blocks(ns, 1)[0]
    body = batch_body([block])
    path = f"/v1/namespaces/{ns.id}/batch/put"
    held = socket.create_connection(("127.0.0.1", server.port), timeout=10)
    try:
        # An upload of 3 MiB whose body is still coming holds its 3 MiB.
        held.sendall(
            f"POST {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {ALICE}\r\n"
            f"Content-Type: {BATCH_MEDIA_TYPE}\r\nContent-Length: {3 << 20}\r\n\r\n".encode()
            + body[:100]
        )
        _wait_for(lambda: _inflight(server) >= 3 << 20, "holding the first upload")
        status, headers, answer = call(
            server.url,
            "POST",
            path,
            bytes(2 << 20),
            token=ALICE,
            content_type=BATCH_MEDIA_TYPE,
        )
        assert status == 503 and headers["retry-after"] == "1" and b"busy" in answer
        # The transfer port shares the budget; its connection stays usable after BUSY.
        with socket.create_connection(
            ("127.0.0.1", server.config.transfer_port), timeout=10
        ) as sock:
            sock.sendall(hello(ALICE, None))
            assert _transfer_reply(sock)[0] == Status.OK
            lengths = struct.pack("<2Q", 1 << 20, 1 << 20)
            sock.sendall(request(Op.PUT, ns.id, 2) + lengths + bytes(2 << 20))
            assert _transfer_reply(sock)[0] == Status.BUSY
            sock.sendall(request(Op.GET, ns.id, 1) + block.key)
            assert _transfer_reply(sock) == (Status.OK, 1)
    finally:
        held.close()
    _wait_for(lambda: _inflight(server) == 0, "given back")
    status, _, answer = call(
        server.url, "POST", path, body, token=ALICE, content_type=BATCH_MEDIA_TYPE
    )
    assert status == 200, answer
    server.stop()


def test_a_write_queue_holds_at_most_write_queue_bytes(tmp_path: Path) -> None:
    ns = Namespace("queue-model", SMALL_LAYOUT)
    blocks = make_blocks(ns, 40)  # 2 KiB of payload each
    limit = 16 * len(blocks[0].data)
    server = ThreadServer(
        test_config(tmp_path, sync_puts=False, write_queue_bytes=limit, cpu_bytes=1 << 20)
    ).start()
    try:
        url = server.url
        # More than the queue may hold at once: the disk tier never gets this put.
        status, _ = post_batch(server, ns.id, batch_body(blocks[:20]))
        assert status == 200
        status, _ = post_batch(server, ns.id, batch_body(blocks[20:30]))  # fits
        assert status == 200
        server.restart()  # the queue is flushed to disk; the CPU tier starts empty
        got = get_batch(url, ns.id, [b.key for b in blocks[:30]])
        assert got[:20] == [None] * 20
        assert [g and bytes(g.data) for g in got[20:]] == [b.data for b in blocks[20:30]]
    finally:
        server.stop()


def test_connections_that_never_say_hello_have_a_small_budget_of_their_own(
    tmp_path: Path,
) -> None:
    config = test_config(
        tmp_path,
        transfer_port=0,
        transfer_connections=2,
        transfer_unauthenticated_connections=2,
    )
    server = ThreadServer(config).start()
    port = server.config.transfer_port
    try:
        silent = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(3)]
        # The third took the place of the first, which the server dropped.
        assert silent[0].recv(1) == b""
        # Clients with a token still get both known slots, silent ones or not.
        known = []
        for _ in range(2):
            sock = socket.create_connection(("127.0.0.1", port), timeout=10)
            sock.sendall(hello(ALICE, None))
            assert _transfer_reply(sock)[0] == Status.OK
            known.append(sock)
        # With both known slots taken, a new connection is told BUSY at once.
        with socket.create_connection(("127.0.0.1", port), timeout=10) as extra:
            assert _transfer_reply(extra)[0] == Status.BUSY
        for sock in silent + known:
            sock.close()
    finally:
        server.stop()


def test_the_cli_sets_the_deadlines_and_the_budget_of_unknown_connections(
    tmp_path: Path,
) -> None:
    from cachetier.cli.main import build_parser
    from cachetier.server.config import load_config

    args = build_parser().parse_args(
        [
            "serve",
            "--open",
            "--data-dir",
            str(tmp_path),
            "--head-timeout-s",
            "3",
            "--body-timeout-s",
            "30.5",
            "--idle-timeout-s",
            "9",
            "--transfer-hello-timeout-s",
            "2",
            "--transfer-unauthenticated-connections",
            "4",
        ]
    )
    config = load_config(
        None,
        {},
        open_mode=args.open_mode,
        head_timeout_s=args.head_timeout_s,
        body_timeout_s=args.body_timeout_s,
        idle_timeout_s=args.idle_timeout_s,
        transfer_hello_timeout_s=args.transfer_hello_timeout_s,
        transfer_unauthenticated_connections=args.transfer_unauthenticated_connections,
    )
    got = (
        config.head_timeout_s,
        config.body_timeout_s,
        config.idle_timeout_s,
        config.transfer_hello_timeout_s,
        config.transfer_unauthenticated_connections,
    )
    assert got == (3.0, 30.5, 9.0, 2.0, 4)
    env = {"CACHETIER_HEAD_TIMEOUT_S": "4.5", "CACHETIER_OPEN_MODE": "1"}
    assert load_config(None, env).head_timeout_s == 4.5
