"""Ghost tiers of one filtered tier: what each fixed policy would hit there, on recent traffic.

``TierSimulation`` replays the store's requests, as the adaptive policy records them, through
keys-only caches on a hashed sample of keys (``cachetier.admission.sample``): one LRU for the
cheap tiers above (they take every block, whatever the policy) and, per candidate policy
(``FIXED_POLICIES``), one LRU for the filtered tier fed as that policy would feed it, with its
own filter shrunk by the sampling rate. A request's hit is the leading run of its sampled keys
held by the cheap ghost or the candidate's, as a store's lookup counts it; then its keys go
into the cheap ghost, its sightings into each filter, and into each candidate's ghost those the
ghost holds (a use) or the filter admits.

Scores are hit counts decayed by ``DECAY`` every ``WINDOW_REFS`` sampled references, so they
follow recent traffic. The choice moves to the best candidate only when that one's decayed hit
ratio leads the current choice's by more than ``SWITCH_MARGIN`` (hysteresis: two candidates
about as good do not flap). Memory: at most ``admission_sample_keys`` keys over the cheap ghost
and one candidate's (the rate is chosen so), so at most three times that over all candidates,
plus the candidates' filters at ``rate * admission_tracked_keys`` keys (33 bytes a key for
both). Not thread-safe: the adaptive policy holds its lock.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

from cachetier.admission.config import FIXED_POLICIES, AdmissionConfig
from cachetier.admission.policy import FIXED_POLICY_CLASSES, AdmissionPolicy
from cachetier.admission.sample import GhostLRU, KeySample, sample_rate_for

WINDOW_REFS = 1024
"""Sampled references per scoring window."""
DECAY = 0.9
"""Weight of the past at each window's end: a window's hits count half after 6.6 windows."""
SWITCH_MARGIN = 0.003
"""Decayed hit ratio the best candidate must lead the current choice by to replace it."""
START_CHOICE = "all"
"""The choice before any evidence: a restarted pod's first sightings are still written."""
KEY_BYTES = 170
"""Bytes a ghost key takes: its ``OrderedDict`` entry and the key's bytes object."""


class TierSimulation:
    """The candidates' ghosts of one filtered tier, and the choice among them.

    Args:
        config: the admission settings (the filters' and the sample's sizes).
        cheap_blocks: blocks the cheap tiers above hold (0: none).
        tier_blocks: blocks the filtered tier holds.
    """

    def __init__(self, config: AdmissionConfig, cheap_blocks: int, tier_blocks: int) -> None:
        if cheap_blocks < 0 or tier_blocks < 1:
            raise ValueError(
                f"need cheap_blocks >= 0, tier_blocks >= 1: {cheap_blocks}, {tier_blocks}"
            )
        self.cheap_blocks, self.tier_blocks = cheap_blocks, tier_blocks
        self.sample = KeySample(
            sample_rate_for(config.admission_sample_keys, cheap_blocks + tier_blocks)
        )
        self._cheap = GhostLRU(self.sample.scaled(cheap_blocks)) if cheap_blocks else None
        self._ghosts = {n: GhostLRU(self.sample.scaled(tier_blocks)) for n in FIXED_POLICIES}
        tracked = self.sample.scaled(config.admission_tracked_keys)
        small = dataclasses.replace(config, admission_tracked_keys=tracked)
        self._filters: dict[str, AdmissionPolicy] = {
            n: FIXED_POLICY_CLASSES[n](small) for n in FIXED_POLICIES
        }
        self.choice = START_CHOICE
        self._hits = dict.fromkeys(FIXED_POLICIES, 0.0)  # decayed
        self._refs = 0.0
        self._window_hits = dict.fromkeys(FIXED_POLICIES, 0)
        self._window_refs = 0
        self.num_windows = 0

    @property
    def nbytes(self) -> int:
        """Bytes the ghosts may take at most and the filters take."""
        cheap = self._cheap.capacity if self._cheap is not None else 0
        ghosts = cheap + sum(g.capacity for g in self._ghosts.values())
        return ghosts * KEY_BYTES + sum(f.nbytes for f in self._filters.values())

    def num_keys(self) -> int:
        """Keys the ghosts hold now (bounded by their capacities)."""
        cheap = len(self._cheap) if self._cheap is not None else 0
        return cheap + sum(len(g) for g in self._ghosts.values())

    def hit_ratios(self) -> dict[str, float]:
        """Each candidate's decayed hit ratio on the sampled references (0.0 before any)."""
        return {n: (h / self._refs if self._refs else 0.0) for n, h in self._hits.items()}

    def request(self, keys: Sequence[bytes]) -> bool:
        """Replay one request's keys (all of them: the sample is taken here).

        Args:
            keys: the request's block keys, in prompt order.

        Returns:
            Whether a scoring window closed (the choice may have changed).
        """
        keeps = self.sample.keeps
        sampled = [key for key in keys if keeps(key)]
        if not sampled:
            return False
        self._lookup(sampled)
        cheap = self._cheap
        if cheap is not None:
            for key in sampled:
                cheap.put(key)
        for name, ghost in self._ghosts.items():
            filter_ = self._filters[name]
            for key in sampled:
                filter_._record(key)
            for key in sampled:
                if ghost.holds(key) or filter_._decide(key, None, "", 1):
                    ghost.put(key)
        self._window_refs += len(sampled)
        if self._window_refs < WINDOW_REFS:
            return False
        self._close_window()
        return True

    def _lookup(self, sampled: list[bytes]) -> None:
        cheap = self._cheap
        in_cheap = [cheap is not None and cheap.holds(key) for key in sampled]
        for name, ghost in self._ghosts.items():
            run = 0
            for key, held in zip(sampled, in_cheap):
                if not (held or ghost.holds(key)):
                    break
                run += 1
            self._window_hits[name] += run

    def _close_window(self) -> None:
        self._refs = self._refs * DECAY + self._window_refs
        for name in FIXED_POLICIES:
            self._hits[name] = self._hits[name] * DECAY + self._window_hits[name]
            self._window_hits[name] = 0
        self._window_refs = 0
        self.num_windows += 1
        ratios = self.hit_ratios()
        best = max(FIXED_POLICIES, key=lambda n: (ratios[n], n == self.choice))
        if ratios[best] - ratios[self.choice] > SWITCH_MARGIN:
            self.choice = best

    def snapshot(self) -> dict[str, Any]:
        """What a restart may take over: the capacities, the choice and the decayed scores."""
        return {
            "cheap_blocks": self.cheap_blocks,
            "tier_blocks": self.tier_blocks,
            "choice": self.choice,
            "refs": self._refs,
            "hits": dict(self._hits),
        }

    def restore(self, state: Mapping[str, Any]) -> bool:
        """Take over a ``snapshot`` (validated by ``cachetier.admission.state_file``) if it is
        of the same capacities; the ghosts start empty either way.

        Returns:
            Whether it was taken over.
        """
        if (state["cheap_blocks"], state["tier_blocks"]) != (self.cheap_blocks, self.tier_blocks):
            return False
        assert state["choice"] in FIXED_POLICIES, "validated when read"
        self.choice = state["choice"]
        self._refs = float(state["refs"])
        self._hits = {n: float(state["hits"][n]) for n in FIXED_POLICIES}
        assert all(math.isfinite(v) for v in (self._refs, *self._hits.values())), "validated"
        return True
