"""What the store remembers of keys it let go: refused by admission, dropped by a full write
queue, evicted; so that a later miss of such a key has its cause instead of ``never_stored``.

Memory-cheap by design, since it tracks keys the tiers no longer hold: a set-associative table
of 8-byte key fingerprints (``WAYS`` to a set, replaced in turn) beside one packed 32-bit word
each (cause, tier, minutes since the ledger began). That is 12 bytes a key plus one byte a set
(12.25 MB at a million keys), against a few hundred bytes a key for a dict of digests. A
collision can only drop an older entry, never explain a key by another's entry, except when
two keys share all 64 fingerprint bits.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from cachetier.primitives.keys import BlockHash

WAYS = 4
CAUSES = ("evicted", "not_admitted", "write_dropped", "corrupt")
"""The causes a ledger can remember (the others are seen at lookup time)."""
MAX_TIERS = 15


@dataclass(frozen=True, slots=True)
class Remembered:
    """Why a key was let go, by which tier, and how long ago (in whole minutes)."""

    cause: str
    tier: str
    age_s: float


class MissLedger:
    """A bounded memory of let-go keys; thread-safe.

    Args:
        tracked_keys: how many keys it remembers at most (rounded up to whole sets).
    """

    def __init__(self, tracked_keys: int = 1 << 20) -> None:
        if tracked_keys <= 0:
            raise ValueError(f"tracked_keys must be positive, got {tracked_keys}")
        self._sets = -(-tracked_keys // WAYS)
        self._fps = np.zeros((self._sets, WAYS), dtype=np.uint64)
        self._info = np.zeros((self._sets, WAYS), dtype=np.uint32)
        self._hand = np.zeros(self._sets, dtype=np.uint8)
        self._tiers: list[str] = []
        self._start = time.monotonic()
        self._lock = threading.Lock()

    @property
    def nbytes(self) -> int:
        """Bytes of its tables."""
        return self._fps.nbytes + self._info.nbytes + self._hand.nbytes

    def note(self, keys: Iterable[BlockHash], cause: str, tier: str) -> None:
        """Remember that ``keys`` were let go by ``tier`` for ``cause`` (``CAUSES``)."""
        code = CAUSES.index(cause)
        with self._lock:
            word = (code << 28) | (self._tier_code(tier) << 24) | self._minutes()
            for key in keys:
                row, fp = self._place(key)
                ways = self._fps[row]
                hit = np.flatnonzero(ways == fp)
                way = int(hit[0]) if hit.size else int(self._hand[row])
                if not hit.size:
                    self._hand[row] = (way + 1) % WAYS
                ways[way] = fp
                self._info[row, way] = word

    def forget(self, keys: Iterable[BlockHash]) -> None:
        """Keys stored again: no longer a cause to give."""
        with self._lock:
            for key in keys:
                row, fp = self._place(key)
                self._fps[row][self._fps[row] == fp] = 0

    def explain(self, keys: Sequence[BlockHash]) -> list[Remembered | None]:
        """What is remembered of each key (``None``: nothing)."""
        out: list[Remembered | None] = []
        with self._lock:
            now = self._minutes()
            for key in keys:
                row, fp = self._place(key)
                ways = self._fps[row].tolist()  # four Python ints: cheaper than numpy's compare
                if int(fp) not in ways:
                    out.append(None)
                    continue
                word = int(self._info[row, ways.index(int(fp))])
                cause, tier = CAUSES[word >> 28], self._tiers[(word >> 24) & 0xF]
                out.append(Remembered(cause, tier, 60.0 * (now - (word & 0xFFFFFF))))
        return out

    def _place(self, key: BlockHash) -> tuple[int, np.uint64]:
        # A key is a cryptographic digest: its bytes are uniform, so two slices of it serve as
        # the set index and the fingerprint (0 marks an empty way, so it is never one).
        fp = int.from_bytes(bytes(key[:8]), "little") | 1
        row = int.from_bytes(bytes(key[8:16]), "little") % self._sets
        return row, np.uint64(fp)

    def _tier_code(self, tier: str) -> int:
        if tier not in self._tiers:
            if len(self._tiers) >= MAX_TIERS:
                raise ValueError(f"a ledger tells at most {MAX_TIERS} tiers apart")
            self._tiers.append(tier)
        return self._tiers.index(tier)

    def _minutes(self) -> int:
        return min(int((time.monotonic() - self._start) // 60), 0xFFFFFF)


def why_missed(
    ledger: MissLedger, key: BlockHash, quarantined: str | None, down: Sequence[str]
) -> tuple[str, str]:
    """The cause of a lookup's first unserved key and its tier: ``quarantined`` or
    ``tier_down`` first (what the lookup itself saw), then what the ledger remembers of the
    key (evicted, refused, dropped, corrupt), else ``never_stored``.

    Args:
        ledger: the store's ledger.
        key: the key.
        quarantined: a quarantined tier that holds it, if any.
        down: tiers whose lookup just failed.
    """
    if quarantined is not None:
        return "quarantined", quarantined
    if down:
        return "tier_down", down[0]
    (known,) = ledger.explain([key])
    return (known.cause, known.tier) if known is not None else ("never_stored", "")
