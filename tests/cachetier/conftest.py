"""Fixtures of the cachetier tests: a plain client of the shared Redis, and a real Redis Cluster
started once per session."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import redis

from tests.cachetier.local_cluster import LocalCluster


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
