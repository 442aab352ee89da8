"""Records are immutable (a key names its KV): a put of a key the server holds keeps the first
record, and the answer says which records were stored and which were already present."""

from __future__ import annotations

import json

import numpy as np

from cachetier.primitives.keys import Namespace
from cachetier.protocol.http_batch import RECORD_MEDIA_TYPE
from cachetier.record import KVBlock, encode_record
from tests.server.batches import put_batch, read_batch
from tests.server.live import TOKENS, ThreadServer, call
from tests.support import make_blocks


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
