"""The restore guard in the vLLM connector, on vLLM's own request and scheduler-output types and
a real disk tier: a drawn hit is reported as none and its saves carry the tier to compare with;
the worker's comparison quarantines a forged tier, and the scheduler side honours it."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("vllm")

from vllm import SamplingParams  # noqa: E402
from vllm.v1.core.kv_cache_manager import KVCacheBlocks  # noqa: E402
from vllm.v1.core.kv_cache_utils import KVCacheBlock  # noqa: E402
from vllm.v1.core.sched.output import NewRequestData, SchedulerOutput  # noqa: E402
from vllm.v1.request import Request  # noqa: E402

from cachetier.connectors.config import ConnectorConfig, open_store  # noqa: E402
from cachetier.connectors.vllm.guard import verify_saved  # noqa: E402
from cachetier.connectors.vllm.metadata import BlockTransfer, StoredBlocks  # noqa: E402
from cachetier.connectors.vllm.scheduler import CacheTierScheduler  # noqa: E402
from cachetier.guard import GuardConfig, GuardSampler  # noqa: E402
from cachetier.primitives.keys import KVLayout, Namespace, block_keys  # noqa: E402
from cachetier.record import KVBlock, writer_name  # noqa: E402
from cachetier.store.tiered import TieredStore  # noqa: E402

pytestmark = pytest.mark.vllm

BS = 32
LAYOUT = KVLayout("float32", BS, num_layers=2, num_kv_heads=1, head_dim=32)
FIRST_HIT_ONLY = GuardConfig(first_hits=1, fraction=0.0)


@pytest.fixture
def store(tmp_path: Path) -> Iterator[TieredStore]:
    config = ConnectorConfig.from_extra_config({"cpu_bytes": 0, "disk_path": str(tmp_path)})
    with open_store(config, with_cpu=False) as s:
        yield s


def _scheduler(store: TieredStore, guard: GuardConfig | None) -> CacheTierScheduler:
    sampler = GuardSampler(guard) if guard is not None else None
    return CacheTierScheduler(store, LAYOUT, "model", "acme", 0, record_tokens=BS, guard=sampler)


def _request(req_id: str, num_tokens: int) -> Request:
    tokens = [(31 * i) % 40000 + 100 for i in range(num_tokens)]
    return Request(req_id, tokens, SamplingParams(max_tokens=4), None)


def _records(namespace: Namespace, request: Request, seed: int = 0) -> list[KVBlock]:
    rng = np.random.default_rng(seed)
    return [
        KVBlock(
            key,
            namespace.fingerprint,
            "float32",
            LAYOUT.payload_shape,
            BS,
            rng.standard_normal(LAYOUT.payload_shape).astype("float32").tobytes(),
        )
        for key in block_keys(namespace, request.prompt_token_ids)
    ]


def _swapped(record: KVBlock) -> KVBlock:
    values = np.frombuffer(record.data, dtype="float32").reshape(record.shape)
    data = np.ascontiguousarray(values[:, ::-1]).tobytes()
    return KVBlock(record.key, record.fingerprint, record.dtype, record.shape, BS, data)


def _prefill_step(request: Request, block_ids: list[int]) -> SchedulerOutput:
    out = SchedulerOutput.make_empty()
    out.scheduled_new_reqs = [NewRequestData.from_request(request, (block_ids,))]
    out.num_scheduled_tokens = {request.request_id: request.num_tokens}
    out.total_num_scheduled_tokens = request.num_tokens
    return out


def test_a_drawn_hit_is_computed_and_its_saves_name_the_tier(store: TieredStore) -> None:
    sched = _scheduler(store, FIRST_HIT_ONLY)
    request = _request("r", 3 * BS + 5)
    ns = sched.namespace(None)
    store.put_many(ns.id, _records(ns, request))
    store.flush()
    assert sched.get_num_new_matched_tokens(request, 0) == (0, False)
    # Asked again (vLLM could not schedule it yet), it is still computed: no second draw.
    assert sched.get_num_new_matched_tokens(request, 0) == (0, False)
    sched.update_state_after_alloc(
        request, KVCacheBlocks(([KVCacheBlock(i) for i in range(4)],)), 0
    )
    meta = sched.build_connector_meta(_prefill_step(request, [0, 1, 2, 3]))
    assert meta.loads == [] and meta.async_loads == []
    (save,) = meta.saves
    assert save.block_ids == (0, 1, 2) and save.verify_tiers == ("disk",) * 3
    # The first hit of the namespace was verified; the next one is loaded.
    other = _request("s", 3 * BS + 5)
    assert sched.get_num_new_matched_tokens(other, 0) == (3 * BS, False)


def test_a_request_is_drawn_once_however_often_vllm_asks(store: TieredStore) -> None:
    """vLLM asks a queued request's match at every step; drawing at each ask would verify
    far more than ``guard_fraction`` of requests (half here: 50 asks would all but surely
    flip the answer at least once)."""
    sched = _scheduler(store, GuardConfig(first_hits=0, fraction=0.5, seed=0))
    request = _request("r", 3 * BS + 5)
    ns = sched.namespace(None)
    store.put_many(ns.id, _records(ns, request))
    store.flush()
    answers = {sched.get_num_new_matched_tokens(request, 0) for _ in range(50)}
    assert answers == {(3 * BS, False)}  # this seed's first draw is no: it stays loaded


def test_no_guard_loads_every_hit(store: TieredStore) -> None:
    sched = _scheduler(store, None)
    request = _request("r", 2 * BS + 1)
    ns = sched.namespace(None)
    store.put_many(ns.id, _records(ns, request))
    store.flush()
    assert sched.get_num_new_matched_tokens(request, 0) == (2 * BS, False)


def test_the_worker_quarantines_a_forged_writer_and_the_scheduler_learns_it(
    store: TieredStore,
) -> None:
    sched = _scheduler(store, FIRST_HIT_ONLY)
    request = _request("r", 3 * BS + 5)
    ns = sched.namespace(None)
    computed = _records(ns, request)
    store.put_many(ns.id, [_swapped(r) for r in computed])
    store.flush()
    transfer = BlockTransfer(
        "r", ns.id, ns.fingerprint, tuple(r.key for r in computed), (0, 1, 2), ("disk",) * 3
    )
    began = verify_saved(store, transfer, computed)
    writer = writer_name(None)  # the forged records were written by this process
    assert [(tier, namespace, w) for tier, namespace, _, w in began] == [("disk", ns.id, writer)]
    assert "layer" in began[0][2]
    sched.update_connector_output(StoredBlocks(quarantined=began))
    # That writer's records are held back (the worker refuses them as it reads them); the
    # namespace is not: other writers' records keep serving.
    assert sched.quarantines.holds_writer("disk", ns.id, writer)
    assert not sched.quarantines.holds("disk", ns.id)
    assert store.get_many(ns.id, [r.key for r in computed]) == [None] * 3  # the bad ones deleted
    assert [q.writer for q in sched.quarantines.lift(ns.id)] == [writer]


def test_honest_records_verify_and_nothing_is_quarantined(store: TieredStore) -> None:
    ns = _scheduler(store, None).namespace(None)
    request = _request("r", 2 * BS + 1)
    computed = _records(ns, request)
    store.put_many(ns.id, computed)
    store.flush()
    transfer = BlockTransfer(
        "r", ns.id, ns.fingerprint, tuple(r.key for r in computed), (0, 1), ("disk", "")
    )
    assert verify_saved(store, transfer, computed) == []
    assert store.stats()["guard"]["verified_blocks"] == {"disk": 1}


def test_verify_tiers_must_match_the_keys() -> None:
    with pytest.raises(ValueError, match="verify tiers"):
        BlockTransfer("r", "ns", bytes(32), (bytes(32),), (0,), ("disk", "disk"))
