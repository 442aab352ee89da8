"""Fixtures shared by every test package: real Redis, temp folders, small blocks."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator

import pytest
import redis

from cachetier.keys import Namespace
from tests.support import SMALL_LAYOUT

REDIS_URL = os.environ.get("CACHETIER_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")


@pytest.fixture(scope="session")
def redis_url() -> str:
    """The real Redis every machine here runs; a test that needs it fails loudly if it is down."""
    client = redis.Redis.from_url(REDIS_URL, socket_timeout=2)
    try:
        client.ping()
    except redis.exceptions.RedisError as exc:
        pytest.fail(f"Redis at {REDIS_URL} does not answer ({exc}); .ci/run starts one")
    finally:
        client.close()
    return REDIS_URL


@pytest.fixture
def redis_prefix(redis_url: str) -> Iterator[str]:
    """A key prefix of this test's own; every key under it is deleted afterwards."""
    prefix = f"cachetier-test-{uuid.uuid4().hex[:12]}"
    yield prefix
    client = redis.Redis.from_url(redis_url)
    try:
        keys = list(client.scan_iter(match=f"{prefix}*", count=1000))
        if keys:
            client.delete(*keys)
    finally:
        client.close()


@pytest.fixture
def namespace() -> Namespace:
    return Namespace("test-model", SMALL_LAYOUT)
