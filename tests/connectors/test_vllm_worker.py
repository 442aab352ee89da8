"""The worker side's loads on vLLM-CPU-shaped pages: restored records land whole in the pages,
and what copying them in cost reaches the scheduler's cost model. The store is a real disk tier.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm")

from cachetier.connectors.config import ConnectorConfig, open_store  # noqa: E402
from cachetier.connectors.vllm.cpu_index import WorkerCPUIndex  # noqa: E402
from cachetier.connectors.vllm.layouts import CPU_VEC, VllmArrangement  # noqa: E402
from cachetier.connectors.vllm.metadata import (  # noqa: E402
    BlockTransfer,
    CacheTierConnectorMetadata,
    StoredBlocks,
)
from cachetier.connectors.vllm.paged import PagedKV  # noqa: E402
from cachetier.connectors.vllm.worker import CacheTierWorker  # noqa: E402
from cachetier.kernels.staging import payload_view  # noqa: E402
from cachetier.primitives.keys import BlockHash, KVLayout, Namespace, block_keys  # noqa: E402
from cachetier.record import KVBlock  # noqa: E402
from cachetier.store.tiered import TieredStore  # noqa: E402

pytestmark = pytest.mark.vllm

NUM_LAYERS, NUM_KV_HEADS, BS, HEAD_SIZE, NUM_BLOCKS = 2, 2, 32, 8, 8
LAYOUT = KVLayout("float32", BS, NUM_LAYERS, NUM_KV_HEADS, HEAD_SIZE)
NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(NUM_LAYERS)]


def _caches(seed: int) -> dict[str, torch.Tensor]:
    # vLLM-CPU's per-layer page: [num_blocks, num_kv_heads, block_size, 2 * head_size]
    gen = torch.Generator().manual_seed(seed)
    return {
        name: torch.randn(NUM_BLOCKS, NUM_KV_HEADS, BS, 2 * HEAD_SIZE, generator=gen)
        for name in NAMES
    }


@pytest.fixture
def store(tmp_path: Path) -> Iterator[TieredStore]:
    with open_store(
        ConnectorConfig.from_extra_config({"cpu_bytes": 0, "disk_path": str(tmp_path)}),
        with_cpu=False,
    ) as s:
        yield s


def _put(
    store: TieredStore, namespace: Namespace, keys: list[BlockHash], payloads: list[torch.Tensor]
) -> None:
    """Store one record per key, its payload a canonical block gathered from pages."""
    layout = namespace.layout
    records = [
        KVBlock(key, namespace.fingerprint, layout.dtype, layout.payload_shape, BS, view)
        for key, view in zip(keys, map(payload_view, payloads), strict=True)
    ]
    store.put_many(namespace.id, records)
    store.flush()


def test_load_lands_whole_blocks_and_reports_its_copy(store: TieredStore) -> None:
    arrangement = VllmArrangement(CPU_VEC, LAYOUT)
    namespace = Namespace("test-model", LAYOUT)
    keys = block_keys(namespace, list(range(100, 100 + 3 * BS)))
    source = PagedKV(_caches(0), NAMES, arrangement)
    payloads = source.gather([5, 1, 6])
    _put(store, namespace, keys, payloads)

    caches = _caches(1)
    worker = CacheTierWorker(store, arrangement, NAMES, BS)
    worker.register_kv_caches(caches)
    transfer = BlockTransfer("r", namespace.id, namespace.fingerprint, tuple(keys), (2, 3, 4))
    worker.step_started()
    worker.load(CacheTierConnectorMetadata(loads=[transfer]))

    assert worker.take_failed_block_ids() == set()
    landed = PagedKV(caches, NAMES, arrangement).gather([2, 3, 4])
    for got, want in zip(landed, payloads, strict=True):
        assert torch.equal(got, want)
    report = worker.take_report()
    assert report is not None
    ((nbytes, seconds),) = report.copies
    assert nbytes == 3 * LAYOUT.block_bytes
    assert seconds > 0
    stats = worker.take_stats()
    assert stats is not None
    assert 0 < stats.data["copy_s"] <= stats.data["load_s"]
    assert stats.data["num_loaded_blocks"] == 3


def _first_of_three_stored(
    store: TieredStore,
) -> tuple[CacheTierWorker, Namespace, list[BlockHash], BlockTransfer]:
    """A worker and a load of three blocks into pages 2-4, of which the store holds the first."""
    arrangement = VllmArrangement(CPU_VEC, LAYOUT)
    namespace = Namespace("test-model", LAYOUT)
    keys = block_keys(namespace, list(range(100, 100 + 3 * BS)))
    (payload,) = PagedKV(_caches(0), NAMES, arrangement).gather([5])
    _put(store, namespace, keys[:1], [payload])
    worker = CacheTierWorker(store, arrangement, NAMES, BS)
    worker.register_kv_caches(_caches(1))
    transfer = BlockTransfer("r", namespace.id, namespace.fingerprint, tuple(keys), (2, 3, 4))
    return worker, namespace, keys, transfer


def test_failed_load_copies_only_the_good_prefix(store: TieredStore) -> None:
    worker, namespace, keys, transfer = _first_of_three_stored(store)
    worker.load(CacheTierConnectorMetadata(loads=[transfer]))

    assert worker.take_failed_block_ids() == {3, 4}
    report = worker.take_report()
    assert report is not None
    assert [nbytes for nbytes, _ in report.copies] == [LAYOUT.block_bytes]
    assert report.failed == {namespace.id: list(keys[1:])}


def _finished_loads(worker: CacheTierWorker, timeout_s: float = 30.0) -> set[str]:
    """Wait until the loader thread reports a finished load; what it reported."""
    return _load_results(worker, timeout_s, take=lambda: (worker.take_finished_loads(), set()))[0]


def _load_results(
    worker: CacheTierWorker,
    timeout_s: float = 30.0,
    take: Callable[[], tuple[set[str], set[str]]] | None = None,
) -> tuple[set[str], set[str]]:
    """Wait until the loader thread reports a finished load: the finished requests and the
    failed ones (``take_load_results``, or ``take``)."""
    take = take or worker.take_load_results
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        finished, failed = take()
        if finished:
            return finished, failed
        time.sleep(0.005)
    raise AssertionError(f"no async load finished within {timeout_s} s")


def test_async_load_lands_beside_the_step_and_is_reported_finished(store: TieredStore) -> None:
    arrangement = VllmArrangement(CPU_VEC, LAYOUT)
    namespace = Namespace("test-model", LAYOUT)
    keys = block_keys(namespace, list(range(100, 100 + 3 * BS)))
    payloads = PagedKV(_caches(0), NAMES, arrangement).gather([5, 1, 6])
    _put(store, namespace, keys, payloads)

    caches = _caches(1)
    worker = CacheTierWorker(store, arrangement, NAMES, BS)
    worker.register_kv_caches(caches)
    transfer = BlockTransfer("r", namespace.id, namespace.fingerprint, tuple(keys), (2, 3, 4))
    worker.load(CacheTierConnectorMetadata(async_loads=[transfer]))

    assert _finished_loads(worker) == {"r"}
    assert worker.take_failed_block_ids() == set()
    landed = PagedKV(caches, NAMES, arrangement).gather([2, 3, 4])
    for got, want in zip(landed, payloads, strict=True):
        assert torch.equal(got, want)
    stats = worker.take_stats()
    assert stats is not None
    assert stats.data["num_async_loads"] == 1 and stats.data["num_loaded_blocks"] == 3
    assert worker.take_finished_loads() == set()  # reported once
    worker.close()


def test_failed_async_load_names_its_blocks_before_its_request(store: TieredStore) -> None:
    # vLLM takes a finished request as loaded up to its first failed block: the failed ids must
    # be in hand by the time the request is reported finished (the same step, or earlier).
    worker, namespace, keys, transfer = _first_of_three_stored(store)
    worker.load(CacheTierConnectorMetadata(async_loads=[transfer]))

    assert _finished_loads(worker) == {"r"}
    assert worker.take_failed_block_ids() == {3, 4}
    report = worker.take_report()
    assert report is not None and report.failed == {namespace.id: list(keys[1:])}
    # The failure was the tier's, not this step's forward's: a save of the request in this
    # step is not dropped (the sync path drops it, since its forward read the failed blocks).
    save = BlockTransfer("r", namespace.id, namespace.fingerprint, tuple(keys[:1]), (2,))
    worker.save(CacheTierConnectorMetadata(saves=[save]))
    report = worker.take_report()
    assert report is not None and report.stored == {namespace.id: [keys[0]]}
    worker.close()


def test_an_async_load_that_raises_still_finishes_its_request(store: TieredStore) -> None:
    # A request aborted while it loads keeps its blocks until vLLM hears it finished: a load
    # that dies must still be reported, or those blocks leak.
    arrangement = VllmArrangement(CPU_VEC, LAYOUT)
    namespace = Namespace("test-model", LAYOUT)
    keys = block_keys(namespace, list(range(100, 100 + 2 * BS)))
    worker = CacheTierWorker(store, arrangement, NAMES, BS)
    worker.register_kv_caches(_caches(1))
    bad = BlockTransfer("r", namespace.id, namespace.fingerprint, tuple(keys), (2, NUM_BLOCKS))
    _put(store, namespace, keys, PagedKV(_caches(0), NAMES, arrangement).gather([0, 1]))
    worker.load(CacheTierConnectorMetadata(async_loads=[bad]))  # block id out of range

    assert _finished_loads(worker) == {"r"}
    assert worker.take_failed_block_ids() == {2, NUM_BLOCKS}
    worker.close()


RECORD_TOKENS = BS // 2
RECORD_LAYOUT = KVLayout("float32", RECORD_TOKENS, NUM_LAYERS, NUM_KV_HEADS, HEAD_SIZE)


def test_a_block_is_saved_as_records_of_record_tokens(store: TieredStore) -> None:
    # vLLM at 32 tokens a block, records of 16: each block is two records, each holding its
    # half of the tokens, readable by an engine that pages by 16.
    arrangement = VllmArrangement(CPU_VEC, LAYOUT)
    namespace = Namespace("test-model", RECORD_LAYOUT)
    keys = block_keys(namespace, list(range(100, 100 + 2 * BS)))
    assert len(keys) == 4
    caches = _caches(0)
    worker = CacheTierWorker(store, arrangement, NAMES, RECORD_TOKENS)
    worker.register_kv_caches(caches)
    save = BlockTransfer("r", namespace.id, namespace.fingerprint, tuple(keys), (5, 1))
    worker.save(CacheTierConnectorMetadata(saves=[save]))
    store.flush()

    blocks = PagedKV(caches, NAMES, arrangement).gather([5, 1])
    records = store.get_many(namespace.id, keys)
    for i, record in enumerate(records):
        assert record is not None and record.num_tokens == RECORD_TOKENS
        assert tuple(record.shape) == RECORD_LAYOUT.payload_shape
        half = blocks[i // 2][:, :, (i % 2) * RECORD_TOKENS : (i % 2 + 1) * RECORD_TOKENS]
        got = torch.frombuffer(bytearray(record.data), dtype=torch.float32)
        assert torch.equal(got.view(RECORD_LAYOUT.payload_shape), half)
    report = worker.take_report()
    assert report is not None and report.stored == {namespace.id: keys}
    worker.close()


def test_records_of_a_block_are_joined_on_load_and_a_half_block_is_not_loaded(
    store: TieredStore,
) -> None:
    arrangement = VllmArrangement(CPU_VEC, LAYOUT)
    namespace = Namespace("test-model", RECORD_LAYOUT)
    keys = block_keys(namespace, list(range(100, 100 + 2 * BS)))
    # Three of the four records: the first block whole, the second only its first half.
    source = PagedKV(_caches(0), NAMES, arrangement).gather([5, 1])
    halves = [b[:, :, s : s + RECORD_TOKENS].contiguous() for b in source for s in (0, 16)]
    store.put_many(
        namespace.id,
        [
            KVBlock(
                key,
                namespace.fingerprint,
                "float32",
                RECORD_LAYOUT.payload_shape,
                RECORD_TOKENS,
                payload_view(half),
            )
            for key, half in zip(keys[:3], halves[:3], strict=True)
        ],
    )
    store.flush()

    caches = _caches(1)
    worker = CacheTierWorker(store, arrangement, NAMES, RECORD_TOKENS)
    worker.register_kv_caches(caches)
    transfer = BlockTransfer("r", namespace.id, namespace.fingerprint, tuple(keys), (2, 3))
    worker.load(CacheTierConnectorMetadata(loads=[transfer]))

    assert worker.take_failed_block_ids() == {3}
    (landed,) = PagedKV(caches, NAMES, arrangement).gather([2])
    assert torch.equal(landed, source[0])
    report = worker.take_report()
    assert report is not None
    assert [nbytes for nbytes, _ in report.copies] == [LAYOUT.block_bytes]
    assert report.failed == {namespace.id: list(keys[2:])}  # both records of the failed block
    worker.close()


def test_a_load_is_reported_as_a_use_of_the_cpu_tier(tmp_path: Path) -> None:
    # The scheduler's view of the worker's CPU tier is an LRU like the tier: a load touches the
    # tier's record (or promotes a lower tier's into it), so the view must move it up too, or a
    # conversation the tier keeps serving ages out of the view and its next turn misses.
    config = ConnectorConfig.from_extra_config({"cpu_bytes": 1 << 20, "disk_path": str(tmp_path)})
    with open_store(config, with_cpu=True) as store:
        arrangement = VllmArrangement(CPU_VEC, LAYOUT)
        namespace = Namespace("test-model", LAYOUT)
        keys = block_keys(namespace, list(range(100, 100 + 2 * BS)))
        _put(store, namespace, keys, PagedKV(_caches(0), NAMES, arrangement).gather([5, 1]))
        worker = CacheTierWorker(store, arrangement, NAMES, BS)
        worker.register_kv_caches(_caches(1))
        transfer = BlockTransfer("r", namespace.id, namespace.fingerprint, tuple(keys), (2, 3))
        worker.load(CacheTierConnectorMetadata(loads=[transfer]))
        report = worker.take_report()
    assert report is not None and report.stored == {namespace.id: list(keys)}
    index = WorkerCPUIndex(max_blocks=3)
    others = block_keys(namespace, list(range(900, 900 + 2 * BS)))
    index.update(StoredBlocks(stored={namespace.id: [keys[0], keys[1], others[0]]}))
    index.update(report)  # keys 0 and 1 used again: others[0] is now the oldest
    index.update(StoredBlocks(stored={namespace.id: [others[1]]}))
    assert index.leading(namespace.id, keys) == 2
    assert index.leading(namespace.id, others) == 0


def test_two_groups_load_their_own_layers_and_fail_by_request(store: TieredStore) -> None:
    # vLLM's hybrid manager: layer 0 one group, layer 1 another, each with its own block ids
    # into the same pages; a request's loads of both groups end together, and a failure is
    # reported by request (vLLM refuses block ids with several groups).
    one = KVLayout("float32", BS, 1, NUM_KV_HEADS, HEAD_SIZE)
    arrangement = VllmArrangement(CPU_VEC, one)
    spaces = [Namespace("test-model", one, "", str(i)) for i in range(2)]
    keys = [block_keys(ns, list(range(100, 100 + 2 * BS))) for ns in spaces]
    source = _caches(0)
    for i, ns in enumerate(spaces):
        _put(store, ns, keys[i], PagedKV(source, NAMES[i : i + 1], arrangement).gather([5, 6]))
    caches = _caches(1)
    worker = CacheTierWorker(
        store, arrangement, NAMES[:1], BS, more_groups=[(arrangement, NAMES[1:])]
    )
    worker.register_kv_caches(caches)
    # Group 0 loads blocks 0-1 into pages 2-3; group 1 only its second block, into page 7.
    loads = [
        BlockTransfer("r", spaces[0].id, spaces[0].fingerprint, tuple(keys[0]), (2, 3)),
        BlockTransfer("r", spaces[1].id, spaces[1].fingerprint, tuple(keys[1][1:]), (7,), group=1),
    ]
    worker.load(CacheTierConnectorMetadata(async_loads=loads))
    assert _load_results(worker) == ({"r"}, set())
    assert torch.equal(caches[NAMES[0]][2:4], source[NAMES[0]][5:7])
    assert torch.equal(caches[NAMES[1]][7], source[NAMES[1]][6])
    assert not torch.equal(caches[NAMES[1]][2], source[NAMES[1]][5])  # layer 1 not loaded there

    # The second group's record gone: the request fails as a whole, no block id is named.
    store.delete(spaces[1].id, keys[1][1:])
    worker.load(
        CacheTierConnectorMetadata(
            async_loads=[replace(loads[0], req_id="s"), replace(loads[1], req_id="s")]
        )
    )
    assert _load_results(worker) == ({"s"}, {"s"})
    assert worker.take_failed_block_ids() == set()
    worker.close()
