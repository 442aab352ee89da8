"""The vLLM connector's KV events: cachetier's events as vLLM's own classes (decoded by vLLM's
``KVEventBatch`` decoder), the sink's bound, and the worker publishing a real store's changes
(CPU and disk tiers, vLLM-CPU-shaped pages) with the tokens the scheduler side sent."""

from __future__ import annotations

import logging
import pickle
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest
import torch

pytest.importorskip("vllm")

from vllm import SamplingParams  # noqa: E402
from vllm.config import KVEventsConfig, VllmConfig  # noqa: E402
from vllm.distributed import kv_events as vllm_events  # noqa: E402
from vllm.v1.core.kv_cache_manager import KVCacheBlocks  # noqa: E402
from vllm.v1.core.kv_cache_utils import KVCacheBlock  # noqa: E402
from vllm.v1.core.sched.output import NewRequestData, SchedulerOutput  # noqa: E402
from vllm.v1.request import Request  # noqa: E402

from cachetier.connectors.config import ConnectorConfig, open_store  # noqa: E402
from cachetier.connectors.vllm.events import (  # noqa: E402
    CacheTierKVEvents,
    ConnectorTierEvents,
    SchedulerEvents,
    VllmEventSink,
    kv_events_enabled,
)
from cachetier.connectors.vllm.layouts import CPU_VEC, VllmArrangement  # noqa: E402
from cachetier.connectors.vllm.metadata import CacheTierConnectorMetadata  # noqa: E402
from cachetier.connectors.vllm.scheduler import CacheTierScheduler  # noqa: E402
from cachetier.connectors.vllm.worker import CacheTierWorker  # noqa: E402
from cachetier.kvevents import AllBlocksCleared, BatchCodec, BlockRemoved, BlockStored  # noqa: E402
from cachetier.primitives.keys import KVLayout, block_keys  # noqa: E402
from cachetier.store.tiered import TieredStore  # noqa: E402

pytestmark = pytest.mark.vllm

NUM_LAYERS, NUM_KV_HEADS, BS, HEAD_SIZE, NUM_BLOCKS = 2, 2, 32, 8, 8
RECORD_TOKENS = BS // 2  # two records per vLLM block: parents chain across them
LAYOUT = KVLayout("float32", BS, NUM_LAYERS, NUM_KV_HEADS, HEAD_SIZE)
NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(NUM_LAYERS)]
KEYS = [bytes([i]) * 32 for i in range(1, 5)]
DECODER = msgspec.msgpack.Decoder(type=vllm_events.KVEventBatch)


def _round_trip(events: list[vllm_events.KVCacheEvent]) -> list[vllm_events.KVCacheEvent]:
    """``events`` as a vLLM subscriber gets them: a ``KVEventBatch``, msgpack, vLLM's decoder."""
    payload = msgspec.msgpack.Encoder().encode(vllm_events.KVEventBatch(ts=1.0, events=events))
    return DECODER.decode(payload).events


def test_converted_events_decode_with_vllms_own_decoder() -> None:
    sink = VllmEventSink({"disk": "LOCAL", "redis": "REMOTE"}, "full_attention")
    tokens = tuple(range(2 * RECORD_TOKENS))
    sink.publish([BlockStored(tuple(KEYS[1:3]), KEYS[0], tokens, RECORD_TOKENS, "disk")])
    sink.publish([BlockRemoved((KEYS[3],), "redis"), AllBlocksCleared(None)])
    stored, removed, cleared = _round_trip(sink.take())

    assert isinstance(stored, vllm_events.BlockStored)
    assert stored.block_hashes == KEYS[1:3] and stored.parent_block_hash == KEYS[0]
    assert stored.token_ids == list(tokens) and stored.block_size == RECORD_TOKENS
    assert (stored.medium, stored.locality, stored.group_idx) == ("disk", "LOCAL", 0)
    assert stored.kv_cache_spec_kind == "full_attention" and stored.ownership == "cachetier"
    assert stored.lora_id is None and stored.lora_name is None and stored.extra_keys is None
    assert isinstance(removed, vllm_events.BlockRemoved)
    assert (removed.block_hashes, removed.medium, removed.locality) == (
        [KEYS[3]],
        "redis",
        "REMOTE",
    )
    assert isinstance(cleared, vllm_events.AllBlocksCleared)
    assert sink.take() == []  # taken once


def test_cachetiers_own_subscriber_reads_them_too() -> None:
    # Our router decodes vLLM's batches with BatchCodec: the fields it does not know are skipped.
    sink = VllmEventSink({"cpu": "LOCAL"})
    sink.publish([BlockStored((KEYS[0],), None, (), RECORD_TOKENS, "cpu")])
    payload = msgspec.msgpack.encode(vllm_events.KVEventBatch(ts=1.0, events=sink.take()))
    assert BatchCodec().decode(payload).changes() == [("stored", "cpu", (KEYS[0],))]


def test_a_tiers_clear_goes_out_as_the_removal_of_what_it_held() -> None:
    sink = VllmEventSink()
    events = ConnectorTierEvents(sink)
    events.stored("disk", KEYS[:3])
    events.stored("cpu", KEYS[3:])
    events.cleared("disk")
    *_, removed = sink.take()
    assert isinstance(removed, vllm_events.BlockRemoved)
    assert removed.medium == "disk" and sorted(removed.block_hashes) == KEYS[:3]
    assert events.held.keys("disk") == [] and events.held.keys("cpu") == KEYS[3:]
    # vLLM's AllBlocksCleared names no medium: a tier's clear cannot be said with it.
    with pytest.raises(ValueError, match="names no medium"):
        sink.to_vllm(AllBlocksCleared("disk"))


def test_the_sink_drops_its_oldest_events_past_its_bound() -> None:
    sink = VllmEventSink(max_blocks=4)
    for pair in ((KEYS[0], KEYS[1]), (KEYS[2],), (KEYS[3], KEYS[0])):
        assert sink.publish([BlockStored(pair, None, (), RECORD_TOKENS, "cpu")])
    assert [e.block_hashes for e in sink.take()] == [[KEYS[2]], [KEYS[3], KEYS[0]]]
    assert (sink.num_dropped_events, sink.num_dropped_blocks) == (1, 2)


def _stored(key: bytes, medium: str = "cpu") -> vllm_events.BlockStored:
    return vllm_events.BlockStored(
        block_hashes=[key],
        parent_block_hash=None,
        token_ids=[],
        block_size=RECORD_TOKENS,
        lora_id=None,
        medium=medium,
        lora_name=None,
    )


def test_a_steps_events_keep_their_order_and_travel_pickled() -> None:
    gone = vllm_events.BlockRemoved(block_hashes=[KEYS[0]], medium="cpu")
    steps = CacheTierKVEvents([_stored(KEYS[0]), gone, _stored(KEYS[0])])
    steps = pickle.loads(pickle.dumps(steps))  # vLLM may carry it between processes
    assert steps.aggregate().get_all_events() == [_stored(KEYS[0]), gone, _stored(KEYS[0])]
    scheduler = SchedulerEvents()
    scheduler.add(steps)
    scheduler.add(None)  # a step without events
    assert scheduler.take() == [_stored(KEYS[0]), gone, _stored(KEYS[0])]
    assert scheduler.take() == []


def test_aggregating_workers_keeps_what_every_one_of_them_published() -> None:
    first = CacheTierKVEvents([_stored(KEYS[0]), _stored(KEYS[1])])
    first.add_events([_stored(KEYS[1]), _stored(KEYS[2])])
    first.increment_workers()
    assert first.get_number_of_workers() == 2
    assert first.aggregate().get_all_events() == [_stored(KEYS[1])]


def test_events_are_collected_only_where_vllm_publishes_them() -> None:
    assert not kv_events_enabled(VllmConfig())
    on = KVEventsConfig(enable_kv_cache_events=True, publisher="zmq", endpoint="ipc:///tmp/x")
    assert kv_events_enabled(VllmConfig(kv_events_config=on))
    null = KVEventsConfig(enable_kv_cache_events=True, publisher="null")
    assert not kv_events_enabled(VllmConfig(kv_events_config=null))


def test_vllms_publisher_beyond_loopback_is_warned_of() -> None:
    """vLLM's publisher has no authentication, and our tiers' events carry token ids."""
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    logger = logging.getLogger("vllm.cachetier.events")
    logger.addHandler(handler)
    try:
        local = KVEventsConfig(
            enable_kv_cache_events=True, publisher="zmq", endpoint="tcp://127.0.0.1:5557"
        )
        assert kv_events_enabled(VllmConfig(kv_events_config=local))
        assert not records
        wide = KVEventsConfig(enable_kv_cache_events=True, publisher="zmq")  # tcp://*:5557
        assert kv_events_enabled(VllmConfig(kv_events_config=wide))
        assert [r.levelno for r in records] == [logging.WARNING]
        assert "tcp://*:5557" in records[0].getMessage()
    finally:
        logger.removeHandler(handler)


# The worker side, on a real CPU + disk store.


def _caches(seed: int) -> dict[str, torch.Tensor]:
    # vLLM-CPU's per-layer page: [num_blocks, num_kv_heads, block_size, 2 * head_size]
    gen = torch.Generator().manual_seed(seed)
    return {
        name: torch.randn(NUM_BLOCKS, NUM_KV_HEADS, BS, 2 * HEAD_SIZE, generator=gen)
        for name in NAMES
    }


@pytest.fixture
def disk(tmp_path: Path) -> Path:
    return tmp_path / "disk"


def _open(disk: Path) -> TieredStore:
    config = {"cpu_bytes": 16 << 20, "disk_path": str(disk), "record_tokens": RECORD_TOKENS}
    return open_store(ConnectorConfig.from_extra_config(config), with_cpu=True)


@pytest.fixture
def worker(disk: Path) -> Iterator[tuple[CacheTierWorker, TieredStore]]:
    store = _open(disk)
    worker = CacheTierWorker(
        store,
        VllmArrangement(CPU_VEC, LAYOUT),
        NAMES,
        RECORD_TOKENS,
        events=VllmEventSink.for_store(store, "full_attention"),
    )
    worker.register_kv_caches(_caches(0))
    yield worker, store
    worker.close()


def _prefill(scheduler: CacheTierScheduler, request: Request) -> CacheTierConnectorMetadata:
    """The scheduler side's plan of the step that computes ``request``'s whole prompt."""
    assert scheduler.get_num_new_matched_tokens(request, 0) == (0, False)
    blocks = [KVCacheBlock(i) for i in range(4)]
    scheduler.update_state_after_alloc(request, KVCacheBlocks((blocks,)), 0)
    step = SchedulerOutput.make_empty()
    step.scheduled_new_reqs = [NewRequestData.from_request(request, ([0, 1, 2, 3],))]
    step.num_scheduled_tokens = {request.request_id: request.num_tokens}
    step.total_num_scheduled_tokens = request.num_tokens
    return scheduler.build_connector_meta(step)


def _stored_by_medium(events: list[vllm_events.KVCacheEvent]) -> dict[str, list]:
    out: dict[str, list] = {}
    for event in events:
        if isinstance(event, vllm_events.BlockStored):
            out.setdefault(event.medium, []).append(event)
    return out


def _take_until_disk(worker: CacheTierWorker, store: TieredStore) -> list:
    """The worker's events once the disk writer is done (``flush`` waits for it)."""
    store.flush()
    steps = worker.take_kv_events()
    assert steps is not None
    return _round_trip(steps.aggregate().get_all_events())


def test_the_worker_publishes_each_tiers_saves_with_their_tokens(
    worker: tuple[CacheTierWorker, TieredStore],
) -> None:
    worker_side, store = worker
    assert worker_side.take_kv_events() is None  # an empty store announced nothing
    scheduler = CacheTierScheduler(
        None, LAYOUT, "model", "", 0, record_tokens=RECORD_TOKENS, with_tokens=True
    )
    tokens = [(31 * i) % 40000 + 100 for i in range(3 * BS + 5)]
    request = Request("r", tokens, SamplingParams(max_tokens=4), None)
    meta = _prefill(scheduler, request)
    (save,) = meta.saves
    assert save.token_ids == tuple(tokens[: 3 * BS]) and save.parent is None

    worker_side.save(meta)
    by_medium = _stored_by_medium(_take_until_disk(worker_side, store))
    keys = block_keys(scheduler.namespace(None), tokens)
    assert len(keys) == 6
    for medium in ("cpu", "disk"):
        got = [key for event in by_medium[medium] for key in event.block_hashes]
        assert got == keys, medium
        first = by_medium[medium][0]
        assert first.parent_block_hash is None and first.block_size == RECORD_TOKENS
        assert [t for e in by_medium[medium] for t in e.token_ids] == tokens[: 3 * BS]
    assert worker_side.take_kv_events() is None  # each event is handed over once


def test_a_restarted_worker_announces_what_its_disk_holds(disk: Path) -> None:
    scheduler = CacheTierScheduler(None, LAYOUT, "model", "", 0, record_tokens=RECORD_TOKENS)
    request = Request("r", list(range(100, 100 + 2 * BS)), SamplingParams(max_tokens=1), None)
    worker = CacheTierWorker(_open(disk), VllmArrangement(CPU_VEC, LAYOUT), NAMES, RECORD_TOKENS)
    worker.register_kv_caches(_caches(0))
    meta = _prefill(scheduler, request)
    assert meta.saves[0].token_ids == ()  # KV events off: no tokens sent
    worker.save(meta)
    assert worker.take_kv_events() is None  # and nothing collected
    worker.close()  # flushes the disk writes
    keys = block_keys(scheduler.namespace(None), list(request.prompt_token_ids))

    store = _open(disk)
    restarted = CacheTierWorker(
        store, VllmArrangement(CPU_VEC, LAYOUT), NAMES, RECORD_TOKENS, events=VllmEventSink()
    )
    steps = restarted.take_kv_events()
    restarted.close()
    assert steps is not None
    (announce,) = _round_trip(steps.get_all_events())
    assert announce.medium == "disk" and sorted(announce.block_hashes) == sorted(keys)
    assert announce.token_ids == [] and announce.parent_block_hash is None
    assert announce.block_size == RECORD_TOKENS
