"""What a publisher says it holds: ``HeldKeys`` digests, ``KeyTokens`` chains, and
``TierEvents`` keeping both whether or not its events go out."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from cachetier.kvevents import BlockRemoved, BlockStored, KVEvent, TierEvents
from cachetier.kvevents.held import HeldKeys, key_digest
from cachetier.kvevents.tokens import KeyTokens
from cachetier.primitives.keys import KVLayout, Namespace, block_keys

NS = Namespace("held-model", KVLayout("float32", 4, 2, 2, 8))
TOKENS = list(range(40))
KEYS = block_keys(NS, TOKENS)


class ListSink:
    """Keeps what is published; ``accept`` False drops it, as a full publisher queue does."""

    def __init__(self, accept: bool = True) -> None:
        self.accept = accept
        self.events: list[KVEvent] = []

    def publish(self, events: Sequence[KVEvent]) -> bool:
        if self.accept:
            self.events.extend(events)
        return self.accept


def test_digests_follow_adds_and_removes_as_a_fresh_computation_would() -> None:
    held = HeldKeys()
    held.add("disk", KEYS[:6])
    held.add("disk", KEYS[2:4])  # held already: not counted twice
    held.remove("disk", [KEYS[0], KEYS[9]])  # KEYS[9] was never held
    assert held.digests() == {"disk": key_digest(KEYS[1:6])}
    assert sorted(held.keys("disk")) == sorted(KEYS[1:6])
    assert len(held.keys("disk", limit=2)) == 2
    held.clear("disk")
    assert held.digests() == {} and held.keys("disk") == []


def test_a_dropped_event_is_still_in_what_the_publisher_says_it_holds() -> None:
    """So an index that missed it sees a digest that differs from its own."""
    events = TierEvents(ListSink(accept=False))
    assert not events.stored("disk", KEYS[:3])
    assert events.held.digests() == {"disk": key_digest(KEYS[:3])}
    assert not events.removed("disk", KEYS[:1])
    assert events.held.digests() == {"disk": key_digest(KEYS[1:3])}
    events.cleared("disk")
    assert events.held.digests() == {}


def test_tier_events_of_noted_keys_carry_parent_and_tokens() -> None:
    sink = ListSink()
    events = TierEvents(sink)
    for i, key in enumerate(KEYS):
        events.tokens.note(key, KEYS[i - 1] if i else None, TOKENS[4 * i : 4 * i + 4])
    events.stored_keys("disk", KEYS[3:6], block_size=4)
    assert sink.events == [BlockStored(tuple(KEYS[3:6]), KEYS[2], tuple(TOKENS[12:24]), 4, "disk")]


def test_keys_of_several_chains_go_out_as_one_event_per_chain() -> None:
    tokens = KeyTokens()
    for i, key in enumerate(KEYS):
        tokens.note(key, KEYS[i - 1] if i else None, TOKENS[4 * i : 4 * i + 4])
    runs = tokens.runs([KEYS[0], KEYS[1], KEYS[5], KEYS[6]], block_size=4)
    assert [(keys, parent) for keys, parent, _ in runs] == [
        ([KEYS[0], KEYS[1]], None),
        ([KEYS[5], KEYS[6]], KEYS[4]),
    ]
    assert runs[1][2] == tuple(TOKENS[20:28])


def test_keys_without_notes_go_out_without_tokens() -> None:
    sink = ListSink()
    events = TierEvents(sink, tokens=KeyTokens(max_keys=2))
    for i, key in enumerate(KEYS[:4]):  # the first two notes are pushed out by the bound
        events.tokens.note(key, KEYS[i - 1] if i else None, TOKENS[4 * i : 4 * i + 4])
    events.stored_keys("cpu", KEYS[:4], block_size=4)
    assert sink.events == [
        BlockStored(tuple(KEYS[:2]), None, (), 4, "cpu"),
        BlockStored(tuple(KEYS[2:4]), KEYS[1], tuple(TOKENS[8:16]), 4, "cpu"),
    ]
    events.removed("cpu", KEYS[:1])
    assert sink.events[-1] == BlockRemoved((KEYS[0],), "cpu")


def test_a_snapshot_is_announced_in_chunks_and_held() -> None:
    sink = ListSink()
    events = TierEvents(sink)
    assert events.snapshot("disk", iter(KEYS), chunk=4) == len(KEYS)
    assert [len(e.block_hashes) for e in sink.events] == [4, 4, 2]  # type: ignore[union-attr]
    assert events.held.digests() == {"disk": key_digest(KEYS)}


def test_bounds_are_checked() -> None:
    with pytest.raises(ValueError, match="max_keys"):
        KeyTokens(max_keys=0)
    with pytest.raises(ValueError, match="medium"):
        TierEvents(ListSink()).snapshot("", KEYS)
