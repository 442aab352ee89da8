"""What the fleet tests build views from: a cost model of round figures, a request and a view."""

from __future__ import annotations

from typing import Any

from cachetier.fleet import ReplicaView, RouteRequest, cost_model_from_snapshot
from cachetier.store.costmodel import CostModel

BLOCK_SIZE = 16
NUM_BLOCKS = 8
# 1 MB blocks: a disk read of one takes 0.25 ms at 4 GB/s, a Redis read 1 ms at 1 GB/s, and
# computing its 16 tokens 16 ms at a millisecond a token, so every load beats its recompute.
BLOCK_BYTES = 1_000_000
PREFILL = {
    "step_s": 0.0,
    "s_per_token": 1e-3,
    "s_per_attention": 0.0,
    "max_step_tokens": 4096,
    "max_step_attention": 1e9,
}
TIERS = {
    "disk": {"latency_ms": 1.0, "read_gbps": 4.0},
    "redis": {"latency_ms": 2.0, "read_gbps": 1.0},
}


def make_cost(
    prefill: dict[str, Any] | None = PREFILL, tiers: dict[str, dict[str, Any]] | None = None
) -> CostModel:
    return cost_model_from_snapshot(prefill, TIERS if tiers is None else tiers)


def request(session_id: str | None = None, seq: int = 0) -> RouteRequest:
    """A prompt of ``NUM_BLOCKS`` full blocks."""
    return RouteRequest(BLOCK_SIZE * NUM_BLOCKS, BLOCK_SIZE, BLOCK_BYTES, session_id, seq)


COST = make_cost()


def view(
    name: str,
    media: tuple[str, ...] = (),
    num_requests: int = 0,
    pending_s: float = 0.0,
    **more: Any,
) -> ReplicaView:
    """One up replica with the round figures' cost model (``more`` overrides the rest)."""
    more.setdefault("cost", COST)
    return ReplicaView(name, media, num_requests, pending_s, **more)
