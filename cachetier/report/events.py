"""The lookup event log: one JSON line per prefix lookup, written by a running engine or server
and read back by ``cachetier report``.

Counters (``cachetier.tiers.stats``) say how much the cache helped in total; the event log says when
and for whom, which is what plots over time and per tenant need. Writing is an append of one
short line under a lock, so the serving path pays microseconds; a log that cannot be written
is disabled with one warning rather than failing requests.
"""

from __future__ import annotations

import json
import logging
import math
import os
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from cachetier.misses.causes import MISS_CAUSES

log = logging.getLogger(__name__)

SOURCES = ("pool", "cpu", "disk", "redis", "remote")
"""Where hit tokens can come from: the engine's own pool, then the tiers in lookup order."""

# Why prompt tokens were not served from cache, one cause each (docs/operations.md, "Why a miss
# missed"); the one list lives with the miss structures.
__all__ = ["MISS_CAUSES", "SOURCES", "EventLog", "LookupEvent", "read_events"]


@dataclass(frozen=True, slots=True)
class LookupEvent:
    """One prefix lookup.

    Args:
        time_s: when it happened (Unix seconds).
        tenant: the tenant / cache salt it was made under ("" for none).
        num_tokens: prompt tokens asked for.
        hit_tokens: tokens served from cache, by source (``SOURCES``); absent sources are 0.
        block_size: tokens per block of the cache that answered.
        num_alignment_lost_tokens: tokens that matched but sit in a partial last block, which a
            cache of whole blocks cannot reuse (a prompt whose every full block hit counts its
            partial tail here).
        restore_s: seconds spent restoring the hit from tiers (0 for pool hits).
        origin: who logged it (``engine``, ``server``).
        recomputed_tokens: tokens the tiers held that were recomputed by choice, because the
            cost model estimated recomputing them faster than loading them.
        est_saved_s: seconds the cost model estimated the hit saved (against recomputing it
            all); 0 where no estimate was made.
        verified_tokens: tokens the tiers held that the restore guard drew for verification:
            computed instead of loaded, then compared with the tier's records.
        miss_tokens: tokens not served, by cause (``MISS_CAUSES``); absent causes are 0.
    """

    time_s: float
    tenant: str
    num_tokens: int
    hit_tokens: Mapping[str, int] = field(default_factory=dict)
    block_size: int = 16
    num_alignment_lost_tokens: int = 0
    restore_s: float = 0.0
    origin: str = "engine"
    recomputed_tokens: int = 0
    est_saved_s: float = 0.0
    verified_tokens: int = 0
    miss_tokens: Mapping[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        # A NaN or infinite time (JSON allows NaN) would wreck every plot over time, and a
        # negative restore time would inflate the seconds a report says were saved.
        if not math.isfinite(self.time_s):
            raise ValueError(f"time_s must be a finite number of seconds, got {self.time_s}")
        if not (math.isfinite(self.restore_s) and self.restore_s >= 0):
            raise ValueError(f"restore_s must be a finite number >= 0, got {self.restore_s}")
        if not (math.isfinite(self.est_saved_s) and self.est_saved_s >= 0):
            raise ValueError(f"est_saved_s must be a finite number >= 0, got {self.est_saved_s}")
        if self.recomputed_tokens < 0 or self.recomputed_tokens > self.num_tokens:
            raise ValueError(
                f"recomputed_tokens must be in [0, num_tokens], got {self.recomputed_tokens}"
            )
        if self.verified_tokens < 0 or self.verified_tokens > self.num_tokens:
            raise ValueError(
                f"verified_tokens must be in [0, num_tokens], got {self.verified_tokens}"
            )
        _check_misses(self.miss_tokens, self.num_tokens)
        if self.num_alignment_lost_tokens < 0:
            raise ValueError(
                f"num_alignment_lost_tokens must be >= 0, got {self.num_alignment_lost_tokens}"
            )
        if self.num_tokens < 0 or self.block_size <= 0:
            raise ValueError(
                f"num_tokens must be >= 0 and block_size > 0, got {self.num_tokens}, "
                f"{self.block_size}"
            )
        unknown = set(self.hit_tokens) - set(SOURCES)
        if unknown:
            raise ValueError(f"unknown hit sources {sorted(unknown)}; known: {SOURCES}")
        if any(v < 0 for v in self.hit_tokens.values()):
            raise ValueError("hit token counts must be >= 0")
        if self.num_hit_tokens > self.num_tokens:
            raise ValueError(
                f"{self.num_hit_tokens} hit tokens is more than the {self.num_tokens} asked for"
            )

    @property
    def num_hit_tokens(self) -> int:
        """Tokens served from any source."""
        return sum(self.hit_tokens.values())

    def to_json(self) -> str:
        """The event as one line of JSON (no newline)."""
        return json.dumps(
            {
                "time_s": round(self.time_s, 6),
                "tenant": self.tenant,
                "num_tokens": self.num_tokens,
                "hit_tokens": {k: v for k, v in self.hit_tokens.items() if v},
                "block_size": self.block_size,
                "num_alignment_lost_tokens": self.num_alignment_lost_tokens,
                "restore_s": round(self.restore_s, 6),
                "origin": self.origin,
                # Only where a cost model spoke: logs without one stay as they were.
                **({"recomputed_tokens": self.recomputed_tokens} if self.recomputed_tokens else {}),
                **({"est_saved_s": round(self.est_saved_s, 6)} if self.est_saved_s else {}),
                **({"verified_tokens": self.verified_tokens} if self.verified_tokens else {}),
                **({"miss_tokens": misses} if (misses := _nonzero(self.miss_tokens)) else {}),
            },
            separators=(",", ":"),
        )

    @classmethod
    def from_json(cls, line: str) -> LookupEvent:
        """Parse one line written by ``to_json``.

        Raises:
            ValueError: not JSON, a missing or mistyped field, or an invalid value.
        """
        try:
            raw = json.loads(line)
            return cls(
                time_s=float(raw["time_s"]),
                tenant=str(raw["tenant"]),
                num_tokens=int(raw["num_tokens"]),
                hit_tokens={str(k): int(v) for k, v in dict(raw.get("hit_tokens", {})).items()},
                block_size=int(raw.get("block_size", 16)),
                num_alignment_lost_tokens=int(raw.get("num_alignment_lost_tokens", 0)),
                restore_s=float(raw.get("restore_s", 0.0)),
                origin=str(raw.get("origin", "engine")),
                recomputed_tokens=int(raw.get("recomputed_tokens", 0)),
                est_saved_s=float(raw.get("est_saved_s", 0.0)),
                verified_tokens=int(raw.get("verified_tokens", 0)),
                miss_tokens={str(k): int(v) for k, v in dict(raw.get("miss_tokens", {})).items()},
            )
        except (KeyError, TypeError, AttributeError, json.JSONDecodeError) as exc:
            raise ValueError(f"not a lookup event: {exc}") from exc


def _nonzero(counts: Mapping[str, int]) -> dict[str, int]:
    return {k: v for k, v in counts.items() if v}


def _check_misses(misses: Mapping[str, int], num_tokens: int) -> None:
    unknown = set(misses) - set(MISS_CAUSES)
    if unknown:
        raise ValueError(f"unknown miss causes {sorted(unknown)}; known: {MISS_CAUSES}")
    if any(v < 0 for v in misses.values()) or sum(misses.values()) > num_tokens:
        raise ValueError(f"miss token counts must be >= 0 and at most {num_tokens} in all")


class EventLog:
    """Appends ``LookupEvent`` lines to a file, from any thread.

    Args:
        path: the JSON-lines file (created, with its folder, if missing; appended to if not).
        max_bytes: once the file is this large, further events are dropped (counted in
            ``num_dropped``) so a forgotten log cannot fill the disk; ``None`` for no limit.
    """

    def __init__(self, path: str | Path, *, max_bytes: int | None = 256 << 20) -> None:
        if max_bytes is not None and max_bytes <= 0:
            raise ValueError(f"max_bytes must be positive or None, got {max_bytes}")
        self.path = Path(path)
        self.max_bytes = max_bytes
        self.num_written = 0
        self.num_dropped = 0
        self._lock = threading.Lock()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file: IO[str] | None = open(self.path, "a", encoding="utf-8")  # noqa: SIM115
        self._size = self._file.tell()

    def record(self, event: LookupEvent) -> None:
        """Append one event (never raises for I/O: a failing log is disabled, with a warning)."""
        line = event.to_json() + "\n"
        with self._lock:
            if self._file is None:
                return
            if self.max_bytes is not None and self._size + len(line) > self.max_bytes:
                self.num_dropped += 1
                return
            try:
                self._file.write(line)
                self._file.flush()
            except OSError as exc:
                log.warning("event log %s disabled: %s", self.path, exc)
                self._close_locked()
                return
            self._size += len(line)
            self.num_written += 1

    def close(self) -> None:
        """Flush and close (idempotent); later ``record`` calls do nothing."""
        with self._lock:
            self._close_locked()

    def _close_locked(self) -> None:
        if self._file is not None:
            try:
                self._file.close()
            except OSError:
                pass
            self._file = None

    def __enter__(self) -> EventLog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def read_events(
    path: str | Path, *, strict: bool = False, allow_torn_tail: bool = False
) -> Iterator[LookupEvent]:
    """The events of a log, in file order.

    Args:
        path: a file written by ``EventLog``.
        strict: raise on a bad line instead of skipping it.
        allow_torn_tail: even with ``strict``, skip (with a warning) a bad last line that has
            no newline: ``EventLog`` writes whole lines, so that is a write a crash cut short.

    Raises:
        OSError: the file cannot be read.
        ValueError: with ``strict``, a line that is not an event (the message names the line).
    """
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                yield LookupEvent.from_json(line)
            except ValueError as exc:
                torn = allow_torn_tail and not line.endswith("\n")  # only a last line can be
                if strict and not torn:
                    raise ValueError(f"{os.fspath(path)}:{number}: {exc}") from exc
                log.warning("%s:%d skipped: %s", path, number, exc)
