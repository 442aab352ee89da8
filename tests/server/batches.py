"""Batch bodies for the HTTP API (``application/x-cachetier-batch``): build one, read one, and
put or get blocks with one, as a client of a test server would."""

from __future__ import annotations

import json

from cachetier.protocol.http_batch import BATCH_MEDIA_TYPE, BatchReader, batch_parts
from cachetier.record import KVBlock, decode_record, encode_parts
from tests.server.live import TOKENS, ThreadServer, call

ALICE = TOKENS["alice"]


def batch_body(blocks: list[KVBlock]) -> bytes:
    parts, _ = batch_parts([encode_parts(b) for b in blocks])
    return b"".join(bytes(memoryview(p)) for p in parts)


def read_batch(data: bytes) -> list[memoryview | None]:
    reader = BatchReader(max_records=10_000, max_record_bytes=1 << 30, max_batch_bytes=1 << 34)
    reader.feed(data)
    return reader.finish()


def put_batch(url: str, ns: str, blocks: list[KVBlock], token: str = ALICE) -> tuple[int, dict]:
    status, _, body = call(
        url,
        "POST",
        f"/v1/namespaces/{ns}/batch/put",
        batch_body(blocks),
        token=token,
        content_type=BATCH_MEDIA_TYPE,
    )
    return status, json.loads(body)


def post_batch(server: ThreadServer, ns: str, body: bytes, **kw: object) -> tuple[int, dict]:
    """Post ``body`` as it is to ``server``'s batch put, as alice; its JSON answer."""
    kw.setdefault("content_type", BATCH_MEDIA_TYPE)
    status, headers, answer = call(
        server.url, "POST", f"/v1/namespaces/{ns}/batch/put", body, token=ALICE, **kw
    )
    assert headers["content-type"] == "application/json", answer[:200]
    return status, json.loads(answer)


def get_batch(url: str, ns: str, keys: list[bytes], token: str = ALICE) -> list[KVBlock | None]:
    status, headers, body = call(
        url,
        "POST",
        f"/v1/namespaces/{ns}/batch/get",
        b'{"keys": [%s]}' % b",".join(b'"%s"' % k.hex().encode() for k in keys),
        token=token,
        content_type="application/json",
    )
    assert status == 200 and headers["content-type"] == BATCH_MEDIA_TYPE, body[:200]
    assert int(headers["content-length"]) == len(body)
    return [None if r is None else decode_record(r, key=k) for r, k in zip(read_batch(body), keys)]
