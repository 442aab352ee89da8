"""What a tier says and does once it finds a record corrupt: one WARNING per interval naming the
tier and the key, and lookups that stop counting the record."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import pytest

from cachetier.primitives.keys import Namespace
from cachetier.store.tiered import TieredStore
from cachetier.tiers.base import CORRUPT_LOG_INTERVAL_S
from cachetier.tiers.redis import RedisTier, RedisTierConfig
from tests.cachetier.tier_harness import TierHarness, build, redis_harness
from tests.support import make_blocks

BIG = 1 << 30
# The tier that finds the corruption: a stack of tiers reads it from its disk tier.
FINDER = {"disk": "disk", "redis": "redis", "redis-cluster": "redis", "tiered": "disk"}


@pytest.fixture(params=sorted(FINDER))
def kind_harness(
    request: pytest.FixtureRequest, tmp_path: Path
) -> Iterator[tuple[str, TierHarness]]:
    h = build(request.param, tmp_path, request.getfixturevalue)
    yield request.param, h
    h.close_all()


def _corrupt_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.levelno == logging.WARNING and "is corrupt" in r.getMessage()
    ]


def test_a_corrupt_record_is_logged_once_per_interval_and_no_longer_counted(
    kind_harness: tuple[str, TierHarness], namespace: Namespace, caplog: pytest.LogCaptureFixture
) -> None:
    kind, harness = kind_harness
    tier = harness.open(BIG)
    blocks = make_blocks(namespace, 3)
    keys = [b.key for b in blocks]
    tier.put_many(namespace.id, blocks)
    if isinstance(tier, TieredStore):
        tier.flush()
    assert harness.corrupt is not None
    for key in keys[:2]:
        harness.corrupt(tier, namespace.id, key)
    # Not known to be corrupt before a read checks it: a lookup still counts it.
    assert tier.contains_prefix(namespace.id, keys) == 3
    with caplog.at_level(logging.WARNING):
        assert tier.get_many(namespace.id, keys[:1]) == [None]
        assert tier.get_many(namespace.id, keys[1:2]) == [None]  # within the interval
    lines = _corrupt_lines(caplog)
    assert len(lines) == 1, lines
    assert f"cachetier {FINDER[kind]} tier" in lines[0]
    assert keys[0].hex()[:16] in lines[0]
    assert harness.count_corrupt(tier) == 2  # the second was counted, only not logged
    # Known now: lookups stop at them.
    assert tier.contains_prefix(namespace.id, keys) == 0
    assert tier.contains_prefix(namespace.id, keys[1:]) == 0
    assert tier.contains_prefix(namespace.id, keys[2:]) == 1


def test_the_next_line_says_how_many_were_not_logged(
    tmp_path: Path,
    redis_url: str,
    redis_prefix: str,
    namespace: Namespace,
    caplog: pytest.LogCaptureFixture,
) -> None:
    now = [0.0]
    config = RedisTierConfig(url=redis_url, key_prefix=redis_prefix)
    tier = RedisTier(config, clock=lambda: now[0])
    flip = redis_harness(tmp_path, redis_url, redis_prefix).corrupt
    assert flip is not None
    blocks = make_blocks(namespace, 4)
    tier.put_many(namespace.id, blocks)
    try:
        with caplog.at_level(logging.WARNING):
            for i, block in enumerate(blocks):
                flip(tier, namespace.id, block.key)
                if i == 3:
                    now[0] += CORRUPT_LOG_INTERVAL_S
                assert tier.get_many(namespace.id, [block.key]) == [None]
    finally:
        tier.close()
    lines = _corrupt_lines(caplog)
    assert len(lines) == 2, lines
    assert blocks[0].key.hex()[:16] in lines[0] and "more since" not in lines[0]
    assert blocks[3].key.hex()[:16] in lines[1]
    assert lines[1].endswith("2 more since the last such line")
    assert tier.stats()["corrupt"] == 4
