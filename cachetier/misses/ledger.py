"""``MissLedger``: what is remembered of keys let go, so that a later miss of one has a cause.

A tier evicts a block, admission refuses one, a full write queue drops one, a read finds one
corrupt: each notes the keys here, with the tier and (for an eviction) when the block was
stored. A lookup that misses such a key then says ``evicted`` by that tier after so long,
instead of ``never_stored``; a key stored again is forgotten, since its next miss would have
another cause.

Memory: the set-associative ``KeyTable`` (8-byte fingerprint and a 2-byte packed cause and
tier a key) plus a 4-byte time noted (seconds since the ledger began) and a 2-byte age at
eviction (minutes as a float16: to about 0.05 %, up to 45 days) a key, and one byte a set of
four: ``16 * n + n / 4`` bytes for ``n`` tracked keys, 16.25 MB at 1M. A dict of 32-byte
digests would take several times that. It is bounded: a full set replaces its oldest entry,
whose key then explains nothing (the caller falls back to ``never_stored``); it never explains
a key by another key's entry unless two keys of one set share all 64 fingerprint bits.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Iterable, Sequence

import numpy as np

from cachetier.misses.causes import LEDGER_CAUSES, MissCause
from cachetier.misses.table import SMALL_BATCH, KeyTable
from cachetier.primitives.keys import BlockHash

MAX_TIERS = 256
_MAX_NOTED_S = 0xFFFFFFFF
_MAX_AGE_MIN = float(np.finfo(np.float16).max)


class MissLedger:
    """A bounded memory of let-go keys and why; thread-safe (writers note from background
    threads while lookups explain).

    Args:
        tracked_keys: how many keys it remembers at most (rounded up to whole sets of four).
        clock: seconds now; ``stored_at`` passed to ``note`` is on the same clock (Unix time
            by default, as a disk record's mtime is).
    """

    def __init__(self, tracked_keys: int, *, clock: Callable[[], float] = time.time) -> None:
        self._table = KeyTable(tracked_keys)
        self._noted = np.zeros(self._table.num_slots, dtype=np.uint32)
        self._age = np.zeros(self._table.num_slots, dtype=np.float16)
        self._noted_view = memoryview(self._noted).cast("B").cast("I")
        self._tiers: list[str] = []
        self._tier_ids: dict[str, int] = {}
        self._clock = clock
        self._epoch = clock()
        self._lock = threading.Lock()

    @property
    def tracked_keys(self) -> int:
        """How many keys it can hold."""
        return self._table.num_slots

    @property
    def nbytes(self) -> int:
        """Bytes of its arrays (the formula of the module docstring)."""
        return self._table.nbytes + self._noted.nbytes + self._age.nbytes

    def __len__(self) -> int:
        """Keys remembered now (a scan: for tests and stats, not the serving path)."""
        with self._lock:
            return self._table.num_entries()

    def note(
        self,
        keys: Iterable[BlockHash],
        cause: str,
        tier: str,
        *,
        stored_at: float | Sequence[float] | None = None,
    ) -> None:
        """Remember that ``tier`` let ``keys`` go for ``cause``; a key noted before takes the
        new cause.

        Args:
            keys: the block keys (32-byte digests).
            cause: one of ``LEDGER_CAUSES``.
            tier: the tier's name.
            stored_at: when the blocks were stored in the tier, on the ledger's clock: one
                time for all, one a key, or ``None`` (their age is then unknown).
        """
        if cause not in LEDGER_CAUSES:
            raise ValueError(
                f"a ledger remembers only {LEDGER_CAUSES}, not {cause!r} (the other causes are "
                "seen at lookup time)"
            )
        keys = keys if isinstance(keys, (list, tuple)) else list(keys)
        with self._lock:
            now = self._clock()
            ages = _ages_min(stored_at, len(keys), now)
            tag = (LEDGER_CAUSES.index(cause) + 1) << 8 | self._tier_id(tier)
            noted = int(min(max(now - self._epoch, 0.0), _MAX_NOTED_S))
            if len(keys) <= SMALL_BATCH:
                places = [self._table.place(key) for key in keys]  # every key checked first
                for (row, fp), age in zip(places, ages):
                    slot = self._table.put(row, fp, tag, match_tag=False)
                    self._noted[slot] = noted
                    self._age[slot] = age
                return
            rows, fps = self._table.place_many(keys)
            tags = np.full(len(keys), tag, dtype=np.uint16)
            slots = self._table.put_many(rows, fps, tags, match_tag=False)
            self._noted[slots] = noted
            self._age[slots] = ages

    def explain(self, keys: Sequence[BlockHash]) -> list[MissCause | None]:
        """What is remembered of each key.

        Args:
            keys: block keys that missed.

        Returns:
            One entry a key: its cause, tier, age at eviction (``age_s``, where the note said
            when it was stored) and how long ago it was let go (``detail``); ``None`` where
            nothing is remembered.
        """
        with self._lock:
            now = self._clock() - self._epoch
            if len(keys) <= SMALL_BATCH:
                slots = [self._table.find(key) for key in keys]
                return [None if slot < 0 else self._entry(slot, now) for slot in slots]
            found = self._table.find_many(*self._table.place_many(keys))
            out: list[MissCause | None] = [None] * len(keys)
            hits = np.flatnonzero(found >= 0)
            slots = found[hits]
            fields = zip(
                hits.tolist(),
                self._table.tags[slots].tolist(),
                self._age[slots].tolist(),
                self._noted[slots].tolist(),
            )
            # Keys let go together share their entry's fields: one MissCause serves them all.
            made: dict[tuple[int, float, int], MissCause] = {}
            for i, tag, age_min, noted in fields:
                cause = made.get((tag, age_min, noted))
                if cause is None:
                    cause = made[tag, age_min, noted] = self._cause(tag, age_min, noted, now)
                out[i] = cause
            return out

    def forget(self, keys: Iterable[BlockHash]) -> int:
        """Drop what is remembered of ``keys``: they are stored again, so a later miss of one
        has another cause.

        Args:
            keys: block keys just stored.

        Returns:
            How many were remembered.
        """
        keys = keys if isinstance(keys, (list, tuple)) else list(keys)
        with self._lock:
            if len(keys) <= SMALL_BATCH:
                for key in keys:  # every key checked before any is forgotten
                    self._table.place(key)
                forgotten = 0
                for key in keys:
                    slot = self._table.find(key)
                    self._table.clear(slot)
                    forgotten += slot >= 0
                return forgotten
            found = self._table.find_many(*self._table.place_many(keys))
            self._table.clear(found)
            return int(np.count_nonzero(np.unique(found) >= 0))

    def _entry(self, slot: int, now: float) -> MissCause:
        return self._cause(
            self._table.tag(slot), float(self._age[slot]), self._noted_view[slot], now
        )

    def _cause(self, tag: int, age_min: float, noted: int, now: float) -> MissCause:
        return MissCause(
            LEDGER_CAUSES[(tag >> 8) - 1],
            self._tiers[tag & 0xFF],
            None if math.isnan(age_min) else age_min * 60.0,
            f"{max(now - noted, 0.0):.0f} s ago",
        )

    def _tier_id(self, tier: str) -> int:
        known = self._tier_ids.get(tier)
        if known is not None:
            return known
        if not isinstance(tier, str) or not tier:
            raise ValueError(f"tier must be a non-empty tier name, got {tier!r}")
        if len(self._tiers) >= MAX_TIERS:
            raise ValueError(f"a ledger tells at most {MAX_TIERS} tiers apart")
        self._tier_ids[tier] = len(self._tiers)
        self._tiers.append(tier)
        return self._tier_ids[tier]


def _ages_min(stored_at: float | Sequence[float] | None, count: int, now: float) -> list[float]:
    """Ages in minutes of ``count`` blocks stored at ``stored_at`` (NaN: unknown), clipped to
    what a float16 holds; plain floats, since most notes are of one key."""
    if stored_at is None:
        return [math.nan] * count
    if isinstance(stored_at, (int, float)) and not isinstance(stored_at, bool):
        if math.isnan(stored_at):
            raise ValueError("stored_at must not be NaN (pass None where it is unknown)")
        return [min(max((now - stored_at) / 60.0, 0.0), _MAX_AGE_MIN)] * count
    try:
        times = np.asarray(stored_at, dtype=np.float64)
    except (TypeError, ValueError):
        raise TypeError("stored_at must be a time, one time a key, or None") from None
    if times.shape != (count,):
        raise ValueError(f"stored_at has {times.size} times for {count} keys")
    if np.isnan(times).any():
        raise ValueError("stored_at must not hold NaN (pass None where it is unknown)")
    return np.clip((now - times) / 60.0, 0.0, _MAX_AGE_MIN).tolist()


def why_missed(
    ledger: MissLedger, key: BlockHash, quarantined: str | None, down: Sequence[str]
) -> MissCause:
    """The cause of a lookup's first unserved key: what the lookup itself saw first (a
    quarantined tier holding it, a tier whose lookup failed), then what ``ledger`` remembers
    of the key, else ``never_stored`` (a namespace mismatch is told by the caller, which knows
    the tokens: ``TokenIndex``).

    Args:
        ledger: the store's ledger.
        key: the key.
        quarantined: a quarantined tier that holds it, if any.
        down: tiers whose lookup just failed.
    """
    if quarantined is not None:
        return MissCause("quarantined", quarantined)
    if down:
        return MissCause("tier_down", down[0])
    (known,) = ledger.explain([key])
    return known if known is not None else MissCause("never_stored")
