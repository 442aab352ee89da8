"""RedisTier when Redis fails: bounded misses from a closed or silent port, the breaker, recovery
after a restart, and a thin link read whole with a longer timeout."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator

import numpy as np
import pytest

from cachetier.primitives.keys import Namespace
from cachetier.record import KVBlock
from cachetier.store.config import StoreConfig, build_store
from cachetier.tiers.redis import RedisTier, RedisTierConfig
from tests.support import (
    FAST_FAIL,
    TIMEOUT_S,
    FakeClock,
    PrivateRedis,
    keys_of,
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
            assert tier.get_many(namespace.id, keys_of(blocks)) == [None] * 3
            assert time.monotonic() - start < 5 * TIMEOUT_S
        stats = tier.stats()
        assert stats["breaker"]["state"] == "open" and stats["errors"] == 2
        skipped = stats["skipped"]  # stats() itself skipped its used_bytes read
        # Open: nothing reaches Redis, nothing raises, every answer is an empty one.
        assert tier.put_many(namespace.id, blocks) == 0
        assert tier.get_many(namespace.id, keys_of(blocks)) == [None] * 3
        assert tier.contains_prefix(namespace.id, keys_of(blocks)) == 0
        assert tier.delete(namespace.id, keys_of(blocks)) == 0
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
    assert tier.get_many(namespace.id, keys_of(blocks)) == [None, None]
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
            assert tier.get_many(namespace.id, keys_of(blocks)) == [None] * 3
        assert tier.stats()["breaker"]["state"] == "open"

        private_redis.start()  # empty: it kept nothing (--save "")
        assert tier.put_many(namespace.id, blocks) == 0  # still open: the backoff has not passed
        clock.advance(0.05)
        assert tier.put_many(namespace.id, blocks) == 3  # the trial call, on a new connection
        assert tier.stats()["breaker"]["state"] == "closed"
        assert all(tier.get_many(namespace.id, keys_of(blocks)))
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
        assert tier.get_many(namespace.id, keys_of(blocks)) == [None, None]
        assert tier.put_many(namespace.id, blocks) == 2
        assert all(tier.get_many(namespace.id, keys_of(blocks)))
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


def test_an_unreachable_redis_is_said_at_error_once_then_warned_a_minute_apart(
    make_tier: MakeTier, namespace: Namespace, caplog: pytest.LogCaptureFixture
) -> None:
    with refusing_port() as port:
        clock = FakeClock()
        url = f"redis://user:s3cret@127.0.0.1:{port}/0"
        tier = make_tier(url=url, failure_threshold=1, clock=clock, **FAST_FAIL)
        keys = keys_of(make_blocks(namespace, 2))
        with caplog.at_level(logging.WARNING, logger="cachetier"):
            for _ in range(5):
                tier.get_many(namespace.id, keys)
                clock.advance(5.0)  # the breaker lets a trial call through again
            errors = [r for r in caplog.records if r.levelno == logging.ERROR]
            assert len(errors) == 1 and f"127.0.0.1:{port}" in errors[0].getMessage()
            assert "cannot be reached" in errors[0].getMessage()
            assert not [r for r in caplog.records if r.levelno == logging.WARNING]
            clock.advance(61.0)
            tier.get_many(namespace.id, keys)
        warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warnings) == 1 and "still cannot be reached" in warnings[0]
        assert "s3cret" not in caplog.text  # the password is masked everywhere
        tier.close()


def test_a_store_says_an_unreachable_redis_as_it_starts(
    redis_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    # Before any request: a pod whose redis_url is wrong says so as it starts, not when
    # traffic first comes, and one whose Redis answers says nothing.
    with refusing_port() as port, caplog.at_level(logging.WARNING, logger="cachetier"):
        url = f"redis://user:s3cret@127.0.0.1:{port}/0"
        with build_store(StoreConfig(cpu_bytes=1 << 20, redis_url=url)) as store:
            errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
            assert store.stats()["tiers"]["redis"]["errors"] == 1
    assert len(errors) == 1 and f"127.0.0.1:{port}" in errors[0]
    assert "cannot be reached" in errors[0] and "s3cret" not in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="cachetier"):
        with build_store(StoreConfig(cpu_bytes=1 << 20, redis_url=redis_url)) as store:
            assert store.stats()["tiers"]["redis"]["errors"] == 0
    assert not caplog.records
