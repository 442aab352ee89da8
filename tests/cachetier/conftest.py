"""Fixtures of the cachetier tests: a plain client of the shared Redis, tiers on it, a private
redis-server a test can stop, a real Redis Cluster started once per session, and a CPU tier
over a disk tier."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis

from cachetier.store.tiered import TieredStore
from cachetier.tiers.cpu import CPUTier, CPUTierConfig
from cachetier.tiers.disk.tier import DiskTier, DiskTierConfig
from cachetier.tiers.redis import RedisTier
from tests.cachetier.local_cluster import LocalCluster
from tests.support import PrivateRedis, opened_redis_tiers


@pytest.fixture(scope="session")
def redis_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    """Three local masters (``LocalCluster``); killed at the end of the session.

    A test that stops a master brings it back and waits for a healthy cluster before it ends.
    """
    local = LocalCluster(tmp_path_factory.mktemp("redis-cluster"))
    try:
        local.start()
        yield local
    finally:
        local.stop_all()


@pytest.fixture
def raw(redis_url: str) -> Iterator[redis.Redis]:
    """A redis-py client of the shared Redis, to look at what a tier stored."""
    client = redis.Redis.from_url(redis_url)
    yield client
    client.close()


@pytest.fixture
def make_tier(redis_url: str, redis_prefix: str) -> Iterator[Callable[..., RedisTier]]:
    """Builds tiers on the shared Redis under this test's prefix (each one a "process"); closes
    them afterwards. (A module with a Redis of its own, such as the Cluster's, overrides it.)"""
    with opened_redis_tiers(url=redis_url, key_prefix=redis_prefix) as make:
        yield make


@pytest.fixture
def private_redis(tmp_path: Path) -> Iterator[PrivateRedis]:
    """A redis-server of this test's own, started; stopped at the end."""
    server = PrivateRedis(tmp_path)
    server.start()
    yield server
    server.stop()


@pytest.fixture
def cpu_disk_store(tmp_path: Path) -> Iterator[TieredStore]:
    """A real CPU tier over a real disk tier in the test's own folder, 1 GiB each."""
    stack = TieredStore(
        [
            CPUTier(CPUTierConfig(1 << 30)),
            DiskTier(DiskTierConfig(str(tmp_path / "disk"), 1 << 30, fsync=False)),
        ]
    )
    yield stack
    stack.close()
