"""The store's side of the guard, on a real CPU tier over a real disk tier: a record that does
not match its recomputation quarantines its writer in that namespace and is deleted there; a
namespace an operator quarantines is passed over by the store's lookups until it is lifted."""

from __future__ import annotations

import dataclasses
import logging

import numpy as np
import pytest

from cachetier.primitives.keys import Namespace
from cachetier.record import FORMAT_VERSION, KVBlock, writer_name
from cachetier.store.tiered import TieredStore
from tests.support import SMALL_LAYOUT, make_blocks

NS = Namespace("guarded-model", SMALL_LAYOUT)
OTHER = Namespace("guarded-model", SMALL_LAYOUT, tenant="bob")
BUGGY = b"buggy-writer...."


@pytest.fixture
def store(cpu_disk_store: TieredStore) -> TieredStore:
    return cpu_disk_store


def _swapped(block: KVBlock) -> KVBlock:
    """The block with its K and V planes exchanged: every check of the record still passes."""
    values = np.frombuffer(block.data, dtype=block.dtype).reshape(block.shape)
    data = np.ascontiguousarray(values[:, ::-1]).tobytes()
    return KVBlock(block.key, block.fingerprint, block.dtype, block.shape, block.num_tokens, data)


def _on_disk_only(store: TieredStore, namespace: Namespace, blocks: list[KVBlock]) -> None:
    store.tiers[1].put_many(namespace.id, blocks)


def test_an_honest_tier_passes_and_keeps_serving(store: TieredStore) -> None:
    computed = make_blocks(NS, 4)
    _on_disk_only(store, NS, computed)
    verdict = store.verify(NS.id, "disk", computed)
    assert verdict.ok and verdict.compared == 4 and not verdict.quarantined
    assert store.lookup(NS.id, [b.key for b in computed]).num_blocks == 4
    assert store.stats()["guard"]["verified_blocks"] == {"disk": 4}


def test_a_forged_writer_is_quarantined_in_that_namespace_only(
    store: TieredStore, caplog: pytest.LogCaptureFixture
) -> None:
    computed = make_blocks(NS, 4)
    theirs = make_blocks(OTHER, 2, seed=7)
    forged = [dataclasses.replace(_swapped(b), writer=BUGGY) for b in computed[2:]]
    _on_disk_only(store, NS, [*computed[:2], *forged])
    _on_disk_only(store, OTHER, theirs)
    keys = [b.key for b in computed]
    with caplog.at_level(logging.WARNING, logger="cachetier.store.verify"):
        verdict = store.verify(NS.id, "disk", computed, writer=NS.describe())
    assert verdict.quarantined and verdict.compared == 4
    assert [m.key_hex for m in verdict.mismatches] == [b.key.hex() for b in computed[2:]]
    assert verdict.bad_writers == (writer_name(BUGGY),)
    assert verdict.clean_writers == (writer_name(None),)
    (line,) = [r.getMessage() for r in caplog.records]
    assert "tier disk" in line and "quarantine lift" in line and "layer" in line
    # What the records claimed to be, the format they were read from and their writer.
    assert "model guarded-model" in line and f"record format v{FORMAT_VERSION}" in line
    assert writer_name(BUGGY) in line
    # Only the records that differed are gone; the writer is held back in every tier of the
    # store, not the namespace: the other writer's records, and another tenant's, still serve.
    disk = store.tiers[1]
    assert [r is None for r in disk.get_many(NS.id, keys)] == [False, False, True, True]
    for tier in ("cpu", "disk"):
        assert store.quarantines.holds_writer(tier, NS.id, writer_name(BUGGY))
        assert not store.quarantines.holds(tier, NS.id)
    assert store.lookup(NS.id, keys).num_blocks == 2
    assert store.lookup(OTHER.id, [b.key for b in theirs]).num_blocks == 2
    guard = store.stats()["guard"]
    assert guard["mismatched_blocks"] == {"disk": 2} and guard["quarantines"] == {"disk": 1}


def test_a_sidecars_store_refuses_a_quarantined_writers_records_as_it_reads(
    store: TieredStore,
) -> None:
    computed = make_blocks(NS, 3)
    _on_disk_only(store, NS, [dataclasses.replace(b, writer=BUGGY) for b in computed])
    for tier in ("cpu", "disk"):  # what a client's report does: every tier of the sidecar
        store.quarantines.add(tier, NS.id, "reported by a client", writer_name(BUGGY))
    keys = [b.key for b in computed]
    # An engine's store reads them (its record guard refuses them, with the cause); this read
    # also promotes them into the CPU tier.
    assert all(b is not None for b in store.get_many(NS.id, keys))
    store.refuse_quarantined_writers = True
    assert store.get_many(NS.id, keys) == [None] * 3
    for tier in store.tiers:  # deleted as refused, in each tier that held them
        assert tier.get_many(NS.id, keys) == [None] * 3
    assert store.stats()["guard"]["quarantined_lookups"] == {"cpu": 3, "disk": 3}


def test_other_tiers_keep_serving_a_namespace_quarantined_in_one(store: TieredStore) -> None:
    computed = make_blocks(NS, 3)
    _on_disk_only(store, NS, computed)
    store.quarantines.add("disk", NS.id, "an operator's")
    store.tiers[0].put_many(NS.id, computed)
    hit = store.lookup(NS.id, [b.key for b in computed])
    assert hit.num_blocks == 3 and hit.blocks_per_tier() == {"cpu": 3}


def test_a_lifted_namespace_quarantine_serves_again(store: TieredStore) -> None:
    computed = make_blocks(NS, 2)
    _on_disk_only(store, NS, computed)
    store.quarantines.add("disk", NS.id, "an operator's")
    assert store.lookup(NS.id, [b.key for b in computed]).num_blocks == 0
    assert [q.tier for q in store.quarantines.lift(NS.id)] == ["disk"]
    assert store.lookup(NS.id, [b.key for b in computed]).num_blocks == 2


def test_keys_the_tier_no_longer_holds_are_not_compared(store: TieredStore) -> None:
    computed = make_blocks(NS, 3)
    _on_disk_only(store, NS, computed[:1])
    verdict = store.verify(NS.id, "disk", computed)
    assert verdict.ok and verdict.compared == 1


def test_an_unknown_tier_is_refused_by_name(store: TieredStore) -> None:
    with pytest.raises(ValueError, match="redis"):
        store.verify(NS.id, "redis", make_blocks(NS, 1))
