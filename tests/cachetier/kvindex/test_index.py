"""The prefix index: a replica's leading run by its fastest medium, shared tiers read by all,
epochs that fence a dead process, gaps reported, digests that agree with a publisher's, and
replicas forgotten when silent."""

from __future__ import annotations

import pytest

from cachetier.kvindex import SHARED, PrefixIndex, key_digest
from cachetier.primitives.keys import KVLayout, Namespace, block_keys

NS = Namespace("fleet-model", KVLayout("float32", 16, 2, 2, 8))
KEYS = block_keys(NS, list(range(16 * 8)))


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_the_fastest_medium_of_each_block_wins_and_the_run_stops_at_a_gap() -> None:
    index = PrefixIndex()
    index.apply("a", 1, 0, [("stored", "disk", KEYS[:6]), ("stored", "GPU", KEYS[:2])])
    index.apply("b", 1, 0, [("stored", "cpu", KEYS[:1] + KEYS[2:5])])
    a, b, c = index.holdings(KEYS, ["a", "b", "c"])
    assert a.media == ("gpu", "gpu", "disk", "disk", "disk", "disk")
    assert a.spans() == [("gpu", 2), ("disk", 4)] and a.pool_blocks() == 2
    assert b.media == ("cpu",)  # block 1 missing: the run ends there
    assert c.media == ()


def test_shared_tiers_extend_every_replicas_run() -> None:
    index = PrefixIndex()
    index.apply(SHARED, 7, 0, [("stored", "sidecar", KEYS[:5])])
    index.apply("a", 1, 0, [("stored", "gpu", KEYS[:2])])
    a, b = index.holdings(KEYS, ["a", "b"])
    assert a.media == ("gpu", "gpu", "sidecar", "sidecar", "sidecar")
    assert b.media == ("sidecar",) * 5


def test_removed_and_cleared_events_take_blocks_away() -> None:
    index = PrefixIndex()
    index.apply("a", 1, 0, [("stored", "disk", KEYS), ("stored", "cpu", KEYS[:3])])
    index.apply("a", 1, 1, [("removed", "disk", KEYS[1:2]), ("cleared", "cpu", [])])
    (a,) = index.holdings(KEYS, ["a"])
    assert a.media == ("disk",)
    with pytest.raises(ValueError, match="unknown event kind"):
        index.apply("a", 1, 2, [("moved", "disk", KEYS)])


def test_a_new_epoch_replaces_a_restarted_replicas_holdings_and_an_old_one_is_fenced() -> None:
    index = PrefixIndex()
    index.apply("a", 1, 0, [("stored", "gpu", KEYS)])
    index.apply("a", 2, 0, [("stored", "disk", KEYS[:3])])  # restarted: its pool is gone
    index.apply("a", 1, 1, [("stored", "gpu", KEYS)])  # a late batch of the dead process
    (a,) = index.holdings(KEYS, ["a"])
    assert a.media == ("disk",) * 3
    assert index.num_stale_events == 1


def test_a_sequence_gap_is_reported_and_the_batch_still_applied() -> None:
    index = PrefixIndex()
    assert index.apply("a", 1, 0, [("stored", "disk", KEYS[:1])])
    assert not index.apply("a", 1, 3, [("stored", "disk", KEYS[1:2])])
    assert index.apply("a", 1, 1, [])  # a replayed batch is in order
    assert index.num_gaps == 1
    assert index.holdings(KEYS, ["a"])[0].num_blocks == 2


def test_digests_agree_with_the_publishers_and_a_resync_repairs_a_lost_event() -> None:
    index = PrefixIndex()
    index.apply("a", 1, 0, [("stored", "disk", KEYS[:4])])
    held = KEYS[:6]  # the publisher stored two more; that event was lost
    assert index.digest("a", "disk") != key_digest(held)
    index.resync("a", 1, "disk", held)
    assert index.digest("a", "disk") == key_digest(held) == (6, index.digest("a", "disk")[1])
    assert index.holdings(KEYS, ["a"])[0].num_blocks == 6


def test_silent_replicas_are_forgotten_and_a_touch_keeps_one() -> None:
    clock = Clock()
    index = PrefixIndex(forget_after_s=10, clock=clock)
    index.apply("a", 1, 0, [("stored", "gpu", KEYS)])
    index.apply("b", 1, 0, [("stored", "gpu", KEYS)])
    clock.now = 8
    index.touch("b")
    clock.now = 12
    assert index.expire() == ["a"]
    assert index.replicas == ["b"]
    with pytest.raises(ValueError):
        PrefixIndex(forget_after_s=0)


def test_shared_media_are_held_for_every_replica_and_outlive_a_restart() -> None:
    index = PrefixIndex()
    keys = [bytes([i]) * 32 for i in range(4)]
    assert index.apply("a", 1, 0, [("stored", "redis", keys[:2]), ("stored", "disk", keys[2:])])
    assert index.holdings(keys[:2], ["b"])[0].media == ("redis", "redis")
    index.apply("a", 2, 0, [])  # a's restart: its own disk is forgotten, Redis is not
    (held,) = index.holdings(keys, ["a"])
    assert held.media == ("redis", "redis")
    assert index.digests("a") == {} and index.epoch("a") == 2
    assert index.digests(SHARED) == {"redis": key_digest(keys[:2])}
