"""RedisTier against real Redis: records, TTL, corruption, the shared LRU, bad input.

The shared tier suite covers what every tier does; this file covers what only Redis does, and
``test_redis_outages`` how the tier lives through a Redis that fails.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import numpy as np
import pytest
import redis

from cachetier.primitives.keys import BlockHash, Namespace
from cachetier.record import KVBlock, encode_record
from cachetier.tiers.redis import RedisTier, RedisTierConfig
from tests.support import FAST_FAIL, keys_of, make_blocks, refusing_port

MakeTier = Callable[..., RedisTier]


def _record_bytes(block: KVBlock) -> int:
    return len(encode_record(block))


# Records and keys


@pytest.mark.parametrize("compression", ["none", "lz4"])
def test_roundtrip_keeps_every_field(
    make_tier: MakeTier, raw: redis.Redis, namespace: Namespace, compression: str
) -> None:
    tier = make_tier(compression=compression)
    data = np.zeros((2, 2, 16, 2, 8), dtype=np.float16)
    data[0, 0, 0] = 1.5  # compressible, but not all zeros
    block = KVBlock(
        make_blocks(namespace, 1)[0].key,
        namespace.fingerprint,
        "float16",
        data.shape,
        16,
        data.tobytes(),
        aux=b"fp8 scales",
    )
    assert tier.put_many(namespace.id, [block]) == 1
    [got] = tier.get_many(namespace.id, [block.key])
    assert got is not None
    assert (got.key, got.fingerprint, got.dtype, got.shape) == (
        block.key,
        block.fingerprint,
        "float16",
        data.shape,
    )
    assert (got.num_tokens, bytes(got.aux), bytes(got.data)) == (16, b"fp8 scales", data.tobytes())
    stored = raw.strlen(tier.storage_key(namespace.id, block.key))
    if compression == "lz4":
        assert stored < data.nbytes
    else:
        assert stored == _record_bytes(block)
    stats = tier.stats()
    assert (stats["puts"], stats["hits"], stats["bytes_out"]) == (1, 1, stored)


def test_storage_key_layout_and_no_lru_keys_without_a_capacity(
    make_tier: MakeTier, raw: redis.Redis, redis_prefix: str, namespace: Namespace
) -> None:
    tier = make_tier()
    [block] = make_blocks(namespace, 1)
    tier.put_many(namespace.id, [block])
    tier.get_many(namespace.id, [block.key])
    name = f"{redis_prefix}:{namespace.id}:{block.key.hex()}"
    assert tier.storage_key(namespace.id, block.key) == name
    assert raw.get(name) == encode_record(block)
    assert sorted(raw.scan_iter(match=f"{redis_prefix}*")) == [name.encode()]
    assert tier.used_bytes == 0 and tier.capacity_bytes is None


def test_batches_keep_positions_and_prefix_runs(make_tier: MakeTier, namespace: Namespace) -> None:
    tier = make_tier()
    blocks = make_blocks(namespace, 24)
    absent = make_blocks(namespace, 2, seed=1)
    assert tier.put_many(namespace.id, blocks) == 24
    asked = [blocks[0].key, absent[0].key, *keys_of(blocks[1:]), absent[1].key]
    got = tier.get_many(namespace.id, asked)
    assert got[1] is None and got[-1] is None
    assert [g.key if g else None for g in got] == [
        blocks[0].key,
        None,
        *keys_of(blocks[1:]),
        None,
    ]
    assert tier.contains_prefix(namespace.id, keys_of(blocks)) == 24
    gapped = [*keys_of(blocks[:5]), absent[0].key, blocks[5].key]
    assert tier.contains_prefix(namespace.id, gapped) == 5
    assert tier.contains_prefix(namespace.id, [absent[0].key, *keys_of(blocks)]) == 0
    stats = tier.stats()
    assert (stats["hits"], stats["misses"]) == (24, 2)


def test_empty_batches_do_no_io(make_tier: MakeTier, namespace: Namespace) -> None:
    with refusing_port() as port:
        tier = make_tier(url=f"redis://127.0.0.1:{port}/0", **FAST_FAIL)
        assert tier.put_many(namespace.id, []) == 0
        assert tier.get_many(namespace.id, []) == []
        assert tier.contains_prefix(namespace.id, []) == 0
        assert tier.delete(namespace.id, []) == 0
        assert tier.stats()["errors"] == 0


def test_ttl_expires_records(make_tier: MakeTier, raw: redis.Redis, namespace: Namespace) -> None:
    tier = make_tier(ttl_s=0.3)
    [block] = make_blocks(namespace, 1)
    tier.put_many(namespace.id, [block])
    assert 0 < raw.pttl(tier.storage_key(namespace.id, block.key)) <= 300
    assert tier.get_many(namespace.id, [block.key])[0] is not None
    deadline = time.monotonic() + 5
    while tier.get_many(namespace.id, [block.key])[0] is not None:
        assert time.monotonic() < deadline, "record outlived its ttl by seconds"
        time.sleep(0.05)
    assert tier.stats()["errors"] == 0


def _flip(value: bytes) -> bytes:
    out = bytearray(value)
    out[len(out) // 2] ^= 0x01
    return bytes(out)


@pytest.mark.parametrize("capacity", [None, 1 << 20])
@pytest.mark.parametrize(
    "damage", [_flip, lambda v: v[:-1], lambda v: b"not a record"], ids=["flip", "cut", "junk"]
)
def test_corrupt_record_is_a_counted_miss_and_deleted(
    make_tier: MakeTier,
    raw: redis.Redis,
    redis_prefix: str,
    namespace: Namespace,
    capacity: int | None,
    damage: Callable[[bytes], bytes],
) -> None:
    tier = make_tier(capacity_bytes=capacity)
    good, bad = make_blocks(namespace, 2)
    tier.put_many(namespace.id, [good, bad])
    name = tier.storage_key(namespace.id, bad.key)
    raw.set(name, damage(raw.get(name) or b""))
    got = tier.get_many(namespace.id, [good.key, bad.key])
    assert got[0] is not None and got[1] is None
    assert raw.exists(name) == 0
    stats = tier.stats()
    assert (stats["corrupt"], stats["hits"], stats["misses"], stats["errors"]) == (1, 1, 1, 0)
    if capacity is not None:  # the accounting forgot the deleted record too
        assert tier.used_bytes == _record_bytes(good)
        assert raw.zcard(f"{redis_prefix}:_lru") == 1


def test_record_under_another_key_is_a_miss(
    make_tier: MakeTier, raw: redis.Redis, namespace: Namespace
) -> None:
    tier = make_tier()
    stored, other = make_blocks(namespace, 2)
    tier.put_many(namespace.id, [stored])
    record = raw.get(tier.storage_key(namespace.id, stored.key))
    raw.set(tier.storage_key(namespace.id, other.key), record or b"")
    assert tier.get_many(namespace.id, [other.key]) == [None]
    assert raw.exists(tier.storage_key(namespace.id, other.key)) == 0
    assert tier.get_many(namespace.id, [stored.key])[0] is not None
    assert tier.stats()["corrupt"] == 1


# Capacity: the LRU kept in Redis


def test_lru_is_shared_by_tiers_on_the_same_prefix(
    make_tier: MakeTier, raw: redis.Redis, namespace: Namespace
) -> None:
    blocks = make_blocks(namespace, 5)
    size = _record_bytes(blocks[0])
    tier_a = make_tier(capacity_bytes=3 * size)
    tier_b = make_tier(capacity_bytes=3 * size)  # another process, as far as Redis can tell
    ns = namespace.id

    def stored() -> list[int]:
        return [i for i, b in enumerate(blocks) if raw.exists(tier_a.storage_key(ns, b.key))]

    tier_a.put_many(ns, blocks[0:2])
    tier_b.put_many(ns, blocks[2:3])
    assert tier_a.get_many(ns, [blocks[0].key])[0] is not None  # 0 is now the most recent
    tier_b.put_many(ns, blocks[3:4])
    assert stored() == [0, 2, 3]  # 1 was least recently used, whoever used it
    tier_a.put_many(ns, blocks[4:5])
    assert stored() == [0, 3, 4]
    assert tier_a.stats()["evictions"] == 1 and tier_b.stats()["evictions"] == 1
    assert tier_a.used_bytes == tier_b.used_bytes == 3 * size


def test_capacity_accounting_on_overwrite_delete_and_oversize(
    make_tier: MakeTier, namespace: Namespace
) -> None:
    blocks = make_blocks(namespace, 3)
    size = _record_bytes(blocks[0])
    tier = make_tier(capacity_bytes=10 * size)
    tier.put_many(namespace.id, blocks)
    tier.put_many(namespace.id, blocks[:2])  # held: skipped, no double counting
    assert tier.used_bytes == 3 * size
    small = KVBlock(blocks[0].key, namespace.fingerprint, "uint8", (10,), 16, bytes(10))
    tier.put_many(namespace.id, [small])  # the same key is the same KV: not rewritten
    assert tier.used_bytes == 3 * size
    assert tier.stats()["skipped_present"] == 3
    tier.delete(namespace.id, [blocks[0].key])
    tier.put_many(namespace.id, [small])  # gone: written, and counted at its own size
    assert tier.used_bytes == 2 * size + _record_bytes(small)
    assert tier.delete(namespace.id, keys_of(blocks)) == 3
    assert tier.delete(namespace.id, keys_of(blocks)) == 0
    assert tier.used_bytes == 0

    tiny = make_tier(capacity_bytes=size - 1)
    assert tiny.put_many(namespace.id, blocks[:1]) == 0
    assert tiny.stats()["rejected"] == 1
    assert tiny.contains_prefix(namespace.id, keys_of(blocks[:1])) == 0


def test_expired_records_leave_the_accounting(
    make_tier: MakeTier, raw: redis.Redis, namespace: Namespace
) -> None:
    blocks = make_blocks(namespace, 4)
    tier = make_tier(capacity_bytes=1 << 20, ttl_s=0.2)
    tier.put_many(namespace.id, blocks)
    names = [tier.storage_key(namespace.id, b.key) for b in blocks]
    deadline = time.monotonic() + 5
    while raw.exists(*names):
        assert time.monotonic() < deadline, "records outlived their ttl by seconds"
        time.sleep(0.05)
    assert tier.used_bytes == 4 * _record_bytes(blocks[0])  # Redis does not tell us...
    assert tier.get_many(namespace.id, keys_of(blocks[:2])) == [None, None]  # ...a get notices
    assert tier.used_bytes == 2 * _record_bytes(blocks[0])
    assert tier.clear(namespace.id) == 0  # nothing left to remove, but the accounting is
    assert tier.used_bytes == 0


@pytest.mark.parametrize("capacity", [None, 1 << 24])
def test_clear_removes_one_namespace_only(
    make_tier: MakeTier, raw: redis.Redis, namespace: Namespace, capacity: int | None
) -> None:
    tier = make_tier(capacity_bytes=capacity)
    mine = make_blocks(namespace, 600)  # more than one SCAN step and one delete batch
    other = make_blocks(namespace, 3, seed=7)
    tier.put_many(namespace.id, mine)
    tier.put_many("other-ns", other)
    assert tier.clear(namespace.id) == 600
    assert tier.contains_prefix(namespace.id, keys_of(mine[:1])) == 0
    assert tier.contains_prefix("other-ns", keys_of(other)) == 3
    if capacity is not None:
        assert tier.used_bytes == 3 * _record_bytes(other[0])


def test_accounting_stays_exact_under_concurrent_tiers(
    make_tier: MakeTier, raw: redis.Redis, redis_prefix: str, namespace: Namespace
) -> None:
    blocks = make_blocks(namespace, 40)
    size = _record_bytes(blocks[0])
    tiers = [make_tier(capacity_bytes=10 * size) for _ in range(2)]
    errors: list[BaseException] = []

    def worker(seed: int) -> None:
        rng = np.random.default_rng(seed)
        tier = tiers[seed % 2]
        try:
            for _ in range(60):
                picked = [blocks[i] for i in rng.choice(40, size=4, replace=False)]
                if rng.random() < 0.5:
                    tier.put_many(namespace.id, picked)
                elif rng.random() < 0.8:
                    tier.get_many(namespace.id, keys_of(picked))
                else:
                    tier.delete(namespace.id, keys_of(picked[:1]))
        except BaseException as exc:  # surfaced below: a thread cannot fail the test itself
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(seed,)) for seed in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    names = [n.decode() for n in raw.zrange(f"{redis_prefix}:_lru", 0, -1)]
    present = [tiers[0].storage_key(namespace.id, b.key) for b in blocks]
    present = [n for n in present if raw.exists(n)]
    assert sorted(names) == sorted(present)
    assert raw.hlen(f"{redis_prefix}:_size") == len(present)
    assert tiers[0].used_bytes == len(present) * size <= 10 * size
    assert sum(t.stats()["errors"] for t in tiers) == 0


# Bad input still raises, whatever state Redis is in


def test_bad_arguments_raise_even_when_redis_is_down(namespace: Namespace) -> None:
    with refusing_port() as port:
        config = RedisTierConfig(url=f"redis://127.0.0.1:{port}/0", **FAST_FAIL)
        with RedisTier(config) as tier:
            [block] = make_blocks(namespace, 1)
            with pytest.raises(ValueError, match="namespace"):
                tier.get_many("bad/namespace", [block.key])
            with pytest.raises(ValueError, match="32 bytes"):
                tier.get_many(namespace.id, [BlockHash(b"short")])
            with pytest.raises(ValueError, match="32 bytes"):
                tier.contains_prefix(namespace.id, [block.key, BlockHash(bytes(33))])
            with pytest.raises(TypeError, match="KVBlock"):
                tier.put_many(namespace.id, [b"raw bytes"])  # type: ignore[list-item]
            with pytest.raises(ValueError, match="namespace"):
                tier.clear("_hidden")
            assert tier.stats()["errors"] == 0


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"url": "http://127.0.0.1:6379"}, "must start with"),
        ({"url": "redis+sentinel://127.0.0.1:26379"}, "must start with"),
        ({"url": "redis:///0"}, "must name a host"),
        ({"url": "redis://127.0.0.1:6379/zero"}, "database number"),
        ({"url": "redis://127.0.0.1:99999/0"}, "bad port"),
        ({"key_prefix": "a:b"}, "key_prefix"),
        ({"key_prefix": "*"}, "key_prefix"),
        ({"ttl_s": 0.0}, "ttl_s"),
        ({"capacity_bytes": 0}, "capacity_bytes"),
        ({"capacity_bytes": True}, "capacity_bytes"),
        ({"compression": "zstd"}, "compression"),
        ({"socket_timeout_s": 0}, "socket_timeout_s"),
        ({"max_connections": 0}, "max_connections"),
        ({"failure_threshold": 0}, "failure_threshold"),
        ({"backoff_base_s": 1.0, "backoff_cap_s": 0.5}, "cap_s"),
    ],
)
def test_config_rejects_bad_settings(settings: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        RedisTierConfig(**settings)  # type: ignore[arg-type]
