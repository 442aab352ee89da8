"""Why a miss missed: the fixed causes, and the memory-cheap shadow structures that tell them.

- ``MissCause`` and ``MISS_CAUSES``: the one cause each unserved block gets.
- ``MissLedger``: keys recently evicted, refused by admission, dropped by a full write queue or
  found corrupt, with the tier and the block's age.
- ``TokenIndex`` and ``token_keys``: the same tokens stored under another namespace
  (``NamespaceDescriptor`` names which part differs).
- ``MismatchAlarm``: one warning when namespace mismatches become a large share of misses.

The store and the engine feed and ask them; nothing here knows a tier or a store.
"""

from cachetier.misses.alarm import MismatchAlarm
from cachetier.misses.causes import LEDGER_CAUSES, MISS_CAUSES, MissCause
from cachetier.misses.descriptor import NamespaceDescriptor
from cachetier.misses.ledger import MissLedger, why_missed
from cachetier.misses.token_index import TokenIndex, token_keys

__all__ = [
    "LEDGER_CAUSES",
    "MISS_CAUSES",
    "MismatchAlarm",
    "MissCause",
    "MissLedger",
    "NamespaceDescriptor",
    "TokenIndex",
    "token_keys",
    "why_missed",
]
