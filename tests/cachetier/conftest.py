"""Fixtures of the cachetier tests: a real Redis Cluster, started once per session."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

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
