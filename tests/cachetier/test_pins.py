"""Pinned blocks in every tier that can pin: never evicted, bounded in bytes, pinned before
they arrive, given back on unpin; and a store's pins across a restart."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from cachetier.errors import PinLimitError
from cachetier.pins.registry import PinRegistry, PinRegistryError
from cachetier.pins.store import StorePins
from cachetier.primitives.keys import Namespace, block_keys
from cachetier.record import KVBlock
from cachetier.store.config import StoreConfig, build_store
from cachetier.tiers.cpu import CPUTierConfig
from cachetier.tiers.disk.config import DiskTierConfig
from cachetier.tiers.redis import RedisTierConfig
from tests.cachetier.tier_harness import TierHarness, build
from tests.support import make_blocks

PINNABLE = ["cpu", "disk", "redis"]


@pytest.fixture(params=PINNABLE)
def pin_harness(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[TierHarness]:
    h = build(request.param, tmp_path, request.getfixturevalue)
    yield h
    h.close_all()


def _present(tier, ns: str, blocks: list[KVBlock]) -> list[bool]:
    got = tier.get_many(ns, [b.key for b in blocks])
    return [g is not None and bytes(g.data) == bytes(b.data) for g, b in zip(got, blocks)]


def test_pinned_blocks_survive_a_flood(pin_harness: TierHarness, namespace: Namespace) -> None:
    blocks = make_blocks(namespace, 60)
    per_block = blocks[0].nbytes + pin_harness.overhead_bytes
    tier = pin_harness.open(8 * per_block)  # may pin 4 (max_pinned_fraction 0.5)
    chain, others = blocks[:3], blocks[3:]
    tier.put_many(namespace.id, chain)
    assert tier.pin(namespace.id, [b.key for b in chain]) == 3
    for i in range(0, len(others), 5):
        tier.put_many(namespace.id, others[i : i + 5])
    assert _present(tier, namespace.id, chain) == [True] * 3
    assert tier.stats()["evictions"] >= len(others) - 8
    assert tier.used_bytes <= 8 * per_block
    stats = tier.stats()
    assert (stats["pinned_keys"], stats["pinned_blocks"]) == (3, 3)
    assert stats["pinned_bytes"] == 3 * per_block


def test_a_key_pinned_before_it_arrives_is_kept_once_stored(
    pin_harness: TierHarness, namespace: Namespace
) -> None:
    blocks = make_blocks(namespace, 30)
    per_block = blocks[0].nbytes + pin_harness.overhead_bytes
    tier = pin_harness.open(8 * per_block)
    assert tier.pin(namespace.id, [blocks[0].key]) == 0  # not stored yet
    assert tier.stats()["pinned_waiting"] == 1
    tier.put_many(namespace.id, blocks[:1])
    tier.put_many(namespace.id, blocks[1:])
    assert _present(tier, namespace.id, blocks[:1]) == [True]
    assert tier.stats()["pinned_blocks"] == 1


def test_a_pin_past_the_bound_is_refused_whole(
    pin_harness: TierHarness, namespace: Namespace
) -> None:
    blocks = make_blocks(namespace, 8)
    per_block = blocks[0].nbytes + pin_harness.overhead_bytes
    tier = pin_harness.open(8 * per_block)
    tier.put_many(namespace.id, blocks)
    tier.pin(namespace.id, [blocks[0].key])
    with pytest.raises(PinLimitError, match="pinned bytes"):
        tier.pin(namespace.id, [b.key for b in blocks[1:5]])  # 5 in all, 4 fit
    assert tier.stats()["pinned_keys"] == 1  # none of the refused request
    assert tier.pin(namespace.id, [b.key for b in blocks[1:4]]) == 3  # 4 in all: fits


def test_unpinned_blocks_are_evicted_again(pin_harness: TierHarness, namespace: Namespace) -> None:
    blocks = make_blocks(namespace, 20)
    per_block = blocks[0].nbytes + pin_harness.overhead_bytes
    tier = pin_harness.open(4 * per_block)
    tier.put_many(namespace.id, blocks[:2])
    tier.pin(namespace.id, [b.key for b in blocks[:2]])
    assert tier.unpin(namespace.id, [b.key for b in blocks[:2]]) == 2
    tier.put_many(namespace.id, blocks[2:])
    assert _present(tier, namespace.id, blocks[:2]) == [False, False]
    assert tier.stats()["pinned_keys"] == 0


def test_a_pinned_block_of_other_tenants_namespace_is_not_pinned(
    pin_harness: TierHarness, namespace: Namespace
) -> None:
    blocks = make_blocks(namespace, 12)
    per_block = blocks[0].nbytes + pin_harness.overhead_bytes
    tier = pin_harness.open(4 * per_block)
    tier.put_many("other", blocks[:1])
    tier.pin(namespace.id, [blocks[0].key])  # pins (namespace.id, key), not ("other", key)
    tier.put_many("other", blocks[1:])
    assert _present(tier, "other", blocks[:1]) == [False]


@pytest.mark.parametrize("bad", [1.0, -0.1, True, "0.5"])
def test_max_pinned_fraction_is_checked(bad: object, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="max_pinned_fraction"):
        CPUTierConfig(1 << 20, max_pinned_fraction=bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="max_pinned_fraction"):
        DiskTierConfig(str(tmp_path), 1 << 20, max_pinned_fraction=bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="max_pinned_fraction"):
        RedisTierConfig(capacity_bytes=1 << 20, max_pinned_fraction=bad)  # type: ignore[arg-type]


def _store_config(tmp_path: Path, per_block: int) -> StoreConfig:
    return StoreConfig(
        cpu_bytes=8 * per_block,
        disk_path=str(tmp_path / "blocks"),
        disk_bytes=8 * (per_block + 256),
        fsync=False,
        pin_file=str(tmp_path / "pins.json"),
    )


def test_store_pins_a_prefix_and_keeps_its_pins_across_a_restart(
    tmp_path: Path, namespace: Namespace
) -> None:
    blocks = make_blocks(namespace, 50, seed=3)
    config = _store_config(tmp_path, blocks[0].nbytes)
    with build_store(config) as store:
        store.put_many(namespace.id, blocks[:3])
        # make_blocks keys its blocks with block_keys over seeded tokens: pin them by keys.
        result = store.pin_keys(namespace.id, [b.key for b in blocks[:3]])
        assert result.num_new == 3 and result.protected == {"cpu": 3, "disk": 3}
    with build_store(config) as store:
        assert store.pinned() == {namespace.id: [b.key for b in blocks[:3]]}
        for i in range(3, 50, 4):
            store.put_many(namespace.id, blocks[i : i + 4])
        store.flush()
        restored = store.restore_prefix(namespace.id, [b.key for b in blocks[:3]])
        assert [bytes(b.data) for b in restored.blocks] == [bytes(b.data) for b in blocks[:3]]
        assert store.stats()["tiers"]["disk"]["pinned_blocks"] == 3


def test_pin_prefix_pins_the_chain_of_the_prompt(tmp_path: Path, namespace: Namespace) -> None:
    tokens = list(range(100, 100 + 3 * namespace.block_size + 5))
    with build_store(_store_config(tmp_path, 4096)) as store:
        result = store.pin_prefix(namespace, tokens)
        assert list(result.keys) == block_keys(namespace, tokens)  # the one key function
        assert len(result.keys) == 3 and result.protected == {"cpu": 0, "disk": 0}
        with pytest.raises(ValueError, match="no full block"):
            store.pin_prefix(namespace, tokens[:3])


def test_a_refused_pin_is_undone_in_every_tier(tmp_path: Path, namespace: Namespace) -> None:
    blocks = make_blocks(namespace, 6)
    config = _store_config(tmp_path, blocks[0].nbytes)
    with build_store(config) as store:
        store.put_many(namespace.id, blocks)
        store.flush()
        store.tiers[0].delete(namespace.id, [b.key for b in blocks])  # CPU holds none: pins
        with pytest.raises(PinLimitError):  # ...but the disk refuses 6 of 8
            store.pin_keys(namespace.id, [b.key for b in blocks])
        assert store.pinned() == {}
        assert store.tiers[0].stats()["pinned_keys"] == 0
        assert PinRegistry(tmp_path / "pins.json").load() == {}


def test_a_corrupt_pin_registry_is_refused_with_its_name(tmp_path: Path) -> None:
    path = tmp_path / "pins.json"
    path.write_text("{not json")
    with pytest.raises(PinRegistryError, match="pins.json"):
        PinRegistry(path).load()
    with pytest.raises(PinRegistryError, match="pins.json"):
        build_store(StoreConfig(cpu_bytes=1 << 20, pin_file=str(path)))
    assert path.read_text() == "{not json"  # never overwritten


def test_pins_of_keys_not_stored_are_bounded_in_number(
    tmp_path: Path, namespace: Namespace
) -> None:
    # Keys pinned before they arrive cost no tier bytes; the count bound is what stops a caller
    # from growing the registry without end.
    pins = StorePins([], PinRegistry(tmp_path / "pins.json"), max_keys=4)
    keys = [b.key for b in make_blocks(namespace, 6)]
    pins.pin(namespace.id, keys[:3])
    pins.pin(namespace.id, keys[:3])  # pinned again: adds nothing, still allowed
    with pytest.raises(PinLimitError, match="may pin 4 keys"):
        pins.pin(namespace.id, keys[2:5])
    assert pins.listing() == {namespace.id: keys[:3]}
    assert PinRegistry(tmp_path / "pins.json").load() == {namespace.id: keys[:3]}
    pins.pin(namespace.id, keys[3:4])
    assert len(pins.listing()[namespace.id]) == 4
