"""cachetier: persistent KV-cache tiers (CPU, disk, Redis, sidecar) for LLM inference.

The core stores bytes and tensors under block keys; it imports nothing of ``engine``,
``connectors`` or ``kernels``.
"""

from cachetier.errors import CacheTierError, CapacityError, CorruptBlockError, TierUnavailableError
from cachetier.primitives.keys import (
    BlockHash,
    KVLayout,
    Namespace,
    block_keys,
    hash_block,
    num_leading_hits,
)
from cachetier.record import Compression, KVBlock, decode_record, encode_record
from cachetier.store.config import StoreConfig, build_store
from cachetier.store.tiered import TieredStore
from cachetier.tiers.base import Tier
from cachetier.tiers.cpu import CPUTier, CPUTierConfig
from cachetier.tiers.disk.tier import DiskTier, DiskTierConfig
from cachetier.tiers.prefix import PrefixHit, RestoredPrefix

__all__ = [
    "BlockHash",
    "CPUTier",
    "CPUTierConfig",
    "CacheTierError",
    "CapacityError",
    "Compression",
    "CorruptBlockError",
    "DiskTier",
    "DiskTierConfig",
    "KVBlock",
    "KVLayout",
    "Namespace",
    "PrefixHit",
    "RestoredPrefix",
    "StoreConfig",
    "Tier",
    "TierUnavailableError",
    "TieredStore",
    "block_keys",
    "build_store",
    "decode_record",
    "encode_record",
    "hash_block",
    "num_leading_hits",
]
