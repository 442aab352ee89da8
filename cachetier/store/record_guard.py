"""What of a restore may be used: every restored record is checked before its KV is, by writer
and by its own tokens.

``RecordGuard.admit`` takes the records a restore read (a leading run of one sequence's) and
keeps the leading ones that pass, in this order:

1. **Quarantined writers.** A record whose writer is quarantined in the tier it came from (or
   whose whole namespace is) ends the run, and that writer's records in the run are deleted
   from the tiers they came from, so the recomputed blocks take their keys.
2. **Its own tokens.** The first layer's K and V of a few of each record's tokens are recomputed
   from the token ids (``cachetier.guard.record_check``). A record that fails ends the run and
   is deleted from its tier; its writer is quarantined in the namespace in every tier (a read
   promotes records into faster tiers, so its records may be in any). Records of writers that
   verified clean keep serving.
3. **New writers.** The first restores of each writer in each tier and namespace are verified
   in full (``GuardSampler.should_verify_writer``): the run ends at that writer's first record,
   the caller computes the rest and compares it with the tier's records
   (``TieredStore.verify``), which quarantines the writer if they differ. This process's own
   records are exempt: they are what it computed, and the namespace's own draws sample them.

A record that keeps its first layer right and changes only deeper ones passes 1 and 2; a new
writer's is caught by 3, an already trusted writer's only by the namespace's sampled draws.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from cachetier.guard import BlockMismatch, GuardSampler
from cachetier.record import KVBlock, writer_name
from cachetier.store.tiered import TieredStore
from cachetier.store.verify import quarantine_writer

if TYPE_CHECKING:
    from cachetier.guard.record_check import Layer0, RecordCheck

log = logging.getLogger(__name__)

CAUSES = ("quarantined_writer", "record_check", "new_writer")


@dataclass(frozen=True, slots=True)
class Admitted:
    """The part of a restore that may be used.

    Args:
        count: the leading records that passed.
        cause: why the run ended before its end (one of ``CAUSES``), ``None`` if it did not.
        mismatch: what the record check found (cause ``record_check``).
    """

    count: int
    cause: str | None = None
    mismatch: BlockMismatch | None = None

    @property
    def verify(self) -> bool:
        """Whether the records past ``count`` are to be computed and compared (a new writer)."""
        return self.cause == "new_writer"


@dataclass(slots=True)
class RecordGuardStats:
    checked_records: int = 0
    failed_records: int = 0
    quarantined_writer_records: int = 0
    new_writer_verifications: int = 0
    check_s: float = 0.0  # time spent in the per-record check
    by_cause: dict[str, int] = field(default_factory=dict)

    def as_dict(self) -> dict[str, object]:
        return {
            "checked_records": self.checked_records,
            "failed_records": self.failed_records,
            "quarantined_writer_records": self.quarantined_writer_records,
            "new_writer_verifications": self.new_writer_verifications,
            "check_s": round(self.check_s, 6),
        }


class RecordGuard:
    """Admits restored records; thread-safe.

    Args:
        store: the tiers the records came from (its quarantines, and deletes).
        check: the per-record check of the first layer; ``None`` for none (a model it cannot
            follow).
        sampler: the guard's draws (new writers); ``None`` for none.
        label: what the namespace's writers claim to be (``Namespace.describe``), for the log.
    """

    def __init__(
        self,
        store: TieredStore,
        check: RecordCheck | None,
        sampler: GuardSampler | None,
        label: str = "",
    ) -> None:
        self.store = store
        self.check = check
        self.sampler = sampler if sampler is not None and sampler.config.enabled else None
        self.label = label
        self.stats = RecordGuardStats()
        self._lock = threading.Lock()

    def admit(
        self,
        namespace: str,
        records: Sequence[KVBlock],
        tiers: Sequence[str],
        token_ids: Sequence[int] | None,
        first_position: int,
        layer0: Layer0 | None = None,
    ) -> Admitted:
        """The leading ``records`` that may be used (see the module's three steps).

        Args:
            namespace: their storage namespace.
            records: a leading run of one sequence's records, in order.
            tiers: the tier each came from.
            token_ids: their tokens, in order (``None``: the record check is skipped).
            first_position: the position of the first record's first token.
            layer0: the records' first layer gathered at once, where the caller can
                (``RecordCheck.first_failure``).
        """
        # Writer names only where a writer quarantine or a writer draw can use them: most
        # restores pay for neither.
        named = self.store.quarantines.has_writers or self.sampler is not None
        writers = [writer_name(r.writer) for r in records] if named else []
        n = self._unquarantined(namespace, records, tiers, writers)
        cause = "quarantined_writer" if n < len(records) else None
        mismatch = None
        if self.check is not None and token_ids is not None and n:
            start = time.perf_counter()
            failure = self.check.first_failure(records[:n], token_ids, first_position, layer0)
            with self._lock:
                self.stats.check_s += time.perf_counter() - start
                self.stats.checked_records += n if failure is None else failure.index + 1
            if failure is not None:
                n, cause, mismatch = failure.index, "record_check", failure.mismatch
                record = records[n]
                self._refuse(namespace, record, tiers[n], writer_name(record.writer), mismatch)
        drawn = self._new_writer(namespace, tiers[:n], writers[:n])
        if drawn is not None:
            n, cause = drawn, "new_writer"
        if cause is not None:
            with self._lock:
                self.stats.by_cause[cause] = self.stats.by_cause.get(cause, 0) + 1
                if cause == "new_writer":
                    self.stats.new_writer_verifications += 1
        return Admitted(n, cause, mismatch)

    def _unquarantined(
        self,
        namespace: str,
        records: Sequence[KVBlock],
        tiers: Sequence[str],
        writers: Sequence[str],
    ) -> int:
        """The leading records whose writer is not quarantined in their tier; the quarantined
        writers' records of the run are deleted. (A whole namespace's quarantine holds its
        records back at lookup already.)"""
        held = self.store.quarantines
        if not held.has_writers:
            return len(records)
        cut = next(
            (
                i
                for i, (t, w) in enumerate(zip(tiers, writers))
                if held.holds_writer(t, namespace, w)
            ),
            len(records),
        )
        gone = 0
        for r, t, w in zip(records[cut:], tiers[cut:], writers[cut:]):
            if held.holds_writer(t, namespace, w):
                self.store.delete_in(t, namespace, [r.key])
                gone += 1
        if gone:
            with self._lock:
                self.stats.quarantined_writer_records += gone
        return cut

    def _refuse(
        self, namespace: str, record: KVBlock, tier: str, writer: str, mismatch: BlockMismatch
    ) -> None:
        """A record that failed its check: its writer quarantined in its tier, it deleted."""
        with self._lock:
            self.stats.failed_records += 1
        reason = mismatch.describe()
        quarantine_writer(self.store.quarantines, self.store.tier_names, namespace, writer, reason)
        self.store.delete_in(tier, namespace, [record.key])
        log.warning(
            "cachetier guard: a record restored from tier %s is not the KV of its tokens in "
            "namespace %s%s (%s); it was not used, it is deleted, and the records of writer %s "
            "are quarantined in every tier. Lift with `cachetier quarantine lift`.",
            tier,
            namespace[:16],
            f" [{self.label}]" if self.label else "",
            mismatch.describe(),
            writer,
        )

    def _new_writer(
        self, namespace: str, tiers: Sequence[str], writers: Sequence[str]
    ) -> int | None:
        """The first record of a writer this restore must verify in full, if any."""
        if self.sampler is None:
            return None
        own = writer_name(None)
        seen: set[tuple[str, str]] = set()
        for i, pair in enumerate(zip(tiers, writers)):
            if pair[1] == own or pair in seen:
                continue
            seen.add(pair)
            if self.sampler.should_verify_writer(pair[0], namespace, pair[1]):
                return i
        return None
