"""The fleet's prefix index: which replica holds which blocks of a prompt, and where.

- ``PrefixIndex``: holdings per replica and medium, from the publishers' KV events, with
  epochs, gap detection, digests to reconcile against and forgetting of silent replicas.
"""

from cachetier.kvindex.index import SHARED, Holding, PrefixIndex, key_digest

__all__ = ["SHARED", "Holding", "PrefixIndex", "key_digest"]
