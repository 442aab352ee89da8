"""From a tier to the fleet's prefix index: ``TierEvents`` and ``announce_snapshot`` on a real
publisher, a real subscriber, and ``PrefixIndex`` applying what arrives."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest

from cachetier.kvevents import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventPublisher,
    KVEventSubscriber,
    TierEvents,
)
from cachetier.kvindex import PrefixIndex
from cachetier.primitives.keys import KVLayout, Namespace, block_keys
from tests.cachetier.kvevents.streams import HeldClock, collect, wait_sent

MakePublisher = Callable[..., KVEventPublisher]
MakeSubscriber = Callable[..., KVEventSubscriber]

BLOCK_SIZE = 4
NS = Namespace("events-model", KVLayout("float32", BLOCK_SIZE, 2, 2, 8))
TOKENS = list(range(10 * BLOCK_SIZE))
KEYS = block_keys(NS, TOKENS)


def _apply_all(index: PrefixIndex, subscriber: KVEventSubscriber, num_events: int) -> None:
    got = collect(subscriber, lambda got: sum(len(d.batch.events) for d in got) >= num_events)
    for d in got:
        assert index.apply(d.replica, d.epoch, d.seq, d.batch.changes()), "no gap"


def test_a_restarted_tiers_snapshot_makes_its_blocks_routable(
    make_publisher: MakePublisher, make_subscriber: MakeSubscriber
) -> None:
    publisher = make_publisher("pod-a", max_batch_blocks=4)
    assert publisher.announce_snapshot("disk", iter(KEYS), block_size=BLOCK_SIZE) == len(KEYS)
    subscriber = make_subscriber(publisher)
    index = PrefixIndex()
    _apply_all(index, subscriber, num_events=3)  # 10 keys in events of at most 4
    (holding,) = index.holdings(KEYS, ["pod-a"])
    assert holding.media == ("disk",) * len(KEYS)


def test_snapshot_events_carry_keys_only(
    make_publisher: MakePublisher, make_subscriber: MakeSubscriber
) -> None:
    publisher = make_publisher(max_batch_blocks=4)
    publisher.announce_snapshot("disk", KEYS)
    subscriber = make_subscriber(publisher)
    got = collect(subscriber, lambda got: sum(len(d.batch.events) for d in got) >= 3)
    events = [e for d in got for e in d.batch.events]
    assert [len(e.block_hashes) for e in events] == [4, 4, 2]
    assert all(isinstance(e, BlockStored) for e in events)
    assert events[0] == BlockStored(tuple(KEYS[:4]), None, (), 0, "disk")


def test_a_tiers_stores_evictions_and_clears_reach_the_index(
    make_publisher: MakePublisher, make_subscriber: MakeSubscriber
) -> None:
    publisher = make_publisher("pod-b")
    subscriber = make_subscriber(publisher)
    events = TierEvents(publisher)
    tokens = np.array(TOKENS[: 6 * BLOCK_SIZE], dtype=np.int64)  # as the engine holds them
    assert events.stored("GPU", KEYS[:6], None, tokens, BLOCK_SIZE)
    assert events.stored("disk", KEYS[:8], block_size=BLOCK_SIZE)
    assert events.stored("disk", KEYS[8:], parent=KEYS[7])
    events.on_evicted("GPU")("ns", KEYS[4], None)
    assert events.removed("GPU", KEYS[5:6])
    assert events.cleared("cpu")
    index = PrefixIndex()
    _apply_all(index, subscriber, num_events=6)
    (holding,) = index.holdings(KEYS, ["pod-b"])
    assert holding.media == ("gpu",) * 4 + ("disk",) * 6


def test_the_events_say_what_the_tier_said(
    make_publisher: MakePublisher, make_subscriber: MakeSubscriber
) -> None:
    publisher = make_publisher()
    subscriber = make_subscriber(publisher)
    events = TierEvents(publisher)
    events.stored("GPU", KEYS[1:3], KEYS[0], TOKENS[BLOCK_SIZE : 3 * BLOCK_SIZE], BLOCK_SIZE)
    events.removed("redis", KEYS[:1])
    events.cleared("cpu")
    got = collect(subscriber, lambda got: sum(len(d.batch.events) for d in got) >= 3)
    assert [e for d in got for e in d.batch.events] == [
        BlockStored(
            tuple(KEYS[1:3]), KEYS[0], tuple(TOKENS[BLOCK_SIZE : 3 * BLOCK_SIZE]), 4, "GPU"
        ),
        BlockRemoved(tuple(KEYS[:1]), "redis"),
        AllBlocksCleared("cpu"),
    ]


def test_nothing_to_tell_publishes_nothing(make_publisher: MakePublisher) -> None:
    publisher = make_publisher(heartbeat_s=None)
    events = TierEvents(publisher)
    assert events.stored("disk", []) and events.removed("disk", [])
    assert publisher.stats().num_batches == 0


@pytest.mark.parametrize(
    "call,match",
    [
        (lambda e: e.stored("disk", [b"short"]), "32-byte"),
        (lambda e: e.stored("disk", ["a" * 32]), "32-byte"),
        (lambda e: e.stored("disk", KEYS[:1], parent=b"x"), "32-byte"),
        (lambda e: e.stored("disk", KEYS[:2], token_ids=[1, 2, 3], block_size=4), "token ids"),
        (lambda e: e.stored("disk", KEYS[:1], block_size=-1), "block_size"),
        (lambda e: e.removed("", KEYS[:1]), "medium"),
        (lambda e: e.cleared("disk\n"), "medium"),
        (lambda e: e.on_evicted("x" * 65), "medium"),
    ],
    ids=["short-key", "str-key", "parent", "tokens", "block-size", "empty", "newline", "long"],
)
def test_bad_calls_say_what_to_change(
    make_publisher: MakePublisher, call: Callable[[TierEvents], object], match: str
) -> None:
    publisher = make_publisher(heartbeat_s=None)
    with pytest.raises(ValueError, match=match):
        call(TierEvents(publisher))
    assert publisher.stats().num_events == 0


def test_a_snapshot_larger_than_the_queue_counts_what_it_queued(
    make_publisher: MakePublisher,
) -> None:
    clock = HeldClock()
    publisher = make_publisher(
        heartbeat_s=None, max_queue_batches=2, max_batch_blocks=4, clock=clock
    )
    clock.hold()
    publisher.publish([AllBlocksCleared("disk")])
    clock.wait_held()
    assert publisher.announce_snapshot("disk", KEYS) == 8  # two events of 4 fit, 2 keys did not
    assert publisher.stats().num_dropped_events == 1
    clock.release()
    wait_sent(publisher, 3)


def test_a_snapshot_of_a_bad_medium_or_key_is_refused(make_publisher: MakePublisher) -> None:
    publisher = make_publisher(heartbeat_s=None)
    with pytest.raises(ValueError, match="medium"):
        publisher.announce_snapshot("", KEYS)
    with pytest.raises(ValueError, match="32-byte"):
        publisher.announce_snapshot("disk", [*KEYS, b"short"])
