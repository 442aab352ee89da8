"""``MismatchAlarm``: one warning when a large share of misses is a namespace mismatch.

After a rolling upgrade (a new model build, another dtype or block size, a new record format)
or a tenant misconfiguration, engines sharing a cache stop reusing each other's blocks and
nothing fails: the hit rate just falls. The alarm watches the share of recently missed blocks
that ``TokenIndex`` found held under another namespace and, once the share of one (asked,
held) pair passes a threshold, logs once, on logger ``cachetier.misses``, which parts differ,
then stays quiet for that pair.
"""

from __future__ import annotations

import logging
import threading

from cachetier.misses.descriptor import NamespaceDescriptor
from cachetier.util.checks import fraction, positive_int

log = logging.getLogger("cachetier.misses")

_Pair = tuple[NamespaceDescriptor, NamespaceDescriptor]


class MismatchAlarm:
    """Counts missed and mismatched blocks per lookup, and warns once per descriptor pair;
    thread-safe.

    The counts halve every ``min_lookups`` lookups, so the share is that of recent lookups: a
    long healthy past does not hide an upgrade that begins now.

    Args:
        threshold: the share of missed blocks (in ``[0, 1)``) above which a pair warns.
        min_lookups: lookups seen before any warning (a first cold lookup proves nothing);
            also how often the counts halve.
    """

    def __init__(self, threshold: float, min_lookups: int) -> None:
        self.threshold = fraction("threshold", threshold)
        self.min_lookups = positive_int("min_lookups", min_lookups)
        self._num_lookups = 0
        self._missed = 0.0
        self._mismatched: dict[_Pair, float] = {}
        self._warned: set[_Pair] = set()
        self._lock = threading.Lock()

    @property
    def warned(self) -> frozenset[_Pair]:
        """The (asked, held) pairs warned about."""
        with self._lock:
            return frozenset(self._warned)

    def observe(
        self,
        num_missed: int,
        num_mismatched: int,
        asked: NamespaceDescriptor | None = None,
        held: NamespaceDescriptor | None = None,
    ) -> bool:
        """Count one lookup, and warn if its pair's share of misses has just passed the
        threshold.

        Args:
            num_missed: blocks of the lookup not served (every cause).
            num_mismatched: of those, blocks of cause ``namespace_mismatch``.
            asked: the descriptor of the namespace that looked up (needed when
                ``num_mismatched`` > 0).
            held: the descriptor the mismatched blocks are held under.

        Returns:
            Whether this call logged the warning.
        """
        _check_counts(num_missed, num_mismatched)
        pair = None
        if num_mismatched:
            if not isinstance(asked, NamespaceDescriptor) or not isinstance(
                held, NamespaceDescriptor
            ):
                raise TypeError("a lookup with mismatched blocks needs asked and held descriptors")
            pair = (asked, held)
        with self._lock:
            self._num_lookups += 1
            self._missed += num_missed
            if pair is not None:
                self._mismatched[pair] = self._mismatched.get(pair, 0.0) + num_mismatched
            share = self._share(pair)
            if self._num_lookups % self.min_lookups == 0:
                self._halve()
            if share is None or share <= self.threshold:
                return False
            self._warned.add(pair)
        log.warning(
            "namespace mismatch: %.0f%% of recently missed blocks are held under another "
            "namespace (%s). Engines sharing this cache disagree on these, as after a rolling "
            "upgrade; blocks stored under the other settings are not reused until both "
            "agree.%s This is logged once for this pair.",
            100 * share,
            asked.describe_difference(held),
            _tenant_hint(asked, held),
        )
        return True

    def _share(self, pair: _Pair | None) -> float | None:
        # None: nothing to warn about (too few lookups, no pair, or warned already).
        if pair is None or pair in self._warned or self._num_lookups < self.min_lookups:
            return None
        return self._mismatched[pair] / self._missed if self._missed else None

    def _halve(self) -> None:
        self._missed /= 2
        for pair in list(self._mismatched):
            self._mismatched[pair] /= 2
            if self._mismatched[pair] < 0.5 and pair not in self._warned:
                del self._mismatched[pair]  # keeps the table to the pairs seen lately


def _check_counts(num_missed: int, num_mismatched: int) -> None:
    for name, value in (("num_missed", num_missed), ("num_mismatched", num_mismatched)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{name} must be an int >= 0, got {value!r}")
    if num_mismatched > num_missed:
        raise ValueError(
            f"num_mismatched ({num_mismatched}) cannot exceed num_missed ({num_missed})"
        )


def _tenant_hint(asked: NamespaceDescriptor, held: NamespaceDescriptor) -> str:
    if asked.differs_from(held) == ["tenant"]:
        return (
            " Only the tenant differs: tenants never share blocks by design, so this is "
            "expected unless these engines were meant to share one tenant."
        )
    return ""
