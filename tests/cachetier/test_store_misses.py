"""The causes a store's lookups give for the keys it let go (``cachetier.misses.MissLedger``):
real tiers, a real full write queue, a real admission refusal, real evictions and a real
corrupt record."""

from __future__ import annotations

from pathlib import Path

import pytest

from cachetier.admission import make_admission_policy
from cachetier.admission.config import AdmissionConfig
from cachetier.primitives.keys import Namespace
from cachetier.store.tiered import TieredStore
from cachetier.tiers.cpu import CPUTier, CPUTierConfig
from cachetier.tiers.disk.tier import DiskTier, DiskTierConfig
from tests.cachetier.tier_harness import flip_file
from tests.support import SMALL_LAYOUT, make_blocks

NS = Namespace("ledger-model", SMALL_LAYOUT)


def _stack(folder: Path, **kw: object) -> TieredStore:
    cpu = CPUTier(CPUTierConfig(1))  # holds nothing: every lookup asks the disk
    return TieredStore([cpu, DiskTier(DiskTierConfig(str(folder), 1 << 30, fsync=False))], **kw)  # type: ignore[arg-type]


def test_a_full_write_queue_is_the_cause_of_the_miss(tmp_path: Path) -> None:
    with _stack(tmp_path / "d", write_queue_blocks=2) as store:
        blocks = make_blocks(NS, 3)
        store.put_many(NS.id, blocks)  # three blocks for a queue of two: dropped
        hit = store.lookup(NS.id, [b.key for b in blocks])
        assert hit.num_blocks == 0
        assert (hit.miss_cause, hit.miss_tier) == ("write_dropped", "disk")


def test_an_admission_refusal_is_the_cause_and_a_later_write_clears_it(tmp_path: Path) -> None:
    policy = make_admission_policy(AdmissionConfig(admission_policy="second_hit"))
    with _stack(tmp_path / "d", admission=policy) as store:
        blocks = make_blocks(NS, 2)
        keys = [b.key for b in blocks]
        store.put_many(NS.id, blocks)
        assert store.flush(timeout=10)
        hit = store.lookup(NS.id, keys)
        assert (hit.miss_cause, hit.miss_tier) == ("not_admitted", "disk")
        store.put_many(NS.id, blocks)  # seen twice: written
        assert store.flush(timeout=10)
        assert store.lookup(NS.id, keys).num_blocks == 2
        assert store.misses.explain(keys) == [None, None]  # forgotten once written


@pytest.mark.parametrize("tier", ["cpu", "disk"])
def test_a_block_a_full_tier_evicted_misses_as_evicted_by_it(tmp_path: Path, tier: str) -> None:
    blocks = make_blocks(NS, 12)
    one = blocks[0].nbytes
    if tier == "cpu":
        store = TieredStore([CPUTier(CPUTierConfig(4 * one))])
    else:
        disk = DiskTier(DiskTierConfig(str(tmp_path / "d"), 6 * (one + 512), fsync=False))
        store = TieredStore([CPUTier(CPUTierConfig(1)), disk])
    with store:
        for block in blocks:  # one request each: the oldest go first
            store.put_many(NS.id, [block])
            assert store.flush(timeout=10)
        hit = store.lookup(NS.id, [blocks[0].key])
        assert hit.num_blocks == 0
        assert (hit.miss_cause, hit.miss_tier) == ("evicted", tier)
        assert hit.miss_detail.startswith("evicted ") and "s ago" in hit.miss_detail
        assert store.lookup(NS.id, [blocks[-1].key]).num_blocks == 1


def test_a_record_found_corrupt_misses_as_corrupt(tmp_path: Path) -> None:
    with _stack(tmp_path / "d") as store:
        blocks = make_blocks(NS, 1)
        store.put_many(NS.id, blocks)
        assert store.flush(timeout=10)
        disk = store.tiers[1]
        assert isinstance(disk, DiskTier)
        flip_file(disk.path_of(NS.id, blocks[0].key))
        assert store.get_many(NS.id, [blocks[0].key]) == [None]  # read, refused, dropped
        hit = store.lookup(NS.id, [blocks[0].key])
        assert (hit.num_blocks, hit.miss_cause, hit.miss_tier) == (0, "corrupt", "disk")
