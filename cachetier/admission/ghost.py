"""A ghost queue: the last ``capacity`` distinct block keys seen, oldest forgotten first.

The admission filter of S3-FIFO (Yang et al., SOSP 2023) turned into a write filter: a key is
worth writing once it is seen again while the queue still remembers it. Unlike a frequency
sketch it is exact (no key is taken for another, up to a 62-bit fingerprint) and forgets by
arrival order rather than by halving, so its window is exactly ``capacity`` distinct keys.

What it holds is bounded in bytes, not only in keys: fingerprints (8 bytes) in a ring that keeps
their arrival order, and a linear-probing hash table of ``next_pow2(2 * capacity)`` slots of 8
bytes for lookups (at most half full, so probes stay short). About 24 bytes per key
(``nbytes``), against well over 100 for a Python dict or set of ``bytes`` keys. A slot holds
the fingerprint with its lowest bit set once the key has been seen again. Not thread-safe:
``cachetier.admission.policy`` holds a lock.
"""

from __future__ import annotations

from array import array

from cachetier.admission.sketch import MAX_TRACKED_KEYS, key_words, next_pow2
from cachetier.util.checks import positive_int

_SEEN_AGAIN = 1
_OCCUPIED = 2  # set in every fingerprint, so an empty slot (0) is never one


class GhostQueue:
    """The last ``capacity`` distinct keys, each with whether it was seen more than once.

    Args:
        capacity: distinct keys remembered; the oldest is forgotten past it.
    """

    def __init__(self, capacity: int) -> None:
        positive_int("capacity", capacity)
        if capacity > MAX_TRACKED_KEYS:
            raise ValueError(f"capacity must be <= {MAX_TRACKED_KEYS:,}, got {capacity:,}")
        self.capacity = capacity
        self._ring = array("Q", bytes(8 * capacity))  # fingerprints, oldest at _head when full
        self._head = 0
        self._size = 0
        slots = next_pow2(2 * capacity)
        self._table = array("Q", bytes(8 * slots))
        self._mask = slots - 1

    @property
    def nbytes(self) -> int:
        """Bytes the ring and the table take (fixed at construction)."""
        return self._ring.itemsize * len(self._ring) + self._table.itemsize * len(self._table)

    def __len__(self) -> int:
        return self._size

    def record(self, key: bytes) -> None:
        """Note a sighting of ``key``: remember it (forgetting the oldest key when full), or
        mark it seen again.

        Args:
            key: the block key.
        """
        fp = _fingerprint(key)
        slot = self._find(fp)
        if slot is not None:
            self._table[slot] |= _SEEN_AGAIN
            return
        if self._size == self.capacity:
            self._forget(self._ring[self._head])
        else:
            self._size += 1
        self._ring[self._head] = fp
        self._head = (self._head + 1) % self.capacity
        self._insert(fp)

    def sightings(self, key: bytes) -> int:
        """How often ``key`` was seen while remembered: 0, 1, or 2 for twice or more.

        Args:
            key: the block key.

        Returns:
            0, 1 or 2.
        """
        slot = self._find(_fingerprint(key))
        if slot is None:
            return 0
        return 2 if self._table[slot] & _SEEN_AGAIN else 1

    def _home(self, fp: int) -> int:
        return (fp >> 2) & self._mask

    def _find(self, fp: int) -> int | None:
        table, mask = self._table, self._mask
        slot = self._home(fp)
        while True:
            held = table[slot]
            if not held:
                return None
            if held & ~_SEEN_AGAIN == fp:
                return slot
            slot = (slot + 1) & mask

    def _insert(self, fp: int) -> None:
        table, mask = self._table, self._mask
        slot = self._home(fp)
        while table[slot]:
            slot = (slot + 1) & mask
        table[slot] = fp

    def _forget(self, fp: int) -> None:
        """Delete ``fp`` from the table, shifting back the entries whose probe ran over it
        (no tombstones: the table never fills with dead slots)."""
        table, mask = self._table, self._mask
        hole = self._find(fp)
        assert hole is not None, "every fingerprint of the ring is in the table"
        slot = hole
        while True:
            slot = (slot + 1) & mask
            held = table[slot]
            if not held:
                break
            home = self._home(held)
            # The entry stays where it is if its home lies cyclically in (hole, slot].
            if (hole < home <= slot) if hole <= slot else (home > hole or home <= slot):
                continue
            table[hole] = held
            hole = slot
        table[hole] = 0


def _fingerprint(key: bytes) -> int:
    """62 bits of the key with the occupied bit set and the seen-again bit clear."""
    word, _ = key_words(key)
    return (word & ~3) | _OCCUPIED
