"""Helpers shared by tests (plain functions; fixtures live in conftest.py)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import redis

from cachetier.keys import KVLayout, Namespace, block_keys
from cachetier.record import KVBlock

# A small layout so shared-suite tests move kilobytes, not megabytes.
SMALL_LAYOUT = KVLayout("float16", block_size=16, num_layers=2, num_kv_heads=2, head_dim=8)


def make_blocks(
    namespace: Namespace, num_blocks: int, *, seed: int = 0, layout: KVLayout | None = None
) -> list[KVBlock]:
    """``num_blocks`` chained blocks with random fp16 payloads, deterministic per seed."""
    layout = layout or namespace.layout
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, 50_000, size=num_blocks * layout.block_size)
    keys = block_keys(namespace, tokens)
    shape = (layout.num_layers, 2, layout.block_size, layout.num_kv_heads, layout.head_dim)
    return [
        KVBlock(
            key,
            namespace.fingerprint,
            layout.dtype,
            shape,
            layout.block_size,
            _payload(rng, shape, layout.dtype),
        )
        for key in keys
    ]


def _payload(rng: np.random.Generator, shape: tuple[int, ...], dtype: str) -> bytes:
    if dtype in ("float16", "float32"):
        return rng.standard_normal(shape).astype(dtype).tobytes()
    # Types numpy lacks (bfloat16, fp8): random bits of the right width.
    width = {"bfloat16": 2}.get(dtype, 1)
    return rng.integers(0, 256, size=int(np.prod(shape)) * width, dtype=np.uint8).tobytes()


@contextmanager
def own_redis_prefix(url: str, label: str) -> Iterator[str]:
    """A Redis key prefix nobody else uses; every key under it is deleted on exit."""
    prefix = f"{label}-{uuid.uuid4().hex[:12]}"
    try:
        yield prefix
    finally:
        client = redis.Redis.from_url(url)
        try:
            keys = list(client.scan_iter(match=f"{prefix}*", count=1000))
            if keys:
                client.delete(*keys)
        finally:
            client.close()
