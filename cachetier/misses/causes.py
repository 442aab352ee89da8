"""The fixed list of reasons a looked-up block was not served, and the value that carries one.

Every unserved block of a lookup gets exactly one cause from ``MISS_CAUSES`` (docs/operations.md,
"Why a miss missed"), so counters, the lookup event log and the report sum to the misses:

- ``never_stored``: no tier ever held it, as far as anything remembers (the fallback);
- ``evicted``: a tier held it and let it go for room (which tier, the block's age then);
- ``not_admitted``: the tier's admission policy refused to write it;
- ``write_dropped``: a full write queue dropped it before it reached the tier;
- ``namespace_mismatch``: the same tokens are held under another model, layout, format or
  tenant (``detail`` says which part differs);
- ``corrupt``: a tier held a record that failed its checks and was refused;
- ``too_slow``: the cost model chose to recompute it rather than load it;
- ``tier_down``: the tier that would answer failed during the lookup;
- ``partial_block``: the prompt's tail is shorter than a block, which is never stored;
- ``quarantined``: the restore guard quarantined the tier for this namespace.
"""

from __future__ import annotations

from dataclasses import dataclass

MISS_CAUSES = (
    "never_stored",
    "evicted",
    "not_admitted",
    "write_dropped",
    "namespace_mismatch",
    "corrupt",
    "too_slow",
    "tier_down",
    "partial_block",
    "quarantined",
)
"""Every cause, in the order counters and reports list them."""

LEDGER_CAUSES = ("evicted", "not_admitted", "write_dropped", "corrupt")
"""The causes decided when a key is let go, which ``MissLedger`` remembers; the others are
seen by the lookup itself (a tier down, a quarantine, the cost model) or by ``TokenIndex``."""


@dataclass(frozen=True, slots=True)
class MissCause:
    """Why one block was not served.

    Args:
        cause: one of ``MISS_CAUSES``.
        tier: the tier the cause concerns ("" where none does, e.g. ``never_stored``).
        age_s: for ``evicted``, how long the block had been stored when it was let go
            (seconds); ``None`` where unknown or not meaningful.
        detail: a short human note for logs (how long ago it was let go, which part of the
            namespace differs).
    """

    cause: str
    tier: str = ""
    age_s: float | None = None
    detail: str = ""

    def __post_init__(self) -> None:
        if self.cause not in MISS_CAUSES:
            raise ValueError(f"cause {self.cause!r} is not one of {MISS_CAUSES}")
        if not isinstance(self.tier, str):
            raise TypeError(f"tier must be a tier name (str), got {type(self.tier).__name__}")
        if self.age_s is not None and not self.age_s >= 0:
            raise ValueError(f"age_s must be >= 0 seconds or None, got {self.age_s}")

    def in_words(self) -> str:
        """The detail for logs and answers; an eviction's says how old the block was then."""
        if self.age_s is None:
            return self.detail
        return f"evicted {self.age_s:.0f} s after it was stored or last read, {self.detail}"
