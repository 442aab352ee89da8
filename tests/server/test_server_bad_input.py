"""Bad input: malformed, truncated, oversized and forged requests get a 4xx with a JSON error
that says what is wrong; never a 500, never a stored bad block. (The server's own bounds on
what it holds: ``test_server_limits``; the hostile clients themselves, and what they are
measured at: ``tests/faults``.)"""

from __future__ import annotations

import http.client
import json
import struct

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cachetier.primitives.keys import KVLayout, Namespace
from cachetier.protocol.http_batch import BATCH_MAGIC, BATCH_MEDIA_TYPE
from cachetier.record import FORMAT_VERSION, KVBlock, encode_record, reseal
from tests.server.batches import ALICE, batch_body, get_batch, post_batch
from tests.server.live import ThreadServer, call, call_json
from tests.support import make_blocks


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
