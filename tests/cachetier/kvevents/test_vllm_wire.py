"""Our KV events against vLLM's own classes: what our publisher sends, live and replayed,
decodes with ``vllm.distributed.kv_events.KVEventBatch``; what vLLM writes decodes with ours;
and our subscriber follows vLLM's own ``ZmqEventPublisher``, replay and restart included."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType

import msgspec
import pytest
import zmq

from cachetier.kvevents import (
    MEDIUM_GPU,
    AllBlocksCleared,
    BatchCodec,
    BlockRemoved,
    BlockStored,
    EventBatch,
    KVEventPublisher,
    KVEventSubscriber,
    SubscriberConfig,
    TierEvents,
)
from tests.cachetier.kvevents.streams import WAIT_S, random_keys, wait_sent

pytestmark = pytest.mark.vllm

MakePublisher = Callable[..., KVEventPublisher]
KEYS = random_keys(4)


@pytest.fixture(scope="module")
def vllm_events() -> ModuleType:
    """``vllm.distributed.kv_events``, imported when a test here runs rather than when the
    suite is collected: vLLM takes seconds to import."""
    return pytest.importorskip("vllm.distributed.kv_events")


def _vllm_decoder(vllm_events: ModuleType) -> msgspec.msgpack.Decoder:
    return msgspec.msgpack.Decoder(type=vllm_events.KVEventBatch)


def _tell_a_tier_story(publisher: KVEventPublisher) -> None:
    events = TierEvents(publisher)
    events.stored(MEDIUM_GPU, KEYS[1:3], KEYS[0], list(range(32)), 16)
    events.stored("disk", KEYS, block_size=16)
    events.removed("disk", KEYS[3:])
    events.cleared("cpu")


def _check_vllm_reads_the_story(batches: list[object]) -> None:
    events = [e for b in batches for e in b.events]  # type: ignore[attr-defined]
    assert [type(e).__name__ for e in events] == [
        "BlockStored",
        "BlockStored",
        "BlockRemoved",
        "AllBlocksCleared",
    ]
    gpu, disk, removed, _ = events
    assert gpu.block_hashes == KEYS[1:3] and gpu.parent_block_hash == KEYS[0]
    assert gpu.token_ids == list(range(32)) and gpu.block_size == 16
    assert gpu.medium == "GPU" and gpu.lora_id is None and gpu.lora_name is None
    assert gpu.group_idx is None and gpu.extra_keys is None  # vLLM's defaults
    assert disk.block_hashes == KEYS and disk.token_ids == [] and disk.medium == "disk"
    assert removed.block_hashes == KEYS[3:] and removed.medium == "disk"
    assert all(b.data_parallel_rank == 1 for b in batches)  # type: ignore[attr-defined]


def test_vllm_decodes_our_live_batches(
    make_publisher: MakePublisher, vllm_events: ModuleType
) -> None:
    publisher = make_publisher(heartbeat_s=None, data_parallel_rank=1)
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"")  # vLLM's example subscribes to everything
    sub.connect(publisher.endpoint)
    try:
        # Probes until the subscription is through (a SUB misses what went out before it).
        while not sub.poll(50):
            publisher.publish([BlockRemoved((), "probe")])
        while sub.poll(100):
            sub.recv_multipart()
        _tell_a_tier_story(publisher)
        decoder, batches = _vllm_decoder(vllm_events), []
        while sum(len(b.events) for b in batches) < 4:
            assert sub.poll(int(WAIT_S * 1000))
            _, _, payload = sub.recv_multipart()
            batches.append(decoder.decode(payload))
    finally:
        sub.close()
        ctx.term()
    _check_vllm_reads_the_story(batches)


def test_vllm_decodes_our_replayed_batches(
    make_publisher: MakePublisher, vllm_events: ModuleType
) -> None:
    publisher = make_publisher(heartbeat_s=None, data_parallel_rank=1)
    _tell_a_tier_story(publisher)
    wait_sent(publisher, 4)
    ctx = zmq.Context()
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    assert publisher.replay_endpoint is not None
    dealer.connect(publisher.replay_endpoint)
    try:
        dealer.send_multipart([b"", (0).to_bytes(8, "big")])  # what vLLM's REQ client sends
        decoder, batches = _vllm_decoder(vllm_events), []
        while True:
            assert dealer.poll(int(WAIT_S * 1000))
            _, _, seq, payload = dealer.recv_multipart()
            if seq == vllm_events.ZmqEventPublisher.END_SEQ:
                break
            batches.append(decoder.decode(payload))
    finally:
        dealer.close()
        ctx.term()
    _check_vllm_reads_the_story(batches)


def test_a_cleared_tiers_medium_is_ours_and_vllm_reads_past_it(vllm_events: ModuleType) -> None:
    batch = EventBatch(1.0, (AllBlocksCleared("disk"), AllBlocksCleared()))
    payload = BatchCodec().encode(batch)
    (named, plain) = _vllm_decoder(vllm_events).decode(payload).events
    assert isinstance(named, vllm_events.AllBlocksCleared)
    assert isinstance(plain, vllm_events.AllBlocksCleared)
    assert BatchCodec().decode(payload) == batch


def test_we_decode_what_vllm_writes_int_hashes_and_newer_fields_included(
    vllm_events: ModuleType,
) -> None:
    batch = vllm_events.KVEventBatch(
        ts=2.5,
        events=[
            vllm_events.BlockStored(
                block_hashes=[b"\x01" * 32, 7],
                parent_block_hash=None,
                token_ids=[1, 2],
                block_size=1,
                lora_id=None,
                medium="GPU",
                lora_name=None,
                extra_keys=[("salt",), None],
                group_idx=0,
                kv_cache_spec_kind="full_attention",
            ),
            vllm_events.BlockRemoved(block_hashes=[7], medium=None, group_idx=0),
            vllm_events.AllBlocksCleared(),
        ],
        data_parallel_rank=0,
    )
    ours = BatchCodec().decode(msgspec.msgpack.encode(batch))
    assert ours.events == (
        BlockStored((b"\x01" * 32, 7), None, (1, 2), 1, "GPU"),
        BlockRemoved((7,), None),
        AllBlocksCleared(),
    )
    assert ours.ts == 2.5 and ours.data_parallel_rank == 0
    assert [c[0:2] for c in ours.changes()] == [("stored", "GPU"), ("removed", "GPU")] + [
        ("cleared", "GPU")
    ]


@pytest.fixture
def vllm_publishers(tmp_path: Path, vllm_events: ModuleType) -> Iterator[Callable[[], object]]:
    """vLLM's own ZmqEventPublisher on ipc endpoints in ``tmp_path`` (the same ones each time,
    as a restarted vLLM binds); shut down afterwards."""
    made: list[object] = []

    def make() -> object:
        publisher = vllm_events.ZmqEventPublisher(
            data_parallel_rank=0,
            endpoint=f"ipc://{tmp_path}/pub",
            replay_endpoint=f"ipc://{tmp_path}/replay",
        )
        made.append(publisher)
        return publisher

    yield make
    for publisher in made:
        publisher.shutdown()  # type: ignore[attr-defined]


def _vllm_batch(vllm_events: ModuleType, key: bytes) -> object:
    return vllm_events.KVEventBatch(
        ts=time.time(), events=[vllm_events.BlockRemoved(block_hashes=[key], medium=None)]
    )


def _follow(
    vllm_events: ModuleType,
    subscriber: KVEventSubscriber,
    publisher: object,
    done: Callable[[list], bool],
) -> list:
    """Deliveries until ``done``, publishing one more batch every 50 ms (a subscriber learns of
    earlier ones from a later one)."""
    got: list = []
    deadline = time.monotonic() + WAIT_S
    while not done(got):
        assert time.monotonic() < deadline, got[-3:]
        publisher.publish(_vllm_batch(vllm_events, b"\0" * 32))  # type: ignore[attr-defined]
        got += subscriber.receive(timeout_s=0.05)
    return got


def test_our_subscriber_follows_vllms_publisher_through_replay_and_restart(
    vllm_publishers: Callable[[], object], vllm_events: ModuleType, tmp_path: Path
) -> None:
    first = vllm_publishers()
    for key in KEYS:
        first.publish(_vllm_batch(vllm_events, key))  # type: ignore[attr-defined]
    config = SubscriberConfig(
        f"ipc://{tmp_path}/pub", f"ipc://{tmp_path}/replay", topic="", replica="vllm-0"
    )
    with KVEventSubscriber(config) as subscriber:
        got = _follow(vllm_events, subscriber, first, lambda got: len(got) >= 20)
        assert [d.seq for d in got] == list(range(len(got))), "replayed from 0, in order"
        assert [d.batch.events[0].block_hashes[0] for d in got[:4]] == KEYS
        assert {(d.replica, d.epoch, d.num_missed) for d in got} == {("vllm-0", 0, 0)}
        first.shutdown()  # type: ignore[attr-defined]
        # vLLM names no epoch: its sequence numbers starting over mark the restart.
        second = vllm_publishers()
        after = _follow(vllm_events, subscriber, second, lambda got: any(d.epoch == 1 for d in got))
        epochs = [d.epoch for d in after]  # the first process's last batches may come first
        assert epochs == sorted(epochs) and epochs[-1] == 1
        restarted = next(d for d in after if d.epoch == 1)
        assert restarted.num_missed == restarted.seq, "counted from the new process's 0"
