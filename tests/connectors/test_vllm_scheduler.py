"""The scheduler side's plan, step by step, on vLLM's own request and scheduler-output types.

Exact block ids and keys, as vLLM's prefix-caching tests do; the store is a real disk tier.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from vllm import SamplingParams  # noqa: E402
from vllm.v1.core.kv_cache_manager import KVCacheBlocks  # noqa: E402
from vllm.v1.core.kv_cache_utils import KVCacheBlock  # noqa: E402
from vllm.v1.core.sched.output import (  # noqa: E402
    CachedRequestData,
    NewRequestData,
    SchedulerOutput,
)
from vllm.v1.request import Request  # noqa: E402

from cachetier.connectors.config import ConnectorConfig, open_store  # noqa: E402
from cachetier.connectors.vllm.metadata import StoredBlocks  # noqa: E402
from cachetier.connectors.vllm.scheduler import CacheTierScheduler  # noqa: E402
from cachetier.primitives.keys import BlockHash, KVLayout, Namespace, block_keys  # noqa: E402
from cachetier.record import KVBlock  # noqa: E402
from cachetier.store.costmodel import PrefillModel  # noqa: E402
from cachetier.store.tiered import TieredStore  # noqa: E402

pytestmark = pytest.mark.vllm

BS = 32  # block size
LAYOUT = KVLayout("float32", BS, num_layers=2, num_kv_heads=1, head_dim=32)
FINGERPRINT = "test-model"


def _config(**settings: object) -> ConnectorConfig:
    return ConnectorConfig.from_extra_config(settings)


@pytest.fixture
def store(tmp_path: Path) -> Iterator[TieredStore]:
    with open_store(_config(cpu_bytes=0, disk_path=str(tmp_path)), with_cpu=False) as s:
        yield s


def _request(req_id: str, num_tokens: int, salt: str | None = None, seed: int = 0) -> Request:
    tokens = [(seed * 7919 + 31 * i) % 40000 + 100 for i in range(num_tokens)]
    return Request(req_id, tokens, SamplingParams(max_tokens=16), None, cache_salt=salt)


def _put(store: TieredStore, namespace: Namespace, keys: list[BlockHash]) -> None:
    blocks = [
        KVBlock(
            key,
            namespace.fingerprint,
            LAYOUT.dtype,
            LAYOUT.payload_shape,
            BS,
            bytes(LAYOUT.block_bytes),
        )
        for key in keys
    ]
    store.put_many(namespace.id, blocks)
    store.flush()


def _blocks(block_ids: list[int]) -> KVCacheBlocks:
    return KVCacheBlocks(([KVCacheBlock(i) for i in block_ids],))


def _new_step(request: Request, block_ids: list[int], num_computed: int, num_new: int):
    request.num_computed_tokens = num_computed
    out = SchedulerOutput.make_empty()
    out.scheduled_new_reqs = [NewRequestData.from_request(request, (block_ids,))]
    out.num_scheduled_tokens = {request.request_id: num_new}
    out.total_num_scheduled_tokens = num_new
    return out


def _cached_step(
    request: Request,
    new_block_ids: list[int] | None,
    num_computed: int,
    num_new: int,
    resumed: bool = False,
) -> SchedulerOutput:
    out = SchedulerOutput.make_empty()
    out.scheduled_cached_reqs = CachedRequestData(
        req_ids=[request.request_id],
        resumed_req_ids={request.request_id} if resumed else set(),
        new_token_ids=[[]],
        all_token_ids={},
        new_block_ids=[(new_block_ids,) if new_block_ids is not None else None],
        num_computed_tokens=[num_computed],
        num_output_tokens=[len(request.output_token_ids)],
    )
    out.num_scheduled_tokens = {request.request_id: num_new}
    out.total_num_scheduled_tokens = num_new
    return out


def _scheduler(store: TieredStore | None, cpu_index_blocks: int = 0) -> CacheTierScheduler:
    return CacheTierScheduler(
        store, LAYOUT, FINGERPRINT, "acme", cpu_index_blocks, record_tokens=BS
    )


def test_hit_counts_stored_blocks_after_the_local_hit(store: TieredStore) -> None:
    sched = _scheduler(store)
    request = _request("r", 5 * BS + 10)
    ns = sched.namespace(None)
    keys = block_keys(ns, request.prompt_token_ids)
    assert len(keys) == 5
    assert sched.get_num_new_matched_tokens(request, 0) == (0, False)
    _put(store, ns, keys[:3])
    assert sched.get_num_new_matched_tokens(request, 0) == (3 * BS, False)
    assert sched.get_num_new_matched_tokens(request, BS) == (2 * BS, False)
    assert sched.get_num_new_matched_tokens(request, 3 * BS) == (0, False)
    assert sched.get_num_new_matched_tokens(request, 17) == (0, False)  # not block aligned


def test_hit_leaves_the_last_token_to_compute(store: TieredStore) -> None:
    sched = _scheduler(store)
    request = _request("r", 4 * BS)  # exactly four full blocks
    _put(store, sched.namespace(None), block_keys(sched.namespace(None), request.prompt_token_ids))
    assert sched.get_num_new_matched_tokens(request, 0) == (3 * BS, False)


def test_tenant_and_cache_salt_scope_the_keys(store: TieredStore) -> None:
    sched = _scheduler(store)
    request = _request("r", 3 * BS + 1)
    _put(store, sched.namespace(None), block_keys(sched.namespace(None), request.prompt_token_ids))
    assert sched.get_num_new_matched_tokens(request, 0) == (3 * BS, False)
    salted = _request("s", 3 * BS + 1, salt="user-42")
    assert sched.get_num_new_matched_tokens(salted, 0) == (0, False)
    other_tenant = CacheTierScheduler(store, LAYOUT, FINGERPRINT, "globex", 0, record_tokens=BS)
    assert other_tenant.get_num_new_matched_tokens(_request("t", 3 * BS + 1), 0) == (0, False)


def test_plan_loads_the_hit_and_saves_what_the_step_completes(store: TieredStore) -> None:
    sched = _scheduler(store)
    request = _request("r", 5 * BS + 10)
    ns = sched.namespace(None)
    keys = block_keys(ns, request.prompt_token_ids)
    _put(store, ns, keys[1:3])  # block 0 is vLLM's own hit; blocks 1-2 are stored
    block_ids = [40, 41, 42, 43, 44, 45]

    assert sched.get_num_new_matched_tokens(request, BS) == (2 * BS, False)
    sched.update_state_after_alloc(request, _blocks(block_ids), 2 * BS)
    meta = sched.build_connector_meta(_new_step(request, block_ids, 3 * BS, 2 * BS + 10))

    (load,) = meta.loads
    assert (load.req_id, load.namespace_id, load.fingerprint) == ("r", ns.id, ns.fingerprint)
    assert load.keys == tuple(keys[1:3]) and load.block_ids == (41, 42)
    (save,) = meta.saves  # blocks 3 and 4 become full this step; the partial block 5 does not
    assert save.keys == tuple(keys[3:5]) and save.block_ids == (43, 44)
    assert save.generated == ()  # all prompt

    # Decode: the step that computes token 6 * BS - 1 completes block 5 (prompt + outputs).
    request.append_output_token_ids(list(range(1000, 1000 + BS - 10)))
    assert sched.build_connector_meta(_cached_step(request, None, 5 * BS + 10, BS - 11)).saves == []
    meta = sched.build_connector_meta(_cached_step(request, [46], 6 * BS - 1, 1))
    assert meta.loads == []
    (save,) = meta.saves
    full = block_keys(ns, list(request.all_token_ids))
    assert save.keys == (full[5],) and save.block_ids == (45,)
    assert save.generated == (True,)  # it ends past the prompt: admission may treat it apart
    assert sched.request_finished(request) == (False, None)
    assert sched.build_connector_meta(_cached_step(request, None, 6 * BS, 1)).saves == []


def test_chunked_prefill_saves_each_chunk_once(store: TieredStore) -> None:
    sched = _scheduler(store)
    request = _request("r", 4 * BS + 5)
    keys = block_keys(sched.namespace(None), request.prompt_token_ids)
    block_ids = [7, 3, 9, 1, 2]
    assert sched.get_num_new_matched_tokens(request, 0) == (0, False)
    sched.update_state_after_alloc(request, _blocks(block_ids[:2]), 0)
    first = sched.build_connector_meta(_new_step(request, block_ids[:2], 0, 2 * BS - 3))
    assert [(s.keys, s.block_ids) for s in first.saves] == [((keys[0],), (7,))]
    second = sched.build_connector_meta(
        _cached_step(request, block_ids[2:], 2 * BS - 3, 2 * BS + 8)
    )
    assert [(s.keys, s.block_ids) for s in second.saves] == [(tuple(keys[1:4]), (3, 9, 1))]


def test_failed_load_is_saved_again_once_recomputed(store: TieredStore) -> None:
    sched = _scheduler(store)
    request = _request("r", 4 * BS + 5)
    ns = sched.namespace(None)
    keys = block_keys(ns, request.prompt_token_ids)
    _put(store, ns, keys)
    block_ids = [10, 11, 12, 13, 14]
    assert sched.get_num_new_matched_tokens(request, 0) == (4 * BS, False)
    sched.update_state_after_alloc(request, _blocks(block_ids), 4 * BS)
    meta = sched.build_connector_meta(_new_step(request, block_ids, 4 * BS, 5))
    assert len(meta.loads) == 1 and meta.saves == []

    # The worker could restore blocks 0-1 only; vLLM rewinds to token 2 * BS and recomputes.
    sched.update_connector_output(StoredBlocks(failed={ns.id: list(keys[2:])}))
    meta = sched.build_connector_meta(_cached_step(request, [], 2 * BS, 2 * BS + 5))
    (save,) = meta.saves
    assert save.keys == tuple(keys[2:4]) and save.block_ids == (12, 13)


def test_preempted_request_resumes_with_its_new_blocks(store: TieredStore) -> None:
    sched = _scheduler(store)
    request = _request("r", 3 * BS + 5)
    keys = block_keys(sched.namespace(None), request.prompt_token_ids)
    sched.get_num_new_matched_tokens(request, 0)
    sched.update_state_after_alloc(request, _blocks([1, 2]), 0)
    meta = sched.build_connector_meta(_new_step(request, [1, 2], 0, 2 * BS))
    assert [s.block_ids for s in meta.saves] == [(1, 2)]
    preempt = SchedulerOutput.make_empty()
    preempt.preempted_req_ids = {"r"}
    assert sched.build_connector_meta(preempt).saves == []
    meta = sched.build_connector_meta(
        _cached_step(request, [5, 6, 7, 8], 0, 3 * BS + 5, resumed=True)
    )
    assert [(s.keys, s.block_ids) for s in meta.saves] == [((keys[2],), (7,))]


def test_worker_cpu_tier_is_seen_through_its_reports() -> None:
    sched = _scheduler(None, cpu_index_blocks=2)
    ns = sched.namespace(None)
    request = _request("r", 3 * BS + 1)
    keys = block_keys(ns, request.prompt_token_ids)
    assert sched.get_num_new_matched_tokens(request, 0) == (0, False)
    sched.update_connector_output(StoredBlocks(stored={ns.id: keys}))
    # The index keeps the two most recent keys, like an LRU tier of two blocks: key 0 is gone.
    assert sched.get_num_new_matched_tokens(request, 0) == (0, False)
    sched.update_connector_output(StoredBlocks(stored={ns.id: keys[:2]}))
    assert sched.get_num_new_matched_tokens(request, 0) == (2 * BS, False)
    from vllm.v1.metrics.cache_hit_source import CacheHitSource

    assert sched.hit_sources(request, 2 * BS) == {CacheHitSource.HOST: 2 * BS}
    sched.update_connector_output(StoredBlocks(failed={ns.id: [keys[1]]}))
    assert sched.get_num_new_matched_tokens(request, 0) == (BS, False)


def _teach(sched: CacheTierScheduler, tier_gbps: float) -> None:
    """What the worker reports after reads and prefill steps: a tier at ``tier_gbps`` and a
    prefill of 1 ms per token (as ``StoredBlocks`` carries them from the worker's process)."""
    from cachetier.store.costmodel import TierRate

    steps = [(n, PrefillModel.attention_work(n, 0), 1e-3 * n) for n in (64, 256, 1024)]
    rate = TierRate(1e-4, 1e-9 / tier_gbps, 4, 0.0)
    sched.update_connector_output(StoredBlocks(steps=steps, rates={"disk": rate}))


def test_cost_model_reports_only_hits_worth_loading(store: TieredStore) -> None:
    sched = _scheduler(store)
    request = _request("r", 5 * BS + 10)
    ns = sched.namespace(None)
    _put(store, ns, block_keys(ns, request.prompt_token_ids))
    # Unmeasured: load everything, as before the model.
    assert sched.get_num_new_matched_tokens(request, 0) == (5 * BS, False)
    _teach(sched, 1e-6)  # 1 kB/s: 8 kB blocks take 8 s each; 160 tokens compute in 0.16 s
    assert sched.get_num_new_matched_tokens(request, 0) == (0, False)
    assert sched.num_recomputed_by_choice_tokens == 5 * BS
    _teach(sched, 10.0)  # a fast link again: the whole hit loads
    assert sched.get_num_new_matched_tokens(request, 0) == (5 * BS, False)
    assert sched.hit_sources(request, 5 * BS) != {}


def test_always_load_policy_reports_every_hit(store: TieredStore) -> None:
    sched = CacheTierScheduler(
        store, LAYOUT, FINGERPRINT, "acme", 0, cost_model=False, record_tokens=BS
    )
    request = _request("r", 5 * BS + 10)
    ns = sched.namespace(None)
    _put(store, ns, block_keys(ns, request.prompt_token_ids))
    _teach(sched, 1e-6)
    assert sched.get_num_new_matched_tokens(request, 0) == (5 * BS, False)


def test_prefill_steps_are_described_for_the_worker(store: TieredStore) -> None:
    sched = _scheduler(store)
    request = _request("r", 3 * BS)
    sched.get_num_new_matched_tokens(request, 0)
    sched.update_state_after_alloc(request, _blocks([1, 2, 3]), 0)
    meta = sched.build_connector_meta(_new_step(request, [1, 2, 3], 0, 2 * BS))
    assert meta.step_tokens == 2 * BS
    assert meta.step_attention == PrefillModel.attention_work(2 * BS, 0)
    decode = sched.build_connector_meta(_cached_step(request, None, 3 * BS, 1))
    assert decode.step_tokens == 0


def test_reported_copy_into_vllm_memory_counts_against_loading(store: TieredStore) -> None:
    sched = _scheduler(store)
    request = _request("r", 5 * BS + 10)
    ns = sched.namespace(None)
    _put(store, ns, block_keys(ns, request.prompt_token_ids))
    _teach(sched, 10.0)  # the tier reads fast: on its own, the whole hit loads
    assert sched.get_num_new_matched_tokens(request, 0) == (5 * BS, False)
    # The worker's copies into vLLM's pages run at 1 kB/s: 8 s a block, against 32 ms of
    # prefill, so loading loses whatever the tier's speed.
    sched.update_connector_output(StoredBlocks(copies=[(LAYOUT.block_bytes, 8.0)]))
    assert sched.copy.seconds_per_byte == pytest.approx(8.0 / LAYOUT.block_bytes)
    assert sched.get_num_new_matched_tokens(request, 0) == (0, False)


def test_worker_reports_aggregate_their_copies() -> None:
    a = StoredBlocks(copies=[(100, 0.1)])
    b = StoredBlocks(copies=[(200, 0.3)])
    assert a.aggregate(b).copies == [(100, 0.1), (200, 0.3)]


@pytest.fixture
def redis_store(redis_url: str, redis_prefix: str) -> Iterator[TieredStore]:
    config = _config(cpu_bytes=0, redis_url=redis_url, redis_key_prefix=redis_prefix)
    with open_store(config, with_cpu=False) as s:
        yield s


def test_a_hit_over_a_network_loads_beside_the_forwards(redis_store: TieredStore) -> None:
    sched = _scheduler(redis_store)
    request = _request("r", 5 * BS + 10)
    ns = sched.namespace(None)
    keys = block_keys(ns, request.prompt_token_ids)
    _put(redis_store, ns, keys[1:4])
    block_ids = [40, 41, 42, 43, 44, 45]

    # Redis is read over a network: vLLM holds the request back while the worker loads it.
    assert sched.get_num_new_matched_tokens(request, BS) == (3 * BS, True)
    sched.update_state_after_alloc(request, _blocks(block_ids), 3 * BS)
    # The request is not scheduled in the next step, but its load goes out with it.
    meta = sched.build_connector_meta(SchedulerOutput.make_empty())
    (load,) = meta.async_loads
    assert meta.loads == [] and meta.saves == []
    assert load.keys == tuple(keys[1:4]) and load.block_ids == (41, 42, 43)
    assert sched.build_connector_meta(SchedulerOutput.make_empty()).async_loads == []
    # Once loaded, vLLM schedules it from the end of the load: only what it computes is saved.
    meta = sched.build_connector_meta(_new_step(request, block_ids, 4 * BS, BS + 10))
    assert meta.loads == [] and meta.async_loads == []
    (save,) = meta.saves
    assert save.keys == (keys[4],) and save.block_ids == (44,)


def test_load_async_setting_picks_which_hits_load_beside_the_forwards(
    store: TieredStore, redis_store: TieredStore
) -> None:
    request = _request("r", 3 * BS + 1)
    for tiers, setting, want in (
        (store, "network", False),  # a local disk
        (store, "always", True),
        (redis_store, "never", False),
        (redis_store, "network", True),
    ):
        sched = CacheTierScheduler(
            tiers, LAYOUT, FINGERPRINT, "acme", 0, load_async=setting, record_tokens=BS
        )
        ns = sched.namespace(None)
        _put(tiers, ns, block_keys(ns, request.prompt_token_ids))
        assert sched.get_num_new_matched_tokens(request, 0) == (3 * BS, want), (setting, want)
    with pytest.raises(ValueError, match="load_async"):
        CacheTierScheduler(store, LAYOUT, FINGERPRINT, "acme", 0, load_async="sometimes")
    with pytest.raises(ValueError, match="load_async"):
        _config(disk_path="/tmp/x", load_async="sometimes")


def test_a_hit_that_failed_to_load_is_not_offered_again(redis_store: TieredStore) -> None:
    # After a failed async load vLLM puts the request back to waiting and asks again; offering
    # the same blocks again would loop for as long as the tier fails on them.
    sched = _scheduler(redis_store)
    request = _request("r", 5 * BS + 10)
    ns = sched.namespace(None)
    keys = block_keys(ns, request.prompt_token_ids)
    _put(redis_store, ns, keys)
    assert sched.get_num_new_matched_tokens(request, 0) == (5 * BS, True)
    sched.update_state_after_alloc(request, _blocks([10, 11, 12, 13, 14, 15]), 5 * BS)
    sched.build_connector_meta(SchedulerOutput.make_empty())
    sched.update_connector_output(StoredBlocks(failed={ns.id: list(keys[2:])}))
    assert sched.get_num_new_matched_tokens(request, 0) == (2 * BS, True)
    sched.update_connector_output(StoredBlocks(failed={ns.id: list(keys)}))
    assert sched.get_num_new_matched_tokens(request, 0) == (0, False)
    # Another request with the same prefix is not held to this one's failure.
    assert sched.get_num_new_matched_tokens(_request("s", 5 * BS + 10), 0) == (5 * BS, True)


def _record_scheduler(store: TieredStore) -> CacheTierScheduler:
    """vLLM at 32 tokens a block over records of 16 (an HF or our engine's block)."""
    return CacheTierScheduler(store, LAYOUT, FINGERPRINT, "acme", 0, record_tokens=BS // 2)


def test_records_of_another_block_size_hit_in_whole_blocks(store: TieredStore) -> None:
    from vllm.v1.metrics.cache_hit_source import CacheHitSource

    sched = _record_scheduler(store)
    ns = sched.namespace(None)
    assert ns.block_size == BS // 2  # the namespace does not depend on vLLM's block size
    request = _request("r", 5 * BS + 10)
    keys = block_keys(ns, request.prompt_token_ids)
    assert len(keys) == 10
    _put_records(store, ns, keys[:7])  # three blocks and a half
    assert sched.get_num_new_matched_tokens(request, 0) == (3 * BS, False)
    assert sched.hit_sources(request, 3 * BS) == {CacheHitSource.DISK: 3 * BS}

    block_ids = [7, 8, 9, 10, 11, 12]
    sched.update_state_after_alloc(request, _blocks(block_ids), 3 * BS)
    meta = sched.build_connector_meta(_new_step(request, block_ids, 3 * BS, 2 * BS + 10))
    (load,) = meta.loads
    assert load.keys == tuple(keys[:6]) and load.block_ids == (7, 8, 9)
    (save,) = meta.saves
    assert save.keys == tuple(keys[6:10]) and save.block_ids == (10, 11)
    assert save.per_block == 2


def test_a_failed_record_fails_its_whole_block(store: TieredStore) -> None:
    sched = _record_scheduler(store)
    ns = sched.namespace(None)
    request = _request("r", 4 * BS + 1)
    keys = block_keys(ns, request.prompt_token_ids)
    _put_records(store, ns, keys)
    assert sched.get_num_new_matched_tokens(request, 0) == (4 * BS, False)
    sched.update_state_after_alloc(request, _blocks([1, 2, 3, 4, 5]), 4 * BS)
    sched.build_connector_meta(_new_step(request, [1, 2, 3, 4, 5], 4 * BS, 1))
    # The worker could not read record 5, the second half of block 2.
    sched.update_connector_output(StoredBlocks(failed={ns.id: [keys[5]]}))
    assert sched.get_num_new_matched_tokens(request, 0) == (2 * BS, False)


def test_a_block_size_that_records_do_not_divide_is_refused_at_start(
    store: TieredStore,
) -> None:
    with pytest.raises(ValueError, match="not a multiple of record_tokens"):
        CacheTierScheduler(store, LAYOUT, FINGERPRINT, "acme", 0, record_tokens=24)


def _put_records(store: TieredStore, namespace: Namespace, keys: list[BlockHash]) -> None:
    layout = namespace.layout
    blocks = [
        KVBlock(
            key,
            namespace.fingerprint,
            layout.dtype,
            layout.payload_shape,
            layout.block_size,
            bytes(layout.block_bytes),
        )
        for key in keys
    ]
    store.put_many(namespace.id, blocks)
    store.flush()


def _teach_rates(sched: CacheTierScheduler, step_tokens: int, step_s: float, read_s: float) -> None:
    """Prefill steps of ``step_tokens`` in ``step_s`` each, and disk reads of ``read_s`` a
    record, as the worker would report them."""
    from cachetier.store.costmodel import PrefillModel, TierRate

    record_bytes = sched.namespace(None).layout.block_bytes
    steps = [
        (step_tokens, PrefillModel.attention_work(step_tokens, ctx), step_s * (1 + ctx / 4096))
        for ctx in (0, step_tokens, 2 * step_tokens, 3 * step_tokens)
    ]
    rate = TierRate(0.0, read_s / record_bytes, 8, time.monotonic())
    sched.update_connector_output(StoredBlocks(steps=steps, rates={"disk": rate}))


def test_a_model_that_saw_only_short_prefills_loads_a_long_prompts_hit(
    store: TieredStore,
) -> None:
    # Restarted over a full folder, its warm-ups hits: 16-token steps are all it has timed.
    # Extrapolated, they make a 347-token recompute look cheaper than a slow-ish load.
    sched = _record_scheduler(store)
    _teach_rates(sched, step_tokens=16, step_s=0.004, read_s=0.010)
    request = _request("r", 347)
    keys = block_keys(sched.namespace(None), request.prompt_token_ids)
    _put_records(store, sched.namespace(None), keys)
    full_blocks = (347 - 1) // BS
    assert sched.get_num_new_matched_tokens(request, 0) == (full_blocks * BS, False)
    assert sched.num_recomputed_by_choice_tokens == 0


def test_a_refusal_on_evidence_saves_nothing_again_and_its_real_cost_is_learnt(
    store: TieredStore,
) -> None:
    sched = _record_scheduler(store)
    # Long prefills measured fast, reads measured slow: recomputing is the better plan.
    _teach_rates(sched, step_tokens=512, step_s=0.002, read_s=0.5)
    request = _request("r", 4 * BS + 1)
    ns = sched.namespace(None)
    keys = block_keys(ns, request.prompt_token_ids)
    _put_records(store, ns, keys)
    assert sched.get_num_new_matched_tokens(request, 0) == (0, False)
    assert sched.num_recomputed_by_choice_tokens == 4 * BS
    block_ids = [1, 2, 3, 4, 5]
    sched.update_state_after_alloc(request, _blocks(block_ids), 0)
    meta = sched.build_connector_meta(_new_step(request, block_ids, 0, 4 * BS + 1))
    # The disk holds those records already: no save writes them over themselves.
    assert meta.saves == [] and meta.loads == []
    assert sched.prefill.error.num_outcomes == 0
    sched.update_connector_output(StoredBlocks(steps=[(4 * BS + 1, 0.0, 0.25)]))
    assert sched.prefill.error.num_outcomes == 1  # it took far longer than estimated
