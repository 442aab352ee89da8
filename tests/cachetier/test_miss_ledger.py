"""The store's memory of keys it let go, and the causes its lookups give from it: real tiers,
a real full write queue and a real admission refusal."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from cachetier.admission import make_admission_policy
from cachetier.admission.config import AdmissionConfig
from cachetier.primitives.keys import BlockHash, Namespace
from cachetier.store.miss_ledger import CAUSES, WAYS, MissLedger
from cachetier.store.tiered import TieredStore
from cachetier.tiers.cpu import CPUTier, CPUTierConfig
from cachetier.tiers.disk.tier import DiskTier, DiskTierConfig
from tests.cachetier.tier_harness import flip_file
from tests.support import SMALL_LAYOUT, make_blocks

NS = Namespace("ledger-model", SMALL_LAYOUT)


def _key(i: int) -> BlockHash:
    return BlockHash(i.to_bytes(4, "little") * 8)


def test_a_noted_key_is_explained_until_forgotten() -> None:
    ledger = MissLedger(64)
    ledger.note([_key(1), _key(2)], "evicted", "disk")
    ledger.note([_key(3)], "write_dropped", "redis")
    got = ledger.explain([_key(1), _key(3), _key(4)])
    assert [(g.cause, g.tier) if g else None for g in got] == [
        ("evicted", "disk"),
        ("write_dropped", "redis"),
        None,
    ]
    assert got[0] is not None and got[0].age_s == 0.0
    ledger.forget([_key(1)])
    assert ledger.explain([_key(1)]) == [None]


def test_it_stays_within_its_bound_and_never_explains_a_key_by_another() -> None:
    ledger = MissLedger(8)  # two sets of four ways
    keys = [_key(i) for i in range(1000)]
    ledger.note(keys, "not_admitted", "disk")
    explained = [k for k, g in zip(keys, ledger.explain(keys)) if g is not None]
    assert len(explained) <= 8 and explained  # the newest of each set survive
    assert ledger.explain([_key(5000 + i) for i in range(100)]) == [None] * 100


def test_memory_at_a_million_keys_is_stated_by_its_tables() -> None:
    assert MissLedger(1_000_000).nbytes == 1_000_000 * 12 + 1_000_000 // WAYS


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(ValueError):
        MissLedger(0)
    with pytest.raises(ValueError):
        MissLedger(8).note([_key(1)], "lost", "disk")
    assert "corrupt" in CAUSES


def test_threads_note_and_explain_at_once() -> None:
    ledger = MissLedger(4096)

    def work(base: int) -> None:
        for i in range(200):
            ledger.note([_key(base + i)], "evicted", "cpu")
            ledger.explain([_key(base + i)])

    threads = [threading.Thread(target=work, args=(n * 1000,)) for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sum(g is not None for g in ledger.explain([_key(i) for i in range(200)])) > 0


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
        assert store.why_missed(NS.id, keys[0]) == ("never_stored", "")


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
