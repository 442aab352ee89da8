"""The sans-IO parts of KV events: the batch codec, the topic and sequence frames, replay
requests, the replay buffer and the settings' checks."""

from __future__ import annotations

import msgspec
import pytest

from cachetier.kvevents import (
    AllBlocksCleared,
    BatchCodec,
    BlockRemoved,
    BlockStored,
    EventBatch,
    MalformedEventError,
    PublisherConfig,
    SubscriberConfig,
    Topic,
    parse_topic,
)
from cachetier.kvevents.framing import (
    END_SEQ,
    MAX_SEQ,
    decode_seq,
    encode_seq,
    parse_replay_request,
    replay_answer,
    replay_end,
)
from cachetier.kvevents.replay import ReplayBuffer
from tests.cachetier.kvevents.streams import random_keys

KEYS = random_keys(4)


def test_a_batch_of_every_event_round_trips() -> None:
    batch = EventBatch(
        1.5,
        (
            BlockStored(tuple(KEYS[1:3]), KEYS[0], tuple(range(8)), 4, "disk"),
            BlockStored((KEYS[3],), None, (), 0, "cpu", lora_id=3, lora_name="adapter"),
            BlockRemoved((KEYS[1],), "disk"),
            AllBlocksCleared("redis"),
            AllBlocksCleared(),
        ),
        data_parallel_rank=2,
    )
    codec = BatchCodec()
    assert codec.decode(codec.encode(batch)) == batch


def test_changes_are_what_the_prefix_index_applies() -> None:
    batch = EventBatch(
        0.0,
        (
            BlockStored((KEYS[0], 7), None, (), 0, None),
            BlockRemoved((KEYS[1],), "disk"),
            AllBlocksCleared(),
        ),
    )
    assert batch.changes() == [
        ("stored", "GPU", (KEYS[0], (7).to_bytes(8, "big"))),
        ("removed", "disk", (KEYS[1],)),
        ("cleared", "GPU", ()),
    ]
    assert batch.changes("pool")[0][1] == "pool"


@pytest.mark.parametrize(
    "payload",
    [
        b"",
        b"\xc1",  # a byte msgpack never uses
        msgspec.msgpack.encode({"ts": 1.0}),  # a map where an array belongs
        msgspec.msgpack.encode([1.0, [{"type": "BlockMoved"}]]),
        msgspec.msgpack.encode([1.0, [{"type": "BlockRemoved", "block_hashes": ["x"]}]]),
        msgspec.msgpack.encode([1.0, [{"type": "BlockRemoved", "medium": "disk"}]]),
    ],
    ids=["empty", "reserved-byte", "map", "unknown-event", "str-hash", "missing-field"],
)
def test_a_malformed_payload_raises_one_error(payload: bytes) -> None:
    with pytest.raises(MalformedEventError):
        BatchCodec().decode(payload)


def test_a_truncated_payload_raises_one_error() -> None:
    codec = BatchCodec()
    payload = codec.encode(EventBatch(1.0, (BlockRemoved(tuple(KEYS), "disk"),)))
    for cut in (1, len(payload) // 2, len(payload) - 1):
        with pytest.raises(MalformedEventError):
            codec.decode(payload[:cut])


def test_topics_carry_the_replica_and_the_model_as_llm_d_splits_them() -> None:
    topic = Topic("pod-7.ns", "HuggingFaceTB/SmolLM2-135M")
    assert topic.encode() == b"kv@pod-7.ns@HuggingFaceTB/SmolLM2-135M"
    assert parse_topic(topic.encode()) == topic
    assert parse_topic(Topic("*").encode()) == Topic("*", "*")


@pytest.mark.parametrize(
    "frame", [b"", b"kv@", b"kv@a", b"kv@a@", b"kv@a@b@c", b"x kv@a@m", b"\xff"]
)
def test_a_topic_that_is_not_ours_parses_to_none(frame: bytes) -> None:
    assert parse_topic(frame) is None


@pytest.mark.parametrize("name", ["", "a@b", "a b", "x" * 129, "é"])
def test_a_name_that_would_break_the_topic_is_refused(name: str) -> None:
    with pytest.raises(ValueError, match="replica"):
        Topic(name, "m")
    with pytest.raises(ValueError, match="model"):
        Topic("r", name)


def test_the_epoch_rides_in_the_batch_in_either_event_encoding() -> None:
    batch = EventBatch(
        1.0, (BlockRemoved(tuple(KEYS), "disk"), AllBlocksCleared("disk")), None, 2**64 - 1
    )
    for encoding in ("map", "array"):
        assert BatchCodec("map").decode(BatchCodec(encoding).encode(batch)) == batch
    with pytest.raises(ValueError, match="encoding"):
        BatchCodec("json")


def test_sequence_frames_are_8_bytes_big_endian() -> None:
    assert encode_seq(1) == b"\0" * 7 + b"\1"
    assert decode_seq(encode_seq(MAX_SEQ)) == MAX_SEQ
    assert decode_seq(END_SEQ) is None and decode_seq(b"\1") is None
    for bad in (-1, MAX_SEQ + 1):
        with pytest.raises(ValueError, match="sequence"):
            encode_seq(bad)


def test_replay_requests_from_req_and_bare_dealer_clients() -> None:
    seq = encode_seq(5)
    assert parse_replay_request([b"id", b"", seq]).start == 5  # type: ignore[union-attr]
    req = parse_replay_request([b"id", b"", seq])
    assert req is not None and req.envelope == (b"id", b"")
    bare = parse_replay_request([b"id", seq])
    assert bare is not None and bare.envelope == (b"id",) and bare.start == 5
    assert replay_answer(bare.envelope, b"t", 5, b"p") == [b"id", b"t", seq, b"p"]
    assert replay_end(req.envelope) == [b"id", b"", b"", END_SEQ, b""]


@pytest.mark.parametrize(
    "frames", [[b"id", b"", b"abc"], [b"id", b""], [b"id", b"", encode_seq(1), b"more"], [b"id"]]
)
def test_a_malformed_replay_request_has_no_start(frames: list[bytes]) -> None:
    request = parse_replay_request(frames)
    assert request is not None and request.start is None and request.envelope[0] == b"id"


def test_a_request_without_an_identity_is_not_answered() -> None:
    assert parse_replay_request([]) is None


def test_the_replay_buffer_keeps_the_latest_batches_by_count_and_bytes() -> None:
    buffer = ReplayBuffer(max_batches=3, max_bytes=10)
    for seq in range(5):
        buffer.append(seq, b"ab")
    assert [s for s, _ in buffer.since(0)] == [2, 3, 4] and buffer.first_seq == 2
    buffer.append(6, b"x" * 7)  # seq 5 was burned; 2 + 2 + 7 bytes > 10: seq 3 leaves
    assert [s for s, _ in buffer.since(0)] == [4, 6] and buffer.num_bytes == 9
    assert [s for s, _ in buffer.since(5)] == [6]
    assert buffer.since(7) == [] and buffer.since(2**64 - 1) == []
    buffer.append(7, b"y" * 50)  # larger than the bound alone: still kept, alone
    assert [s for s, _ in buffer.since(0)] == [7]


@pytest.mark.parametrize(
    "settings,match",
    [
        ({"replica": "a@b"}, "replica"),
        ({"endpoint": "http://x"}, "endpoint"),
        ({"replay_endpoint": "inproc://x"}, "replay_endpoint"),
        ({"buffer_batches": 0}, "buffer_batches"),
        ({"max_queue_batches": True}, "max_queue_batches"),
        ({"heartbeat_s": 0}, "heartbeat_s"),
        ({"data_parallel_rank": -1}, "data_parallel_rank"),
    ],
)
def test_publisher_settings_are_checked(settings: dict[str, object], match: str) -> None:
    settings = {"replica": "a", **settings}
    with pytest.raises(ValueError, match=match):
        PublisherConfig(**settings)  # type: ignore[arg-type]


def test_subscriber_settings_are_checked() -> None:
    with pytest.raises(ValueError, match="endpoint"):
        SubscriberConfig("127.0.0.1:5557")
    with pytest.raises(ValueError, match="replay_timeout_s"):
        SubscriberConfig("tcp://127.0.0.1:5557", replay_timeout_s=-1)
    with pytest.raises(ValueError, match="replica"):
        SubscriberConfig("tcp://127.0.0.1:5557", replica="a@b")
