"""Pins of the Redis tier against real Redis: shared by every process on a key prefix, kept
consistent with the exact LRU, refused clearly (and undone in a whole store) when Redis is down.

``test_pins.py`` runs the pin tests every pinnable tier passes; this file covers what only
Redis does.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import TypeVar

import pytest
import redis

from cachetier.errors import PinsUnsupportedError, TierUnavailableError
from cachetier.pins.registry import PinRegistry
from cachetier.primitives.keys import BlockHash, Namespace
from cachetier.record import KVBlock, encode_record
from cachetier.store.config import StoreConfig, build_store
from cachetier.tiers.redis import RedisTier, RedisTierConfig
from tests.support import PrivateRedis, make_blocks

_T = TypeVar("_T")


def _keys(blocks: list[KVBlock]) -> list[BlockHash]:
    return [b.key for b in blocks]


def _per_block(blocks: list[KVBlock]) -> int:
    return len(encode_record(blocks[0]))


def _present(tier: RedisTier, ns: str, blocks: list[KVBlock]) -> list[bool]:
    got = tier.get_many(ns, _keys(blocks))
    return [g is not None and bytes(g.data) == bytes(b.data) for g, b in zip(got, blocks)]


def _check_accounting(raw: redis.Redis, prefix: str) -> None:
    """What the scripts keep: every accounted record in exactly one of _lru and _protected,
    _used the sum of their sizes, _pinned_bytes that of the protected ones."""
    sizes = {k: int(v) for k, v in raw.hgetall(f"{prefix}:_size").items()}
    in_lru = set(raw.zrange(f"{prefix}:_lru", 0, -1))
    protected = raw.smembers(f"{prefix}:_protected")
    assert in_lru.isdisjoint(protected)
    assert in_lru | protected == set(sizes)
    assert protected <= raw.smembers(f"{prefix}:_pinned")
    assert int(raw.get(f"{prefix}:_used") or 0) == sum(sizes.values())
    assert int(raw.get(f"{prefix}:_pinned_bytes") or 0) == sum(sizes[k] for k in protected)


def test_a_pin_made_by_one_process_protects_against_a_flood_of_another(
    make_tier, raw: redis.Redis, redis_prefix: str, namespace: Namespace
) -> None:
    blocks = make_blocks(namespace, 60)
    capacity = 8 * _per_block(blocks)
    pinner, flooder = make_tier(capacity_bytes=capacity), make_tier(capacity_bytes=capacity)
    chain, waiting, others = blocks[:3], blocks[3:4], blocks[4:]
    pinner.put_many(namespace.id, chain)
    assert pinner.pin(namespace.id, _keys(chain + waiting)) == 3
    flooder.put_many(namespace.id, waiting)  # pinned on arrival, through the other process
    for i in range(0, len(others), 5):
        flooder.put_many(namespace.id, others[i : i + 5])
    assert flooder.stats()["evictions"] >= len(others) - 8
    assert _present(flooder, namespace.id, chain + waiting) == [True] * 4
    for tier in (pinner, flooder):  # both read the same pins, from Redis
        stats = tier.stats()
        assert (stats["pinned_keys"], stats["pinned_blocks"], stats["pinned_waiting"]) == (4, 4, 0)
        assert stats["pinned_bytes"] == 4 * _per_block(blocks)
    _check_accounting(raw, redis_prefix)
    # An unpin through the flooder unpins for both: the chain is evictable again.
    assert flooder.unpin(namespace.id, _keys(chain)) == 3
    assert pinner.stats()["pinned_keys"] == 1
    flooder.put_many(namespace.id, others[:10])
    assert _present(pinner, namespace.id, chain) == [False] * 3
    _check_accounting(raw, redis_prefix)


def test_a_get_does_not_put_a_pinned_record_back_into_the_lru(
    make_tier, raw: redis.Redis, redis_prefix: str, namespace: Namespace
) -> None:
    blocks = make_blocks(namespace, 30)
    tier = make_tier(capacity_bytes=6 * _per_block(blocks))
    tier.put_many(namespace.id, blocks[:2])
    tier.pin(namespace.id, _keys(blocks[:2]))
    for _ in range(3):
        assert _present(tier, namespace.id, blocks[:2]) == [True, True]  # runs the touch script
    lru = f"{redis_prefix}:_lru"
    assert [raw.zscore(lru, tier.storage_key(namespace.id, b.key)) for b in blocks[:2]] == [
        None,
        None,
    ]
    for i in range(2, 30, 4):
        tier.put_many(namespace.id, blocks[i : i + 4])
        tier.get_many(namespace.id, _keys(blocks[:2]))
    assert _present(tier, namespace.id, blocks[:2]) == [True, True]
    _check_accounting(raw, redis_prefix)


def test_a_pinned_block_past_the_bound_waits_as_an_lru_entry(
    make_tier, raw: redis.Redis, redis_prefix: str, namespace: Namespace
) -> None:
    blocks = make_blocks(namespace, 40)
    tier = make_tier(capacity_bytes=8 * _per_block(blocks))  # may protect 4
    pinned = blocks[:5]
    assert tier.pin(namespace.id, _keys(pinned)) == 0  # none stored yet: all pinned on arrival
    tier.put_many(namespace.id, pinned)
    stats = tier.stats()
    assert (stats["pinned_blocks"], stats["pinned_waiting"]) == (4, 1)
    _check_accounting(raw, redis_prefix)
    for i in range(5, 40, 5):
        tier.put_many(namespace.id, blocks[i : i + 5])
    assert _present(tier, namespace.id, pinned) == [True] * 4 + [False]  # the 5th was a victim
    assert tier.stats()["pinned_keys"] == 5  # its pin stays: it is protected if room is made
    tier.unpin(namespace.id, _keys(pinned[:1]))
    tier.put_many(namespace.id, pinned[4:])
    tier.put_many(namespace.id, blocks[5:15])
    assert _present(tier, namespace.id, pinned[4:]) == [True]
    _check_accounting(raw, redis_prefix)


def test_a_deleted_pinned_record_frees_its_bytes_and_keeps_its_pin(
    make_tier, raw: redis.Redis, redis_prefix: str, namespace: Namespace
) -> None:
    blocks = make_blocks(namespace, 3)
    tier = make_tier(capacity_bytes=8 * _per_block(blocks))
    tier.put_many(namespace.id, blocks)
    tier.pin(namespace.id, _keys(blocks))
    assert tier.delete(namespace.id, _keys(blocks[:1])) == 1
    assert tier.clear(namespace.id) == 2
    stats = tier.stats()
    assert (stats["pinned_keys"], stats["pinned_blocks"], stats["pinned_bytes"]) == (3, 0, 0)
    assert tier.used_bytes == 0
    _check_accounting(raw, redis_prefix)
    tier.put_many(namespace.id, blocks[:1])  # arrives again: protected again
    assert tier.stats()["pinned_blocks"] == 1
    _check_accounting(raw, redis_prefix)


def test_only_a_single_node_with_a_capacity_can_pin(make_tier, namespace: Namespace) -> None:
    key = make_blocks(namespace, 1)[0].key
    unbounded = make_tier()  # Redis's maxmemory evicts: nothing of ours to keep pins from
    # A cluster tier reads its slot map on first use: making it does no I/O.
    cluster = RedisTier(RedisTierConfig(url="redis+cluster://127.0.0.1:1", key_prefix="x"))
    try:
        for tier in (unbounded, cluster):
            assert not tier.supports_pins
            with pytest.raises(PinsUnsupportedError, match="maxmemory"):
                tier.pin(namespace.id, [key])
            assert tier.pin_stats()["max_pinned_bytes"] == 0
    finally:
        cluster.close()
    assert make_tier(capacity_bytes=1 << 20, max_pinned_fraction=0.25).stats()[
        "max_pinned_bytes"
    ] == (1 << 18)


def test_a_store_config_bounds_redis_for_pins(redis_url: str) -> None:
    env = {"CACHETIER_REDIS_URL": redis_url, "CACHETIER_REDIS_BYTES": str(1 << 20)}
    config = StoreConfig.from_env(env, cpu_bytes=0, max_pinned_fraction=0.25)
    with build_store(config) as store:
        (tier,) = store.tiers
        assert tier.supports_pins and tier.capacity_bytes == 1 << 20
        assert tier.pin_stats()["max_pinned_bytes"] == 1 << 18
    with pytest.raises(ValueError, match="redis_bytes is set without redis_url"):
        StoreConfig(redis_bytes=1 << 20)


@pytest.mark.faults
def test_a_redis_stopped_during_a_pin_refuses_it_whole_in_the_store(
    private_redis: PrivateRedis, tmp_path: Path, namespace: Namespace
) -> None:
    blocks = make_blocks(namespace, 4)
    config = StoreConfig(
        cpu_bytes=16 * blocks[0].nbytes,
        redis_url=private_redis.url,
        redis_key_prefix="pins",
        redis_bytes=16 * _per_block(blocks),
        pin_file=str(tmp_path / "pins.json"),
    )
    with build_store(config) as store:
        store.put_many(namespace.id, blocks)
        store.flush()
        cpu, rtier = store.tiers
        assert rtier.supports_pins
        private_redis.stop()
        with pytest.raises(TierUnavailableError, match="could not pin") as refused:
            store.pin_keys(namespace.id, _keys(blocks))
        assert private_redis.url.rsplit("/", 1)[0].split("//")[1] in str(refused.value)
        # Nothing half-pinned: the CPU tier gave its pins back, nothing was recorded.
        assert store.pinned() == {}
        assert cpu.pin_stats()["pinned_keys"] == 0
        assert PinRegistry(tmp_path / "pins.json").load() == {}
        # The store's stats still answer (the last pin figures read from Redis).
        assert store.stats()["tiers"]["redis"]["pinned_keys"] == 0

        private_redis.start()  # empty (--save ""): it kept nothing
        result = _retry_while_unavailable(lambda: store.pin_keys(namespace.id, _keys(blocks)))
        assert result.protected == {"cpu": 4, "redis": 0}  # pinned in Redis on arrival
        assert rtier.pin_stats()["pinned_waiting"] == 4

        private_redis.stop()
        with pytest.raises(TierUnavailableError, match="could not unpin"):
            store.unpin_keys(namespace.id, _keys(blocks))
        # The unpin is undone in the CPU tier too: the store and its tiers agree.
        assert store.pinned() == {namespace.id: _keys(blocks)}
        assert cpu.pin_stats()["pinned_blocks"] == 4


def _retry_while_unavailable(op: Callable[[], _T]) -> _T:
    """``op()`` once the tier's breaker lets a trial call through (its backoff is short)."""
    for _ in range(200):
        try:
            return op()
        except TierUnavailableError:
            time.sleep(0.02)
    return op()


def test_a_store_keeps_a_pinned_chain_in_redis_after_cpu_and_disk_lost_it(
    redis_url: str, redis_prefix: str, tmp_path: Path, namespace: Namespace
) -> None:
    blocks = make_blocks(namespace, 60, seed=5)
    per_block = _per_block(blocks)
    config = StoreConfig(
        cpu_bytes=8 * blocks[0].nbytes,
        disk_path=str(tmp_path / "blocks"),
        disk_bytes=8 * per_block,
        fsync=False,
        redis_url=redis_url,
        redis_key_prefix=redis_prefix,
        redis_bytes=8 * per_block,
    )
    chain = blocks[:3]
    with build_store(config) as store:
        store.put_many(namespace.id, chain)
        store.flush()
        assert store.pin_keys(namespace.id, _keys(chain)).protected == {
            "cpu": 3,
            "disk": 3,
            "redis": 3,
        }
        for i in range(3, 60, 4):
            store.put_many(namespace.id, blocks[i : i + 4])
        store.flush()
        assert store.stats()["tiers"]["redis"]["evictions"] > 0
    # Another process (its own CPU tier and disk folder, no pin file) on the same Redis.
    other = replace(config, disk_path=str(tmp_path / "other"))
    with build_store(other) as store:
        restored = store.restore_prefix(namespace.id, _keys(chain))
        assert [bytes(b.data) for b in restored.blocks] == [bytes(b.data) for b in chain]
        assert store.stats()["tiers"]["redis"]["pinned_blocks"] == 3
