"""Our published KV events, read as llm-d's KV-cache indexer reads them.

``tests/cachetier/kvevents/llmd.py`` re-implements llm-d's path from a ZMQ frame to its index
(topic parsing, the vLLM adapter's positional events, hashing from ``token_ids``); these tests
feed it the frames of a real publisher on a real socket, and check that a prompt llm-d scores
finds our pod under our model, that removals and clears reach the index, and what the other
settings cost (map-encoded events, hashes only).
"""

from __future__ import annotations

import random
from collections.abc import Callable

import msgspec
import pytest
import zmq

from cachetier.kvevents import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventPublisher,
)
from cachetier.primitives.keys import chain_keys
from tests.cachetier.kvevents import llmd

BLOCK_SIZE = 16  # llm-d's default blockSizeTokens: one of our blocks is one of its keys
MODEL = "org/model-1"
POD = "pod-a"
WAIT_S = 5.0
MakePublisher = Callable[..., KVEventPublisher]


def _subscribe(context: zmq.Context, publisher: KVEventPublisher) -> zmq.Socket:
    sub = context.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv@")  # pool.go's default TopicFilter
    sub.connect(publisher.endpoint)
    # Heartbeats flow every 50 ms: the first one read means the subscription is live.
    assert sub.poll(int(WAIT_S * 1000)), "no heartbeat"
    sub.recv_multipart()
    return sub


def _drain(sub: zmq.Socket, num_events: int) -> list[list[bytes]]:
    """Messages until ``num_events`` events have come (heartbeats included in the list)."""
    messages: list[list[bytes]] = []
    seen = 0
    while seen < num_events:
        assert sub.poll(int(WAIT_S * 1000)), f"{seen} of {num_events} events came"
        frames = sub.recv_multipart()
        messages.append(frames)
        seen += len(msgspec.msgpack.decode(frames[2])[1])
    return messages


def _prompt(num_blocks: int) -> list[int]:
    rng = random.Random(7)
    return [rng.randrange(1, 150_000) for _ in range(num_blocks * BLOCK_SIZE)]


@pytest.fixture
def context() -> zmq.Context:
    ctx = zmq.Context()
    yield ctx
    ctx.term()


def _publish_prompt(publisher: KVEventPublisher, tokens: list[int], medium: str) -> list[bytes]:
    """The engine's way: the first blocks, then the rest as children of the last (two
    events, so llm-d resolves a parent through its engine -> request key mapping)."""
    keys = chain_keys(b"\x01" * 32, BLOCK_SIZE, tokens)
    half = len(keys) // 2
    cut = half * BLOCK_SIZE
    assert publisher.publish(
        [BlockStored(tuple(keys[:half]), None, tuple(tokens[:cut]), BLOCK_SIZE, medium)]
    )
    assert publisher.publish(
        [BlockStored(tuple(keys[half:]), keys[half - 1], tuple(tokens[cut:]), BLOCK_SIZE, medium)]
    )
    return keys


def test_llm_d_files_our_blocks_under_our_pod_and_model_and_follows_removals(
    make_publisher: MakePublisher, context: zmq.Context
) -> None:
    publisher = make_publisher(POD, model=MODEL, encoding="array")
    sub = _subscribe(context, publisher)
    try:
        tokens = _prompt(6)
        keys = _publish_prompt(publisher, tokens, "disk")
        pool = llm_d_pool()
        for frames in _drain(sub, 2):
            pool.feed(frames)
        assert pool.models == {POD: MODEL}, "topic kv@<pod-id>@<model-name>"
        assert pool.num_skipped == 0
        # What llm-d's scorer computes for the same prompt finds our pod on every block.
        wanted = pool.tokens.tokens_to_keys(0, tokens, MODEL)
        assert pool.index.pods(wanted) == [{POD}] * 6
        assert pool.index.data[wanted[0]] == {(POD, "disk")}
        # Another model's prompt of the same tokens is not ours.
        assert pool.index.pods(pool.tokens.tokens_to_keys(0, tokens, "other")) == [set()] * 6

        assert publisher.publish([BlockRemoved(tuple(keys[4:]), "disk")])
        for frames in _drain(sub, 1):
            pool.feed(frames)
        assert pool.index.pods(wanted) == [{POD}] * 4 + [set()] * 2
        assert publisher.publish([AllBlocksCleared("disk")])
        for frames in _drain(sub, 1):
            pool.feed(frames)
        assert pool.index.pods(wanted) == [set()] * 6
    finally:
        sub.close()


def llm_d_pool() -> llmd.Pool:
    return llmd.Pool(llmd.TokenProcessor(BLOCK_SIZE))


def test_hashes_only_events_tell_llm_d_nothing_of_the_prompt(
    make_publisher: MakePublisher, context: zmq.Context
) -> None:
    publisher = make_publisher(POD, model=MODEL, encoding="array", publish_token_ids=False)
    sub = _subscribe(context, publisher)
    try:
        tokens = _prompt(4)
        _publish_prompt(publisher, tokens, "cpu")
        pool = llm_d_pool()
        messages = _drain(sub, 2)
        for frames in messages:
            pool.feed(frames)
        for frames in messages:
            for event in msgspec.msgpack.decode(frames[2])[1]:
                assert event[3] == [], "no token ids on the wire"
        # llm-d keys blocks by their tokens: without them it indexes nothing new.
        assert pool.index.data == {} and pool.num_skipped == 2
    finally:
        sub.close()


def test_map_encoded_events_are_what_llm_d_cannot_decode(
    make_publisher: MakePublisher, context: zmq.Context
) -> None:
    """Why ``encoding="array"`` exists: vLLM's decoder here reads events as maps, llm-d's
    adapter as arrays, and no payload is both."""
    publisher = make_publisher(POD, model=MODEL)  # encoding="map", the default
    sub = _subscribe(context, publisher)
    try:
        _publish_prompt(publisher, _prompt(2), "cpu")
        frames = _drain(sub, 2)[-1]
        with pytest.raises(llmd.LlmdError, match="tagged union"):
            llm_d_pool().feed(frames)
    finally:
        sub.close()


def test_vllms_own_decoder_reads_our_batch_and_skips_the_epoch(
    make_publisher: MakePublisher, context: zmq.Context
) -> None:
    """vLLM's ``KVEventBatch`` decodes the map encoding with our epoch after its fields."""
    kv_events = pytest.importorskip("vllm.distributed.kv_events")
    decoder = msgspec.msgpack.Decoder(type=kv_events.KVEventBatch)
    publisher = make_publisher(POD, model=MODEL, epoch=99)
    sub = _subscribe(context, publisher)
    try:
        keys = _publish_prompt(publisher, _prompt(2), "cpu")
        batch = decoder.decode(_drain(sub, 2)[-1][2])
        stored = [e for e in batch.events if isinstance(e, kv_events.BlockStored)]
        assert [h for e in stored for h in e.block_hashes][-1] == keys[-1]
    finally:
        sub.close()
