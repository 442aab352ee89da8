"""A spatially hashed sample of block keys, and a cache simulated on it.

SHARDS (Waldspurger et al., FAST 2015): keep a key iff ``hash(key) mod P < T``. Every reference
to a kept key is kept, so a cache of ``capacity * T / P`` keys fed only the kept references
holds about the same share of them as the full cache holds of all references, and its hit
ratio estimates the full cache's. Block keys are sha256 digests, already uniform: the hash is
three of the key's bytes (13 to 15), bits that neither the ghost queue's table nor the
frequency sketch's counters index by, so a sample does not crowd either into a corner.

Keys that carry a large share of all references (a system prompt's blocks, in every request)
are in the sample or not as a whole, which moves the estimate by their whole share; the
references the sample lacks against the expected ``rate * total`` are counted as hits
(SHARDS's adjustment: such keys hit at any capacity), which ``adjusted_ratio`` does.
"""

from __future__ import annotations

from collections import OrderedDict

from cachetier.admission.sketch import MIN_KEY_BYTES
from cachetier.util.checks import positive_int

SAMPLE_MODULUS = 1 << 24
"""``P``: the hash is 24 bits of the key, so rates go down to about one key in 16 million."""


class KeySample:
    """Which keys a sample of rate ``rate`` keeps (the same ones in every process).

    Args:
        rate: the share of keys kept, in (0, 1]; rounded to a multiple of ``1 / P``.
    """

    def __init__(self, rate: float) -> None:
        if not 0 < rate <= 1:
            raise ValueError(f"a sampling rate is in (0, 1], got {rate!r}")
        self.threshold = max(1, round(rate * SAMPLE_MODULUS))
        self.rate = self.threshold / SAMPLE_MODULUS

    def keeps(self, key: bytes) -> bool:
        """Whether ``key`` is in the sample.

        Args:
            key: a block key (a digest of at least 16 bytes).

        Returns:
            True for about ``rate`` of all keys.
        """
        if len(key) < MIN_KEY_BYTES:
            raise ValueError(f"a block key is a digest of >= {MIN_KEY_BYTES} bytes, got {len(key)}")
        return int.from_bytes(key[13:16], "little") < self.threshold

    def scaled(self, capacity: int) -> int:
        """A capacity of the full stream as a capacity of the sample (at least 1)."""
        return max(1, round(capacity * self.rate))


def sample_rate_for(budget_keys: int, capacity: int) -> float:
    """The rate at which a cache of ``capacity`` keys shrinks to ``budget_keys``.

    Args:
        budget_keys: the most keys the sampled cache may hold.
        capacity: the full cache's keys.

    Returns:
        ``min(1, budget_keys / capacity)``.
    """
    positive_int("budget_keys", budget_keys)
    return min(1.0, budget_keys / max(capacity, 1))


def adjusted_ratio(hits: float, sampled_refs: float, total_refs: int, rate: float) -> float:
    """A sampled hit count as a hit ratio of the full stream (SHARDS's adjustment).

    Args:
        hits: hits among the sampled references.
        sampled_refs: references the sample kept.
        total_refs: references of the full stream.
        rate: the sample's rate.

    Returns:
        ``(hits + expected - sampled_refs) / expected`` with ``expected = rate * total_refs``,
        clipped to [0, 1]; 0.0 for an empty stream.
    """
    expected = rate * total_refs
    if expected <= 0:
        return 0.0
    return min(1.0, max(0.0, (hits + expected - sampled_refs) / expected))


class GhostLRU:
    """An LRU cache of keys only: what a tier of ``capacity`` blocks would hold.

    Holds at most ``capacity`` keys (an ``OrderedDict`` entry, about 100 bytes with the key's
    fingerprint). One key access at a time: ``holds`` to look up, ``put`` to store or refresh.
    Not thread-safe.

    Args:
        capacity: keys held at most.
    """

    def __init__(self, capacity: int) -> None:
        positive_int("capacity", capacity)
        self.capacity = capacity
        self._keys: OrderedDict[bytes, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._keys)

    def holds(self, key: bytes) -> bool:
        """Whether the cache holds ``key`` (a lookup: it does not refresh it)."""
        return key in self._keys

    def put(self, key: bytes) -> bool:
        """Store ``key``, or refresh it if held, evicting the least recent key past capacity.

        Returns:
            True if the key was new (a write).
        """
        keys = self._keys
        if key in keys:
            keys.move_to_end(key)
            return False
        keys[key] = None
        if len(keys) > self.capacity:
            keys.popitem(last=False)
        return True
