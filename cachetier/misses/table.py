"""The set-associative table of 64-bit key fingerprints under ``MissLedger`` and ``TokenIndex``.

Both remember far more keys than a Python dict of digests could hold cheaply (a dict entry of a
32-byte ``bytes`` key costs well over a hundred bytes), so each keeps flat numpy arrays:

- ``fps``: uint64, the first 8 bytes of each key (a sha256 digest: its bytes are uniform);
- ``tags``: uint16 per entry, chosen by the owner (a packed cause and tier, a descriptor id);
  0 marks an empty way, so a fingerprint needs no bit of its own for that;
- ``hand``: uint8 per set, the next way to replace.

A key's set is bytes 8..16 of it modulo the number of sets; its ``WAYS`` ways are searched by a
full 64-bit fingerprint compare, so a key is taken for another only when two keys of one set
share all 64 bits (at most ``WAYS`` x 2^-64 a lookup). A full set replaces its ways in turn
(FIFO by the hand); a way emptied by ``clear`` is filled before any live entry is replaced.

Two paths give the same answers: a per-key one over memoryviews for the few keys a lookup or
an eviction brings (a numpy call costs more than such a key does), and a vectorised one for
batches. The table is not locked: its owners lock around it and their own arrays.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from cachetier.primitives.keys import HASH_BYTES, BlockHash
from cachetier.util.checks import positive_int

WAYS = 4
SMALL_BATCH = 8
"""Batches up to this many keys take the per-key path."""
_FIELD = np.dtype("<u8")


class KeyTable:
    """Fingerprints and tags of up to ``tracked_keys`` keys (rounded up to whole sets).

    Args:
        tracked_keys: how many keys it holds at most.
    """

    def __init__(self, tracked_keys: int) -> None:
        positive_int("tracked_keys", tracked_keys)
        self.num_sets = -(-tracked_keys // WAYS)
        self.num_slots = self.num_sets * WAYS
        self.fps = np.zeros(self.num_slots, dtype=np.uint64)
        self.tags = np.zeros(self.num_slots, dtype=np.uint16)
        self.hand = np.zeros(self.num_sets, dtype=np.uint8)
        # Views that index to Python ints in tens of nanoseconds (numpy scalars cost more).
        self._fp_view = memoryview(self.fps).cast("B").cast("Q")
        self._tag_view = memoryview(self.tags).cast("B").cast("H")

    @property
    def nbytes(self) -> int:
        """Bytes of its arrays: ``WAYS * (8 + 2) + 1`` a set."""
        return self.fps.nbytes + self.tags.nbytes + self.hand.nbytes

    def place(self, key: BlockHash) -> tuple[int, int]:
        """A key's set and fingerprint, as Python ints."""
        if len(key) != HASH_BYTES:
            raise ValueError(f"a block key is {HASH_BYTES} bytes, got {len(key)}")
        return int.from_bytes(key[8:16], "little") % self.num_sets, int.from_bytes(
            key[:8], "little"
        )

    def place_many(self, keys: Sequence[BlockHash]) -> tuple[np.ndarray, np.ndarray]:
        """The sets and fingerprints of ``keys``, as uint64 arrays."""
        if any(len(key) != HASH_BYTES for key in keys):
            bad = next(len(key) for key in keys if len(key) != HASH_BYTES)
            raise ValueError(f"a block key is {HASH_BYTES} bytes, got one of {bad}")
        words = np.frombuffer(b"".join(keys), dtype=_FIELD).reshape(-1, 4)
        fps = words[:, 0].astype(np.uint64, copy=False)
        return words[:, 1] % np.uint64(self.num_sets), fps

    def find(self, key: BlockHash, exclude_tag: int = 0) -> int:
        """The slot of a live entry of ``key``'s fingerprint in its set whose tag is not
        ``exclude_tag``, or -1. The per-key path: most lookups miss, and leave at ``not in``."""
        if len(key) != HASH_BYTES:
            raise ValueError(f"a block key is {HASH_BYTES} bytes, got {len(key)}")
        base = int.from_bytes(key[8:16], "little") % self.num_sets * WAYS
        fp = int.from_bytes(key[:8], "little")
        ways = self._fp_view[base : base + WAYS].tolist()
        if fp not in ways:
            return -1
        tags = self._tag_view
        for slot in range(base, base + WAYS):
            if ways[slot - base] == fp and tags[slot] and tags[slot] != exclude_tag:
                return slot
        return -1

    def tag(self, slot: int) -> int:
        """The tag of a slot, as a Python int."""
        return self._tag_view[slot]

    def find_many(self, rows: np.ndarray, fps: np.ndarray, exclude_tag: int = 0) -> np.ndarray:
        """``find`` for keys placed by ``place_many``: an int64 array of slots, -1 where none."""
        slots = rows.astype(np.int64)[:, None] * WAYS + np.arange(WAYS)  # [n, WAYS]
        tags = self.tags[slots]
        match = (self.fps[slots] == fps[:, None]) & (tags != 0) & (tags != exclude_tag)
        return np.where(match.any(axis=1), slots[np.arange(len(slots)), match.argmax(axis=1)], -1)

    def put(self, row: int, fp: int, tag: int, match_tag: bool) -> int:
        """Write an entry and return its slot: over the entry of the same fingerprint (and,
        with ``match_tag``, the same tag) if there is one, else into an empty way, else over
        the way the set's hand points at (the hand then moves on)."""
        assert tag, "tag 0 marks an empty way"
        base = row * WAYS
        fps, tags = self._fp_view, self._tag_view
        empty = -1
        for slot in range(base, base + WAYS):
            if not tags[slot]:
                if empty < 0:
                    empty = slot
            elif fps[slot] == fp and (not match_tag or tags[slot] == tag):
                tags[slot] = tag
                return slot
        if empty < 0:
            way = int(self.hand[row])
            self.hand[row] = (way + 1) % WAYS
            empty = base + way
        fps[empty] = fp
        tags[empty] = tag
        return empty

    def put_many(self, rows: np.ndarray, fps: np.ndarray, tags: np.ndarray, match_tag: bool):
        """``put`` for each key in order: an int64 array of slots. Keys are taken in rounds of
        one key a set, so two keys of one set in a batch are written as ``put`` would."""
        slots = np.empty(len(rows), dtype=np.int64)
        pending = np.arange(len(rows))
        while pending.size:
            _, first = np.unique(rows[pending], return_index=True)
            now = pending[first]
            slots[now] = self._put_round(rows[now], fps[now], tags[now], match_tag)
            pending = np.delete(pending, first)
        return slots

    def _put_round(
        self, rows: np.ndarray, fps: np.ndarray, tags: np.ndarray, match_tag: bool
    ) -> np.ndarray:
        base = rows.astype(np.int64) * WAYS
        ways = base[:, None] + np.arange(WAYS)  # [n, WAYS]
        held = self.tags[ways]
        match = (held != 0) & (self.fps[ways] == fps[:, None])
        if match_tag:
            match &= held == tags[:, None]
        empty = held == 0
        has_match, has_empty = match.any(axis=1), empty.any(axis=1)
        hand = self.hand[rows].astype(np.int64)
        way = np.where(has_match, match.argmax(axis=1), np.where(has_empty, empty.argmax(1), hand))
        full = ~has_match & ~has_empty
        self.hand[rows[full]] = (hand[full] + 1) % WAYS
        slots = base + way
        self.fps[slots] = fps
        self.tags[slots] = tags
        return slots

    def clear(self, slots: np.ndarray | int) -> None:
        """Empty the given slots (-1 entries are skipped)."""
        if isinstance(slots, int):
            if slots >= 0:
                self._tag_view[slots] = 0
                self._fp_view[slots] = 0
            return
        slots = slots[slots >= 0]
        self.tags[slots] = 0
        self.fps[slots] = 0

    def num_entries(self) -> int:
        """Live entries (a scan of the table: for tests and stats, not the serving path)."""
        return int(np.count_nonzero(self.tags))
