"""Owned quarantines (a sidecar's tenants' reports): all tiers or none, a quota per owner, and
no owner's entries counted against another's places or ``max_entries``."""

from __future__ import annotations

import pytest

from cachetier.errors import QuarantineLimitError, QuarantineQuotaError
from cachetier.guard import QuarantineList

TIERS = ("cpu", "disk")


def test_a_report_is_taken_in_every_tier_and_counted_once_against_its_owner() -> None:
    held = QuarantineList()
    added = held.add_everywhere(TIERS, "t.alice.m", "K", "", "alice", quota=2)
    assert {q.tier for q in added} == set(TIERS) and held.tiers_of("t.alice.m") == set(TIERS)
    assert held.num_owned("alice") == 1
    assert held.add_everywhere(TIERS, "t.alice.m", "again", "", "alice", quota=2) == []
    assert held.num_owned("alice") == 1


def test_an_owner_past_its_quota_adds_nothing_and_leaves_the_others_their_places() -> None:
    held = QuarantineList(max_entries=1)  # bounds the unowned only
    held.add_everywhere(TIERS, "t.alice.a", "K", "", "alice", quota=2)
    held.add_everywhere(TIERS, "t.alice.b", "K", "", "alice", quota=2)
    with pytest.raises(QuarantineQuotaError, match="quota 2"):
        held.add_everywhere(TIERS, "t.alice.c", "K", "", "alice", quota=2)
    assert held.tiers_of("t.alice.c") == frozenset()  # in no tier, not in some
    assert len(held.add_everywhere(TIERS, "t.bob.a", "K", "", "bob", quota=2)) == 2
    assert held.add("disk", "guard-ns", "K")  # the unowned have max_entries of their own
    with pytest.raises(QuarantineLimitError):
        held.add("disk", "guard-ns-2", "K")


def test_a_lift_in_every_tier_gives_the_owner_its_place_back() -> None:
    held = QuarantineList()
    held.add_everywhere(TIERS, "t.alice.a", "K", "", "alice", quota=1)
    held.lift("t.alice.a", tier="cpu")
    assert held.num_owned("alice") == 1  # still quarantined in disk: still a place
    with pytest.raises(QuarantineQuotaError):
        held.add_everywhere(TIERS, "t.alice.b", "K", "", "alice", quota=1)
    held.lift("t.alice.a")
    assert held.num_owned("alice") == 0
    assert len(held.add_everywhere(TIERS, "t.alice.b", "K", "w", "alice", quota=1)) == 2
