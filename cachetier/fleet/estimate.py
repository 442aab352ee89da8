"""A replica's estimated time to first token for a request: its queue, then the cost model's
load-or-recompute of the prompt from where the replica holds it.

The pool's leading run is free (the engine computes from it), the blocks after it are loaded
from the node-local or shared tier that holds each, at the replica's measured rate of that
tier, or recomputed where the cost model finds that cheaper, and the rest of the prompt is
computed at the replica's measured prefill speed. All of it is ``CostModel.plan``: this module
only turns a view into its arguments.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from cachetier.fleet.view import ReplicaView, RouteRequest
from cachetier.kvindex.index import POOL_MEDIA
from cachetier.store.costmodel import CostModel

LOCAL_MEDIA = frozenset({"cpu", "disk"})
"""Tiers of the replica's own node; every other tier (``redis``, ``sidecar``, ``remote``) is
one all replicas read."""


@dataclass(frozen=True, slots=True)
class ReplicaEstimate:
    """What a decision estimated of one replica (for its choice, its log line and /metrics).

    Args:
        replica: the replica's name.
        num_requests: its load (requests running and queued).
        queue_s: seconds before it would start the request (its ``pending_s``).
        prefix_s: seconds to load or compute the prompt once started (``None``: its prefill
            speed is not measured yet).
        pool_blocks: leading blocks in its pool.
        local_blocks: blocks after those that its node-local tiers hold.
        shared_blocks: blocks after those that the shared tiers hold.
        loaded_blocks: hit blocks the cost model's plan loads (the others it recomputes).
    """

    replica: str
    num_requests: int
    queue_s: float
    prefix_s: float | None
    pool_blocks: int
    local_blocks: int
    shared_blocks: int
    loaded_blocks: int

    @property
    def ttft_s(self) -> float | None:
        """Estimated seconds from now to the first token (``None``: prefill unmeasured)."""
        return None if self.prefix_s is None else self.queue_s + self.prefix_s

    @property
    def held_blocks(self) -> int:
        """Leading blocks it can get without computing them."""
        return self.pool_blocks + self.local_blocks + self.shared_blocks


@dataclass(frozen=True, slots=True)
class _Holding:
    """A view's media as the cost model takes them: the pool's run, then tier spans."""

    pool_blocks: int
    spans: tuple[tuple[str, int], ...]


def _holding(view: ReplicaView) -> _Holding:
    """The pool's leading run, then ``(tier, blocks)`` spans up to the first block the cost
    model cannot price: a tier this replica has not measured, or a pool block after a gap (the
    engine's prefix cache reuses only a leading run). What is cut is estimated as recomputed:
    a replica is credited only with what it measured."""
    media = view.media
    pool = 0
    while pool < len(media) and media[pool] in POOL_MEDIA:
        pool += 1
    spans: list[tuple[str, int]] = []
    rates = view.cost.rates
    for medium in media[pool:]:
        if spans and spans[-1][0] == medium:
            spans[-1] = (medium, spans[-1][1] + 1)
            continue
        rate = rates.get(medium)
        if medium in POOL_MEDIA or rate is None or rate.seconds_per_byte is None:
            break
        spans.append((medium, 1))
    return _Holding(pool, tuple(spans))


def _prefix_s(request: RouteRequest, view: ReplicaView, held: _Holding) -> tuple[float | None, int]:
    """Seconds to load or compute the prompt from ``held`` on ``view``'s engine, and the hit
    blocks the plan loads."""
    cost: CostModel = view.cost
    cached_tokens = min(held.pool_blocks * request.block_size, request.num_tokens)
    plan = cost.plan(
        held.spans,
        block_bytes=request.block_bytes,
        block_size=request.block_size,
        cached_tokens=cached_tokens,
        num_tokens=request.num_tokens,
        chunk_tokens=view.chunk_tokens,
        prefix_only=view.prefix_only,
        overlap_tiers=view.overlap_tiers,
    )
    if plan.est_ttft_s is not None:
        return plan.est_ttft_s, plan.num_load_blocks
    # No tier hit past the pool (the plan has nothing to weigh): compute the rest.
    if plan.num_hit_blocks == 0:
        return cost.prefill.recompute_s(cached_tokens, request.num_tokens, view.chunk_tokens), 0
    return None, plan.num_load_blocks


def estimate_all(request: RouteRequest, views: Sequence[ReplicaView]) -> dict[str, ReplicaEstimate]:
    """Every up replica's estimate for ``request``.

    Replicas whose cost model, holding and engine shape are the same get one plan between
    them (a fleet of one hardware mostly holds the same few things of a prompt: the shared
    tiers' run, and one or two replicas' own).

    Args:
        request: the request being routed.
        views: the replicas (those down are left out).

    Returns:
        Estimates by replica name, in the order of ``views``.
    """
    plans: dict[tuple[object, ...], tuple[float | None, int]] = {}
    out: dict[str, ReplicaEstimate] = {}
    for view in views:
        if not view.up:
            continue
        held = _holding(view)
        # id(): the cost models live as long as ``views`` does, which outlives this dict.
        key = (id(view.cost), held, view.chunk_tokens, view.prefix_only, view.overlap_tiers)
        found = plans.get(key)
        if found is None:
            found = plans[key] = _prefix_s(request, view, held)
        prefix_s, loaded = found
        local = sum(n for medium, n in held.spans if medium in LOCAL_MEDIA)
        shared = sum(n for medium, n in held.spans if medium not in LOCAL_MEDIA)
        out[view.name] = ReplicaEstimate(
            view.name,
            view.num_requests,
            view.pending_s,
            prefix_s,
            held.pool_blocks,
            local,
            shared,
            loaded,
        )
    return out
