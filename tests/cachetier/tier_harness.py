"""How the shared tier suite builds, restarts and corrupts each kind of tier.

Adding a tier to the suite means adding one ``TierHarness`` here (the server's remote tier
runs against a real server from ``tests/server/live.py``).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis
from redis.cluster import RedisCluster

from cachetier.primitives.keys import BlockHash
from cachetier.store.tiered import TieredStore
from cachetier.tiers.base import Tier
from cachetier.tiers.cpu import CPUTier, CPUTierConfig
from cachetier.tiers.disk.tier import DiskTier, DiskTierConfig
from cachetier.tiers.redis import RedisTier, RedisTierConfig, parse_cluster_url


@dataclass
class TierHarness:
    """How the shared suite builds, corrupts and cleans up one kind of tier.

    Args:
        make: build a tier with the given byte capacity (the same storage on every call).
        corrupt: flip one stored byte of (namespace, key), or ``None`` if the tier keeps
            nothing outside this process's memory.
        overhead_bytes: bytes a stored block costs beyond its payload (record header).
        count_corrupt: how many corrupt records a tier has detected (default: its stats and
            those of the tiers it stacks); a remote tier's server detects them, not the client.
        count_skipped: how many puts of a held key a tier skipped (counted like
            ``count_corrupt``).
        stop: releases what the harness started besides the tiers (a server), or ``None``.
    """

    make: Callable[[int], Tier]
    corrupt: Callable[[Tier, str, BlockHash], None] | None
    overhead_bytes: int = 0
    count_corrupt: Callable[[Tier], int] = field(default=lambda tier: _counted(tier, "corrupt"))
    count_skipped: Callable[[Tier], int] = field(
        default=lambda tier: _counted(tier, "skipped_present")
    )
    stop: Callable[[], None] | None = None
    opened: list[Tier] = field(default_factory=list)

    def open(self, capacity_bytes: int) -> Tier:
        tier = self.make(capacity_bytes)
        self.opened.append(tier)
        return tier

    def close_all(self) -> None:
        for tier in self.opened:
            tier.close()
        if self.stop is not None:
            self.stop()


def _counted(tier: Tier, counter: str) -> int:
    stats = tier.stats()
    return stats.get(counter, 0) + sum(t[counter] for t in stats.get("tiers", {}).values())


def flip_file(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def cpu_harness(tmp: Path) -> TierHarness:
    return TierHarness(
        make=lambda cap: CPUTier(CPUTierConfig(cap)),
        corrupt=None,
    )


# The header of a 5-dim block: fixed part, shape, writer id, checksum.
RECORD_OVERHEAD = 4 + 2 + 4 + 4 + 32 + 32 + 4 + 16 + 5 * 8 + 16 + 8


def disk_harness(tmp: Path) -> TierHarness:
    root = tmp / "disk"

    def corrupt(tier: Tier, ns: str, key: BlockHash) -> None:
        assert isinstance(tier, DiskTier)
        flip_file(tier.path_of(ns, key))

    return TierHarness(
        make=lambda cap: DiskTier(DiskTierConfig(str(root), cap, fsync=False)),
        corrupt=corrupt,
        overhead_bytes=RECORD_OVERHEAD,
    )


def _flip_stored(client: redis.Redis | RedisCluster, tier: Tier, ns: str, key: BlockHash) -> None:
    """Flip one byte of the record a ``RedisTier`` stored, through ``client`` (then closed)."""
    assert isinstance(tier, RedisTier)
    name = tier.storage_key(ns, key)
    try:
        value = bytearray(client.get(name) or b"")
        assert value, f"{name} is not stored"
        value[len(value) // 2] ^= 0xFF
        client.set(name, bytes(value))
    finally:
        client.close()


def redis_harness(tmp: Path, url: str, prefix: str) -> TierHarness:
    return TierHarness(
        make=lambda cap: RedisTier(RedisTierConfig(url=url, key_prefix=prefix, capacity_bytes=cap)),
        corrupt=lambda tier, ns, key: _flip_stored(redis.Redis.from_url(url), tier, ns, key),
        overhead_bytes=RECORD_OVERHEAD,
    )


def redis_cluster_harness(url: str) -> TierHarness:
    """A ``RedisTier`` on a Redis Cluster (``LocalCluster.url``), under a key prefix of its own.

    A cluster tier has no capacity of its own (the masters' ``maxmemory`` bounds it), so the
    suite's capacity is ignored; the cluster keeps nothing past the session.
    """
    prefix = f"cachetier-test-{uuid.uuid4().hex[:12]}"
    host, port = parse_cluster_url(url).nodes[0]

    def corrupt(tier: Tier, ns: str, key: BlockHash) -> None:
        _flip_stored(RedisCluster(host=host, port=port, socket_timeout=2), tier, ns, key)

    return TierHarness(
        make=lambda cap: RedisTier(RedisTierConfig(url=url, key_prefix=prefix)),
        corrupt=corrupt,
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


def remote_harness(tmp: Path, *, transfer: bool = False) -> TierHarness:
    """A ``RemoteTier`` against a real server (CPU + disk tiers) on 127.0.0.1, as tenant alice;
    with ``transfer``, the server has a block transfer port and gets and puts go over it.

    Every tier after the first finds the server restarted on the same data folder, so the
    restart test restarts the server, not just the client.
    """
    from cachetier.tiers.remote import RemoteTier, RemoteTierConfig
    from tests.server.live import TOKENS, ThreadServer, call, test_config

    # Port 0 for both: the first start picks them, restarts keep them.
    port = 0 if transfer else None
    server = ThreadServer(test_config(tmp / "remote-server", transfer_port=port))
    running: list[bool] = []

    def make(cap: int) -> Tier:
        # The server's own tiers set the capacity; ``cap`` only matters to exact-LRU kinds.
        if running:
            server.restart()
        else:
            server.start()
            running.append(True)
        return RemoteTier(
            RemoteTierConfig(url=server.url, token=TOKENS["alice"], transfer=transfer)
        )

    def corrupt(tier: Tier, ns: str, key: BlockHash) -> None:
        server.restart()  # the server's CPU tier forgets: the read reaches the disk copy
        name = key.hex()
        blocks = Path(server.config.data_dir) / "blocks"
        flip_file(blocks / f"t.alice.{ns}" / name[:2] / f"{name}.ctkv")

    def count(counter: str) -> int:
        _, _, body = call(server.url, "GET", "/v1/stats", token=TOKENS["ops"])
        return sum(t[counter] for t in json.loads(body)["tiers"].values())

    return TierHarness(
        make=make,
        corrupt=corrupt,
        count_corrupt=lambda tier: count("corrupt"),
        count_skipped=lambda tier: count("skipped_present"),
        stop=server.stop,
    )


_TRAITS = {
    # kind: (persistent, exact_lru, corruptible)
    "cpu": (False, True, False),
    "disk": (True, True, True),
    "redis": (True, True, True),
    # The masters' maxmemory bounds a cluster, not an exact LRU of the tier's own.
    "redis-cluster": (True, False, True),
    "tiered": (True, False, True),
    # The server's tiers each keep exact LRU, but a stack of them does not (like "tiered").
    "remote": (True, False, True),
    "remote-transfer": (True, False, True),
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


def build(kind: str, tmp: Path, fixture: Callable[[str], Any]) -> TierHarness:
    """The harness of ``kind``; ``fixture`` gets a pytest fixture by name (the real Redis or
    Redis Cluster), called only for the kinds that need one."""
    if kind == "redis":
        return redis_harness(tmp, fixture("redis_url"), fixture("redis_prefix"))
    if kind == "redis-cluster":
        return redis_cluster_harness(fixture("redis_cluster").url)
    builders = {
        "cpu": cpu_harness,
        "disk": disk_harness,
        "tiered": tiered_harness,
        "remote": remote_harness,
        "remote-transfer": lambda tmp: remote_harness(tmp, transfer=True),
    }
    return builders[kind](tmp)
