"""The scheduler side with several KV cache groups (vLLM's hybrid manager), on vLLM's own
request, block and spec types and a real disk tier: a full-attention group and a sliding-window
group, as vLLM makes of Gemma 3's layers. Saves of the sliding group hold the window a hit of
the prompt needs; a hit is offered only where every group holds what it needs at its end, and
then loads each group's blocks into that group's block ids, asynchronously."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm")

from vllm import SamplingParams  # noqa: E402
from vllm.v1.core.kv_cache_manager import KVCacheBlocks  # noqa: E402
from vllm.v1.core.kv_cache_utils import KVCacheBlock  # noqa: E402
from vllm.v1.core.sched.output import (  # noqa: E402
    CachedRequestData,
    NewRequestData,
    SchedulerOutput,
)
from vllm.v1.kv_cache_interface import (  # noqa: E402
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    SlidingWindowSpec,
)
from vllm.v1.request import Request  # noqa: E402

from cachetier.connectors.config import ConnectorConfig, open_store  # noqa: E402
from cachetier.connectors.vllm.kv_groups import storable_groups  # noqa: E402
from cachetier.connectors.vllm.metadata import BlockTransfer, StoredBlocks  # noqa: E402
from cachetier.connectors.vllm.scheduler import CacheTierScheduler  # noqa: E402
from cachetier.primitives.keys import KVLayout  # noqa: E402
from cachetier.record import KVBlock  # noqa: E402
from cachetier.store.tiered import TieredStore  # noqa: E402

pytestmark = pytest.mark.vllm

BS, WINDOW = 32, 48
SHAPE = {"block_size": BS, "num_kv_heads": 1, "head_size": 32, "dtype": torch.float32}
LAYOUT = KVLayout("float32", BS, num_layers=2, num_kv_heads=1, head_dim=32)
PROMPT = 6 * BS + 5  # 6 full blocks; a hit ends at 192, whose window is blocks 4 and 5


@pytest.fixture
def store(tmp_path: Path) -> Iterator[TieredStore]:
    config = ConnectorConfig.from_extra_config({"cpu_bytes": 0, "disk_path": str(tmp_path)})
    with open_store(config, with_cpu=False) as s:
        yield s


def _scheduler(store: TieredStore) -> CacheTierScheduler:
    groups = [
        KVCacheGroupSpec(
            ["model.layers.1.attn", "model.layers.3.attn"], FullAttentionSpec(**SHAPE)
        ),
        KVCacheGroupSpec(
            ["model.layers.0.attn", "model.layers.2.attn"],
            SlidingWindowSpec(**SHAPE, sliding_window=WINDOW),
        ),
    ]
    config = KVCacheConfig(num_blocks=64, kv_cache_tensors=[], kv_cache_groups=groups)
    stored = storable_groups(config, "/models/tiny")
    return CacheTierScheduler(
        store,
        LAYOUT,
        "test-model",
        "acme",
        0,
        cost_model=False,
        load_async="never",  # several groups load asynchronously all the same
        record_tokens=BS,
        groups=[(group, LAYOUT) for group in stored],
    )


def _request(req_id: str, num_tokens: int) -> Request:
    tokens = [(31 * i) % 40000 + 100 for i in range(num_tokens)]
    return Request(req_id, tokens, SamplingParams(max_tokens=4), None)


def _prefill(sched: CacheTierScheduler, request: Request, ids: tuple[list[int], ...]):
    """One step computing the whole prompt: its metadata."""
    assert sched.get_num_new_matched_tokens(request, 0)[0] == 0
    sched.update_state_after_alloc(request, KVCacheBlocks(((), ())), 0)
    out = SchedulerOutput.make_empty()
    out.scheduled_new_reqs = [NewRequestData.from_request(request, ids)]
    out.num_scheduled_tokens = {request.request_id: request.num_tokens}
    out.total_num_scheduled_tokens = request.num_tokens
    return sched.build_connector_meta(out)


def _store_saves(store: TieredStore, saves: list[BlockTransfer]) -> None:
    """What the worker would store of the saves (records of zeros: the plan is under test)."""
    for save in saves:
        records = [
            KVBlock(
                key,
                save.fingerprint,
                "float32",
                LAYOUT.payload_shape,
                BS,
                bytes(LAYOUT.block_bytes),
            )
            for key in save.keys
        ]
        store.put_many(save.namespace_id, records)
    store.flush()


def _blocks(*ids: list[int]) -> KVCacheBlocks:
    return KVCacheBlocks(tuple([KVCacheBlock(i) for i in group] for group in ids))


def test_the_sliding_group_saves_only_the_window_a_hit_needs(store: TieredStore) -> None:
    meta = _prefill(
        _scheduler(store), _request("a", PROMPT), ([1, 2, 3, 4, 5, 6, 7], list(range(11, 18)))
    )
    by_group = {save.group: save for save in meta.saves}
    assert by_group[0].block_ids == (1, 2, 3, 4, 5, 6)
    assert by_group[1].block_ids == (15, 16)  # blocks 4 and 5
    assert by_group[0].namespace_id != by_group[1].namespace_id
    assert len(by_group[1].keys) == 2


def test_a_hit_loads_each_group_into_its_own_blocks_asynchronously(store: TieredStore) -> None:
    meta = _prefill(
        _scheduler(store), _request("a", PROMPT), ([1, 2, 3, 4, 5, 6, 7], list(range(11, 18)))
    )
    _store_saves(store, meta.saves)
    sched = _scheduler(store)  # a restart
    request = _request("b", PROMPT)
    assert sched.get_num_new_matched_tokens(request, 0) == (6 * BS, True)
    # vLLM pads the sliding group's blocks before the window with its null block (id 0).
    sched.update_state_after_alloc(
        request, _blocks(list(range(21, 28)), [0, 0, 0, 0, 35, 36, 37]), 6 * BS
    )
    loads = {
        t.group: t for t in sched.build_connector_meta(SchedulerOutput.make_empty()).async_loads
    }
    assert loads[0].block_ids == (21, 22, 23, 24, 25, 26)
    assert loads[1].block_ids == (35, 36)
    assert loads[1].keys == {s.group: s for s in meta.saves}[1].keys

    # The next turn of the chat extends the prompt: the same hit serves it.
    longer = _request("c", PROMPT + 60)
    assert _scheduler(store).get_num_new_matched_tokens(longer, 0) == (6 * BS, True)


def test_no_hit_where_a_window_is_not_whole(store: TieredStore) -> None:
    meta = _prefill(
        _scheduler(store), _request("a", PROMPT), ([1, 2, 3, 4, 5, 6, 7], list(range(11, 18)))
    )
    sliding = {s.group: s for s in meta.saves}[1]
    _store_saves(store, [s for s in meta.saves if s.group == 0])
    _store_saves(
        store,
        [BlockTransfer("a", sliding.namespace_id, sliding.fingerprint, sliding.keys[:1], (15,))],
    )
    # Every full block is held, but the window of a hit at 192 lacks block 5, and no shorter
    # hit's window was stored: nothing is offered.
    assert _scheduler(store).get_num_new_matched_tokens(_request("b", PROMPT), 0) == (0, False)


def test_a_failed_sliding_record_stops_later_hits_before_it(store: TieredStore) -> None:
    meta = _prefill(
        _scheduler(store), _request("a", PROMPT), ([1, 2, 3, 4, 5, 6, 7], list(range(11, 18)))
    )
    _store_saves(store, meta.saves)
    sched = _scheduler(store)
    request = _request("b", PROMPT)
    assert sched.get_num_new_matched_tokens(request, 0) == (6 * BS, True)
    blocks = _blocks(list(range(21, 28)), [0, 0, 0, 0, 35, 36, 37])
    sched.update_state_after_alloc(request, blocks, 6 * BS)
    sliding = {s.group: s for s in meta.saves}[1]
    # The worker could not load the sliding group's block 5: vLLM starts the request over,
    # and asks again; no hit may reach that block.
    sched.update_connector_output(StoredBlocks(failed={sliding.namespace_id: [sliding.keys[1]]}))
    assert sched.get_num_new_matched_tokens(request, 0) == (0, False)


def test_a_preempted_request_resumes_with_every_groups_new_blocks(store: TieredStore) -> None:
    sched = _scheduler(store)
    request = _request("a", PROMPT)
    _prefill(sched, request, ([1, 2, 3, 4, 5, 6, 7], list(range(11, 18))))
    out = SchedulerOutput.make_empty()
    out.preempted_req_ids = {"a"}
    sched.build_connector_meta(out)
    request.append_output_token_ids(list(range(200, 200 + 2 * BS)))  # two more full blocks
    out = SchedulerOutput.make_empty()
    out.scheduled_cached_reqs = CachedRequestData(
        req_ids=["a"],
        resumed_req_ids={"a"},
        new_token_ids=[[]],
        all_token_ids={},
        new_block_ids=[(list(range(31, 40)), [0, 0, 0, 0, 0, 45, 46, 47, 48])],
        num_computed_tokens=[0],
        num_output_tokens=[2 * BS],
    )
    out.num_scheduled_tokens = {"a": PROMPT + 2 * BS}
    saves = {s.group: s for s in sched.build_connector_meta(out).saves}
    # Blocks 6 and 7 are new: each group saves them into its new block ids.
    assert saves[0].block_ids == (37, 38)
    assert saves[1].block_ids == (46, 47)
