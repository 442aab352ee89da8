"""The store's block events: which tier took or let go of which keys, and their publication as
KV events by ``publish_store`` (a CPU tier over a disk tier, both real)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path

import pytest

from cachetier.kvevents import BlockRemoved, BlockStored, KVEvent, TierEvents
from cachetier.kvevents.held import key_digest
from cachetier.primitives.keys import BlockHash, Namespace
from cachetier.store.events import publish_store
from cachetier.store.tiered import TieredStore
from cachetier.tiers.cpu import CPUTier, CPUTierConfig
from cachetier.tiers.disk.tier import DiskTier, DiskTierConfig
from tests.support import make_blocks

BIG = 1 << 30
Change = tuple[str, str, str, tuple[BlockHash, ...]]


class ListSink:
    def __init__(self) -> None:
        self.events: list[KVEvent] = []

    def publish(self, events: Sequence[KVEvent]) -> bool:
        self.events.extend(events)
        return True


def _stack(tmp_path: Path, cpu_bytes: int = BIG) -> TieredStore:
    return TieredStore(
        [
            CPUTier(CPUTierConfig(cpu_bytes)),
            DiskTier(DiskTierConfig(str(tmp_path / "disk"), BIG, fsync=False)),
        ]
    )


def _listen(store: TieredStore) -> list[Change]:
    changes: list[Change] = []
    store.block_events.listen(lambda *c: changes.append((c[0], c[1], c[2], tuple(c[3]))))
    return changes


def test_puts_are_told_per_tier_as_each_takes_them(tmp_path: Path, namespace: Namespace) -> None:
    store = _stack(tmp_path)
    changes = _listen(store)
    blocks = make_blocks(namespace, 3)
    keys = tuple(b.key for b in blocks)
    store.put_many(namespace.id, blocks)
    assert store.flush(timeout=10)
    assert changes == [
        ("stored", "cpu", namespace.id, keys),
        ("stored", "disk", namespace.id, keys),
    ]
    store.delete(namespace.id, keys[:1])
    assert changes[2:] == [
        ("removed", "cpu", namespace.id, keys[:1]),
        ("removed", "disk", namespace.id, keys[:1]),
    ]
    tenant = dataclasses.replace(namespace, tenant="other")  # another namespace, same tiers
    store.put_many(tenant.id, make_blocks(tenant, 1))
    assert store.flush(timeout=10)
    store.clear(namespace.id)  # its keys are told as removed: the other namespace's stay
    assert changes[6:] == [
        ("removed", "cpu", namespace.id, keys[1:]),
        ("removed", "disk", namespace.id, keys[1:]),
    ]
    store.close()


def test_evictions_are_told(tmp_path: Path, namespace: Namespace) -> None:
    blocks = make_blocks(namespace, 4)
    store = _stack(tmp_path, cpu_bytes=2 * blocks[0].nbytes + 64)  # the CPU tier holds two
    changes = _listen(store)
    for block in blocks:
        store.put_many(namespace.id, [block])
    assert store.flush(timeout=10)
    removed = [keys for kind, tier, _, keys in changes if kind == "removed" and tier == "cpu"]
    assert removed == [(blocks[0].key,), (blocks[1].key,)]
    store.close()


def test_a_listener_that_raises_does_not_fail_the_put(
    tmp_path: Path, namespace: Namespace, caplog: pytest.LogCaptureFixture
) -> None:
    store = _stack(tmp_path)

    def broken(*change: object) -> None:
        raise RuntimeError("listener bug")

    store.block_events.listen(broken)
    assert store.put_many(namespace.id, make_blocks(namespace, 2)) == 2
    assert "a block listener failed" in caplog.text
    store.close()


def test_a_reopened_store_announces_its_disk_then_publishes_changes(
    tmp_path: Path, namespace: Namespace
) -> None:
    blocks = make_blocks(namespace, 5)
    first = _stack(tmp_path)
    first.put_many(namespace.id, blocks)
    first.close()

    store = _stack(tmp_path)  # a restart: the CPU tier is empty, the disk is not
    sink = ListSink()
    events = TierEvents(sink)
    assert publish_store(store.block_events, store.tiers, events, namespace.block_size) == 5
    (snapshot,) = sink.events
    assert isinstance(snapshot, BlockStored) and snapshot.medium == "disk"
    assert snapshot.block_size == namespace.block_size
    assert sorted(snapshot.block_hashes) == sorted(b.key for b in blocks)
    more = make_blocks(namespace, 2, seed=1)
    store.put_many(namespace.id, more)
    assert store.flush(timeout=10)
    assert [e.medium for e in sink.events[1:]] == ["cpu", "disk"]
    store.clear(namespace.id)
    assert [(type(e), e.medium) for e in sink.events[-2:]] == [
        (BlockRemoved, "cpu"),
        (BlockRemoved, "disk"),
    ]
    assert events.held.digests() == {"cpu": (0, 0), "disk": (0, 0)}
    store.close()


def test_media_rename_tiers_and_leave_others_out(tmp_path: Path, namespace: Namespace) -> None:
    """A sidecar publishes its last tier only, under the name engines give the sidecar."""
    store = _stack(tmp_path)
    sink = ListSink()
    events = TierEvents(sink)
    publish_store(store.block_events, store.tiers, events, 0, media={"disk": "remote"})
    blocks = make_blocks(namespace, 2)
    store.put_many(namespace.id, blocks)
    assert store.flush(timeout=10)
    store.delete(namespace.id, [blocks[0].key])
    assert [(type(e).__name__, e.medium) for e in sink.events] == [
        ("BlockStored", "remote"),
        ("BlockRemoved", "remote"),
    ]
    assert sink.events[1] == BlockRemoved((blocks[0].key,), "remote")
    assert events.held.digests() == {"remote": key_digest([blocks[1].key])}
    store.close()
