"""RedisTier against real Redis: records, TTL, corruption, the shared LRU, outages, recovery.

The shared tier suite covers what every tier does; this file covers what only Redis does.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator

import numpy as np
import pytest
import redis

from cachetier.primitives.keys import BlockHash, Namespace
from cachetier.record import KVBlock, encode_record
from cachetier.tiers.redis import RedisTier, RedisTierConfig
from tests.support import (
    FAST_FAIL,
    TIMEOUT_S,
    FakeClock,
    PrivateRedis,
    make_blocks,
    refusing_port,
    silent_port,
)

MakeTier = Callable[..., RedisTier]


@pytest.fixture
def hung_url() -> Iterator[str]:
    """A port that accepts TCP connections (the kernel's backlog) but never answers."""
    with silent_port() as port:
        yield f"redis://127.0.0.1:{port}/0"


def _keys(blocks: list[KVBlock]) -> list[BlockHash]:
    return [b.key for b in blocks]


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
    asked = [blocks[0].key, absent[0].key, *_keys(blocks[1:]), absent[1].key]
    got = tier.get_many(namespace.id, asked)
    assert got[1] is None and got[-1] is None
    assert [g.key if g else None for g in got] == [
        blocks[0].key,
        None,
        *_keys(blocks[1:]),
        None,
    ]
    assert tier.contains_prefix(namespace.id, _keys(blocks)) == 24
    gapped = [*_keys(blocks[:5]), absent[0].key, blocks[5].key]
    assert tier.contains_prefix(namespace.id, gapped) == 5
    assert tier.contains_prefix(namespace.id, [absent[0].key, *_keys(blocks)]) == 0
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
    assert tier.delete(namespace.id, _keys(blocks)) == 3
    assert tier.delete(namespace.id, _keys(blocks)) == 0
    assert tier.used_bytes == 0

    tiny = make_tier(capacity_bytes=size - 1)
    assert tiny.put_many(namespace.id, blocks[:1]) == 0
    assert tiny.stats()["rejected"] == 1
    assert tiny.contains_prefix(namespace.id, _keys(blocks[:1])) == 0


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
    assert tier.get_many(namespace.id, _keys(blocks[:2])) == [None, None]  # ...a get notices
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
    assert tier.contains_prefix(namespace.id, _keys(mine[:1])) == 0
    assert tier.contains_prefix("other-ns", _keys(other)) == 3
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
                    tier.get_many(namespace.id, _keys(picked))
                else:
                    tier.delete(namespace.id, _keys(picked[:1]))
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


# Outages: bounded misses, the breaker, recovery


def test_closed_port_gives_bounded_misses_then_opens_the_breaker(
    make_tier: MakeTier, namespace: Namespace
) -> None:
    with refusing_port() as port:
        clock = FakeClock()
        tier = make_tier(
            url=f"redis://127.0.0.1:{port}/0",
            capacity_bytes=1 << 20,
            failure_threshold=2,
            clock=clock,
            **FAST_FAIL,
        )
        blocks = make_blocks(namespace, 3)
        for _ in range(2):
            start = time.monotonic()
            assert tier.get_many(namespace.id, _keys(blocks)) == [None] * 3
            assert time.monotonic() - start < 5 * TIMEOUT_S
        stats = tier.stats()
        assert stats["breaker"]["state"] == "open" and stats["errors"] == 2
        skipped = stats["skipped"]  # stats() itself skipped its used_bytes read
        # Open: nothing reaches Redis, nothing raises, every answer is an empty one.
        assert tier.put_many(namespace.id, blocks) == 0
        assert tier.get_many(namespace.id, _keys(blocks)) == [None] * 3
        assert tier.contains_prefix(namespace.id, _keys(blocks)) == 0
        assert tier.delete(namespace.id, _keys(blocks)) == 0
        assert tier.clear(namespace.id) == 0
        stats = tier.stats()
        assert stats["errors"] == 2 and stats["skipped"] == skipped + 6
        assert stats["misses"] == 9 and stats["puts"] == 0


def test_unanswering_server_gives_bounded_misses_then_immediate_ones(
    make_tier: MakeTier, hung_url: str, namespace: Namespace
) -> None:
    clock = FakeClock()
    tier = make_tier(url=hung_url, failure_threshold=1, clock=clock, **FAST_FAIL)
    blocks = make_blocks(namespace, 2)
    start = time.monotonic()
    assert tier.get_many(namespace.id, _keys(blocks)) == [None, None]
    assert time.monotonic() - start < 5 * TIMEOUT_S  # the socket timeout cut the wait short
    start = time.monotonic()
    assert tier.put_many(namespace.id, blocks) == 0
    assert time.monotonic() - start < TIMEOUT_S  # skipped: no wait for an answer at all
    stats = tier.stats()
    assert (stats["errors"], stats["skipped"], stats["breaker"]["state"]) == (1, 1, "open")


@pytest.mark.faults
def test_recovers_by_itself_after_redis_restarts(
    private_redis: PrivateRedis, namespace: Namespace
) -> None:
    clock = FakeClock()
    config = RedisTierConfig(
        url=private_redis.url,
        failure_threshold=2,
        backoff_base_s=0.05,
        backoff_cap_s=0.2,
        **FAST_FAIL,  # type: ignore[arg-type]
    )
    blocks = make_blocks(namespace, 3)
    with RedisTier(config, clock=clock) as tier:
        assert tier.put_many(namespace.id, blocks) == 3
        private_redis.stop()
        for _ in range(2):
            assert tier.get_many(namespace.id, _keys(blocks)) == [None] * 3
        assert tier.stats()["breaker"]["state"] == "open"

        private_redis.start()  # empty: it kept nothing (--save "")
        assert tier.put_many(namespace.id, blocks) == 0  # still open: the backoff has not passed
        clock.advance(0.05)
        assert tier.put_many(namespace.id, blocks) == 3  # the trial call, on a new connection
        assert tier.stats()["breaker"]["state"] == "closed"
        assert all(tier.get_many(namespace.id, _keys(blocks)))
        stats = tier.stats()
        assert (stats["errors"], stats["skipped"], stats["breaker"]["num_opens"]) == (2, 1, 1)


@pytest.mark.faults
def test_pooled_connections_survive_a_quick_restart(
    private_redis: PrivateRedis, namespace: Namespace
) -> None:
    config = RedisTierConfig(url=private_redis.url, **FAST_FAIL)  # type: ignore[arg-type]
    blocks = make_blocks(namespace, 2)
    with RedisTier(config) as tier:
        assert tier.put_many(namespace.id, blocks) == 2
        private_redis.stop()
        private_redis.start()
        # The pooled connection died with the old server; the pool notices and reconnects.
        assert tier.get_many(namespace.id, _keys(blocks)) == [None, None]
        assert tier.put_many(namespace.id, blocks) == 2
        assert all(tier.get_many(namespace.id, _keys(blocks)))
        assert tier.stats()["errors"] == 0


def test_a_store_across_a_thin_link_reads_whole_with_a_longer_timeout(
    redis_url: str, redis_prefix: str
) -> None:
    # 12 records of 1.5 MB over an 8 MB/s hop, read on the tier's parallel streams: a stream
    # waits behind the others' queued bytes for longer than the default 0.5 s (seen here: the
    # read failed, every block a miss). redis_timeout_s is the setting for such a link.
    from urllib.parse import urlsplit

    from cachetier.primitives.keys import KVLayout, block_keys
    from cachetier.store.config import StoreConfig, build_store
    from tests.throttled_link import SlowLink

    layout = KVLayout("float32", 32, 30, 3, 64)  # SmolLM2's 32-token block: 1.47 MB
    namespace = Namespace("thin-link", layout)
    keys = block_keys(namespace, list(range(12 * 32)))
    rng = np.random.default_rng(0)
    blocks = [
        KVBlock(
            key,
            namespace.fingerprint,
            "float32",
            layout.payload_shape,
            32,
            rng.integers(0, 255, layout.block_bytes, dtype=np.uint8).tobytes(),
        )
        for key in keys
    ]
    with build_store(
        StoreConfig(cpu_bytes=0, redis_url=redis_url, redis_key_prefix=redis_prefix)
    ) as store:
        assert store.put_many(namespace.id, blocks) == len(blocks)
        store.flush()
    url = urlsplit(redis_url)
    with SlowLink((url.hostname or "127.0.0.1", url.port or 6379), 8e6) as link:
        config = StoreConfig(
            cpu_bytes=0,
            redis_url=f"redis://{link.host}:{link.port}{url.path or '/0'}",
            redis_key_prefix=redis_prefix,
            redis_timeout_s=10.0,
        )
        with build_store(config) as store:
            restored = store.restore_prefix(namespace.id, keys, fingerprint=namespace.fingerprint)
            assert [b.key for b in restored.blocks] == keys
            assert [bytes(b.data) for b in restored.blocks] == [b.data for b in blocks]
            assert store.stats()["tiers"]["redis"]["errors"] == 0
    with pytest.raises(ValueError, match="redis_timeout_s"):
        StoreConfig(redis_url=redis_url, redis_timeout_s=0)
