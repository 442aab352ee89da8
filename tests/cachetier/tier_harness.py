"""How the shared tier suite builds, restarts and corrupts each kind of tier.

Adding a tier to the suite means adding one ``TierHarness`` here (the server's remote tier
adds its own from ``tests/server``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import redis

from cachetier.keys import BlockHash
from cachetier.store import TieredStore
from cachetier.tiers.base import Tier
from cachetier.tiers.cpu import CPUTier, CPUTierConfig
from cachetier.tiers.disk import DiskTier, DiskTierConfig


@dataclass
class TierHarness:
    """Args:
    make: build a tier with the given byte capacity (the same storage on every call).
    corrupt: flip one stored byte of (namespace, key), or ``None`` if the tier keeps
        nothing outside this process's memory.
    overhead_bytes: bytes a stored block costs beyond its payload (record header).
    """

    make: Callable[[int], Tier]
    corrupt: Callable[[Tier, str, BlockHash], None] | None
    overhead_bytes: int = 0
    opened: list[Tier] = field(default_factory=list)

    def open(self, capacity_bytes: int) -> Tier:
        tier = self.make(capacity_bytes)
        self.opened.append(tier)
        return tier

    def close_all(self) -> None:
        for tier in self.opened:
            tier.close()


def _flip_file(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def cpu_harness(tmp: Path) -> TierHarness:
    return TierHarness(
        make=lambda cap: CPUTier(CPUTierConfig(cap)),
        corrupt=None,
    )


RECORD_OVERHEAD = 4 + 2 + 4 + 4 + 32 + 32 + 4 + 16 + 5 * 8 + 8  # header of a 5-dim block


def disk_harness(tmp: Path) -> TierHarness:
    root = tmp / "disk"

    def corrupt(tier: Tier, ns: str, key: BlockHash) -> None:
        assert isinstance(tier, DiskTier)
        _flip_file(tier.path_of(ns, key))

    return TierHarness(
        make=lambda cap: DiskTier(DiskTierConfig(str(root), cap, fsync=False)),
        corrupt=corrupt,
        overhead_bytes=RECORD_OVERHEAD,
    )


def redis_harness(tmp: Path, url: str, prefix: str) -> TierHarness:
    from cachetier.tiers.redis import RedisTier, RedisTierConfig

    def corrupt(tier: Tier, ns: str, key: BlockHash) -> None:
        client = redis.Redis.from_url(url)
        name = f"{prefix}:{ns}:{key.hex()}"
        value = bytearray(client.get(name) or b"")
        assert value, f"{name} is not in Redis"
        value[len(value) // 2] ^= 0xFF
        client.set(name, bytes(value))
        client.close()

    return TierHarness(
        make=lambda cap: RedisTier(RedisTierConfig(url=url, key_prefix=prefix, capacity_bytes=cap)),
        corrupt=corrupt,
        overhead_bytes=RECORD_OVERHEAD,
    )


def tiered_harness(tmp: Path) -> TierHarness:
    disk = disk_harness(tmp)

    def make(cap: int) -> Tier:
        # A CPU tier as large as the whole capacity in front of the disk tier: what the suite
        # sees is the disk's capacity and persistence with the CPU tier's speed.
        return TieredStore([CPUTier(CPUTierConfig(cap)), disk.make(cap)])

    def corrupt(tier: Tier, ns: str, key: BlockHash) -> None:
        assert isinstance(tier, TieredStore)
        tier.flush()
        tier.tiers[0].delete(ns, [key])  # so the read reaches the corrupted disk copy
        assert disk.corrupt is not None
        disk.corrupt(tier.tiers[1], ns, key)

    return TierHarness(make=make, corrupt=corrupt)


_TRAITS = {
    # kind: (persistent, exact_lru, corruptible)
    "cpu": (False, True, False),
    "disk": (True, True, True),
    "redis": (True, True, True),
    "tiered": (True, False, True),
}


def kinds(
    *, persistent: bool = False, exact_lru: bool = False, corruptible: bool = False
) -> list[str]:
    """The tier kinds that have every trait asked for (all kinds when none is asked)."""
    return [
        kind
        for kind, (p, lru, c) in _TRAITS.items()
        if (p or not persistent) and (lru or not exact_lru) and (c or not corruptible)
    ]


def build(kind: str, tmp: Path, redis_url: str, redis_prefix: str) -> TierHarness:
    if kind == "redis":
        return redis_harness(tmp, redis_url, redis_prefix)
    return {"cpu": cpu_harness, "disk": disk_harness, "tiered": tiered_harness}[kind](tmp)
