"""The restore guard: sampled restores are recomputed and compared with what the tier returned,
and a tier whose KV does not match is quarantined for that namespace.

``compare`` measures a restored block against its recomputation (tolerance per dtype),
``sampling`` draws which hits are verified, ``quarantine`` holds the namespaces a tier may no
longer serve. Engines and connectors drive them; the store honours the quarantines.
"""

from cachetier.guard.compare import REL_TOLERANCE, BlockMismatch, compare_blocks
from cachetier.guard.quarantine import Quarantine, QuarantineList
from cachetier.guard.sampling import GuardConfig, GuardSampler

__all__ = [
    "REL_TOLERANCE",
    "BlockMismatch",
    "GuardConfig",
    "GuardSampler",
    "Quarantine",
    "QuarantineList",
    "compare_blocks",
]
