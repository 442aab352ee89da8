"""Pinned prefixes against a flood: a real sidecar (CPU + disk tiers) keeps a pinned chain of
blocks whole while far more than its capacity of other blocks goes through it.

The flood: a "system prompt" chain is stored and pinned over HTTP (``POST /v1/pins`` with its
token ids), an unpinned chain of the same length is stored next to it (the baseline: what a
flood does to a prefix nobody pinned), then ``flood_factor`` times the server's whole capacity
(CPU and disk together) of other blocks is put, the server is restarted on its data folder
(pins must survive that), and both chains are read back.

``measure_pins()`` is what ``benchmarks.ops`` calls; ``tests/server/test_pins_server.py`` runs
the same ``flood_pinned_chain`` against its own live server.

``measure_redis_pins()`` does it with a Redis tier behind the sidecar too, and in place of the
restart another pod (empty CPU tier, a disk folder of its own, no pin file) takes the port:
the chain can only come back from Redis, which kept it because Redis holds the pins itself.

    python -m benchmarks.ops.pins
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from cachetier.primitives.keys import KVLayout, Namespace, block_keys
from cachetier.record import KVBlock
from cachetier.server.config import ServerConfig
from cachetier.tiers.remote import RemoteTier, RemoteTierConfig
from tests.server.live import TOKENS, ThreadServer, call_json, test_config
from tests.support import own_redis_prefix

# 64 KiB blocks: a flood of a few times a small server's capacity is a few hundred blocks.
LAYOUT = KVLayout("float16", block_size=16, num_layers=4, num_kv_heads=4, head_dim=64)
CPU_BYTES = 4 << 20
DISK_BYTES = 8 << 20
REDIS_BYTES = 8 << 20


def chain(namespace: Namespace, num_blocks: int, seed: int) -> tuple[list[int], list[KVBlock]]:
    """Token ids of ``num_blocks`` full blocks and their blocks (random payloads), keyed with
    the one key function."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, 50_000, size=num_blocks * LAYOUT.block_size).tolist()
    shape = LAYOUT.payload_shape
    blocks = [
        KVBlock(
            key,
            namespace.fingerprint,
            LAYOUT.dtype,
            shape,
            LAYOUT.block_size,
            rng.integers(0, 256, size=LAYOUT.block_bytes, dtype=np.uint8).tobytes(),
        )
        for key in block_keys(namespace, tokens)
    ]
    return tokens, blocks


def _num_restored(tier: RemoteTier, namespace: Namespace, blocks: list[KVBlock]) -> int:
    """How many of ``blocks`` come back whole, byte for byte."""
    got = tier.get_many(namespace.id, [b.key for b in blocks])
    return sum(1 for g, b in zip(got, blocks) if g is not None and bytes(g.data) == bytes(b.data))


def flood_pinned_chain(
    url: str,
    restart: Callable[[], str | None] | None,
    *,
    capacity_bytes: int,
    chain_blocks: int = 8,
    flood_factor: float = 4.0,
    tenant: str = "alice",
) -> dict[str, Any]:
    """Pin a chain on a live sidecar, flood it, (restart it,) and read the chain back.

    Args:
        url: the sidecar's base URL (tenants and tokens of ``tests.server.live.TOKENS``).
        restart: restarts the sidecar on the same data folder, or ``None`` for no restart; it
            returns the restarted sidecar's URL where that changed (``None``: the same).
        capacity_bytes: the sidecar's CPU and disk capacity together.
        chain_blocks: blocks of the pinned chain (and of the unpinned baseline).
        flood_factor: the flood is this many times ``capacity_bytes``.
        tenant: the tenant that stores and pins.

    Returns:
        ``pinned_blocks`` (what the pin answer says the tiers protect), the blocks of the
        pinned chain and of the unpinned one restored after the flood, the flood's size, and
        each tier's pin figures from ``GET /v1/pins`` after it.
    """
    token = TOKENS[tenant]
    namespace = Namespace("ops-pins-model", LAYOUT, tenant=tenant)
    tokens, pinned = chain(namespace, chain_blocks, seed=1)
    _, unpinned = chain(namespace, chain_blocks, seed=2)
    tier = RemoteTier(RemoteTierConfig(url=url, token=token, timeout_s=60))
    try:
        tier.put_many(namespace.id, pinned + unpinned)
        status, answer = call_json(
            url,
            "POST",
            "/v1/pins",
            {"namespace": namespace.id, "token_ids": tokens, "block_size": LAYOUT.block_size},
            token=token,
        )
        if status != 200:
            raise RuntimeError(f"POST /v1/pins answered {status}: {answer}")
        if answer["keys"] != [b.key.hex() for b in pinned]:
            raise RuntimeError("the server's chain of keys is not block_keys'")
        num_flood = int(flood_factor * capacity_bytes / LAYOUT.block_bytes) + 1
        step = 32
        for first in range(0, num_flood, step):
            _, blocks = chain(namespace, min(step, num_flood - first), seed=1000 + first)
            tier.put_many(namespace.id, blocks)
    finally:
        tier.close()
    if restart is not None:
        url = restart() or url
    tier = RemoteTier(RemoteTierConfig(url=url, token=token, timeout_s=60))
    try:
        restored = _num_restored(tier, namespace, pinned)
        baseline = _num_restored(tier, namespace, unpinned)
    finally:
        tier.close()
    _, listing = call_json(url, "GET", "/v1/pins", token=TOKENS["ops"])
    return {
        "pinned_blocks": min(answer["protected"].values(), default=0),
        "pinned_blocks_restored_after_flood": restored,
        "unpinned_blocks_restored_after_flood": baseline,
        "pinned_chain_blocks": chain_blocks,
        "flood_blocks": num_flood,
        "flood_over_capacity": round(num_flood * LAYOUT.block_bytes / capacity_bytes, 2),
        "restarted_before_restore": restart is not None,
        "pins_listed_after_restart": sum(len(p["keys"]) for p in listing["pins"]),
        "tier_pins": listing["tiers"],
    }


def measure_pins() -> dict[str, Any]:
    """The pin figures of ``benchmarks.ops``: a sidecar of 4 MiB CPU and 8 MiB disk flooded with
    four times that, restarted, and the pinned chain read back.

    Returns:
        As ``flood_pinned_chain``.
    """
    with tempfile.TemporaryDirectory(prefix="ops-pins-") as tmp:
        config = test_config(
            Path(tmp) / "server",
            cpu_bytes=CPU_BYTES,
            disk_bytes=DISK_BYTES,
            max_batch_bytes=4 << 20,
        )
        server = ThreadServer(config).start()
        try:
            return flood_pinned_chain(
                server.url, server.restart, capacity_bytes=CPU_BYTES + DISK_BYTES
            )
        finally:
            server.stop()


def flood_then_switch_pods(config: ServerConfig, other_data_dir: Path) -> dict[str, Any]:
    """``flood_pinned_chain`` on a sidecar with CPU, disk and Redis tiers; then, in place of a
    restart, another sidecar on the same Redis but with ``other_data_dir`` (its CPU and disk
    tiers empty, no pin file) serves the read back, on a port of its own.

    Args:
        config: the first sidecar's settings (``redis_url`` and ``redis_bytes`` set).
        other_data_dir: the second sidecar's data folder.

    Returns:
        As ``flood_pinned_chain`` (``pins_listed_after_restart`` is the second pod's: 0).
    """
    store = config.store
    assert store.redis_url and store.redis_bytes, "the flood is meant to reach Redis"
    first = ThreadServer(config).start()
    # The store's disk folder and pin file were filled in from the first data_dir: clear them,
    # so the second pod's come from its own.
    own_files = replace(store, disk_path=None, pin_file=None)
    second = ThreadServer(replace(config, data_dir=str(other_data_dir), store=own_files))

    def switch_pods() -> str:
        first.stop()
        return second.start().url

    try:
        capacity = store.cpu_bytes + store.disk_bytes + store.redis_bytes
        return flood_pinned_chain(first.url, switch_pods, capacity_bytes=capacity)
    finally:
        first.stop()
        second.stop()


def measure_redis_pins(redis_url: str = "redis://127.0.0.1:6379/0") -> dict[str, Any]:
    """``measure_pins`` with an 8 MiB Redis tier (a key prefix of its own, deleted after)
    behind the sidecar, read back through another pod (``flood_then_switch_pods``).

    Args:
        redis_url: a single-node Redis.

    Returns:
        As ``flood_pinned_chain``.
    """
    with (
        tempfile.TemporaryDirectory(prefix="ops-pins-") as tmp,
        own_redis_prefix(redis_url, "ops-pins") as prefix,
    ):
        config = test_config(
            Path(tmp) / "server",
            cpu_bytes=CPU_BYTES,
            disk_bytes=DISK_BYTES,
            redis_url=redis_url,
            redis_key_prefix=prefix,
            redis_bytes=REDIS_BYTES,
            max_batch_bytes=4 << 20,
        )
        return flood_then_switch_pods(config, Path(tmp) / "other-pod")


if __name__ == "__main__":
    print(json.dumps(measure_pins()))
    print(json.dumps(measure_redis_pins()))
