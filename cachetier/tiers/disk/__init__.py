"""The local disk tier: one checksummed record file per block, shared by every process of a node.

``tier`` is the tier, ``config`` its settings, ``view`` the opened folder (its files, budget
and index, opened together and kept in step), ``folder`` the room made and spent in it
(eviction across processes, commits, removals), ``files`` the record files' names and atomic
writes, ``budget`` the byte ledger every process shares under ``flock``, ``index`` the recency
order rebuilt from the folder, ``reads`` the vectored reads into a caller's buffer, ``spares``
evicted files kept for reuse by the next put.
"""

from cachetier.tiers.disk.config import DiskTierConfig
from cachetier.tiers.disk.tier import DiskTier

__all__ = ["DiskTier", "DiskTierConfig"]
