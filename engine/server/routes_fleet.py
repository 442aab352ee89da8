"""``GET /v1/fleet/state``: what a KV-aware router needs of this replica (behind the API key).

A router in front of several replicas (``cachetier route``) estimates each one's time to first
token from its load, from where the prompt's blocks are held (the prefix index, fed by KV
events) and from this replica's own measured rates. This route gives the load and the rates,
and the namespace blocks are keyed under, so the router computes the same block keys as the
replica and its publishers do.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from fastapi import APIRouter, Depends, Query, Request
from pydantic import BaseModel, Field

from cachetier.engine.server.errors import APIError
from cachetier.engine.server.routes import get_serving, require_api_key

v1 = APIRouter(prefix="/v1", dependencies=[Depends(require_api_key)])


class FleetState(BaseModel):
    object: str = "fleet.state"
    model: str
    num_in_flight: int = Field(description="requests this server is answering now")
    num_running: int = Field(description="sequences in the engine's batch at its last step")
    num_waiting: int = Field(description="sequences queued at its last step")
    max_num_seqs: int = Field(description="the most sequences one batch runs")
    max_num_batched_tokens: int = Field(description="the most tokens one step computes")
    max_request_bytes: int = Field(
        description="the largest request body this server takes: a router in front takes no larger"
    )
    namespace: dict[str, Any] = Field(
        description="model_fingerprint, layout (dtype, block_size, num_layers, num_kv_heads, "
        "head_dim, arrangement) and tenant: block keys are chained from it"
    )
    prefill: dict[str, Any] | None = Field(
        description="the engine's measured prefill model (cost model), null before any"
    )
    tiers: dict[str, Any] = Field(
        default_factory=dict, description="each tier's measured latency and read speed"
    )
    kv_events: dict[str, Any] | None = Field(
        None,
        description="where the pool's KV events are published: endpoint (ZMQ PUB), "
        "replay_endpoint, epoch; null unless the server runs with --kv-events",
    )
    kv_digest: dict[str, dict[str, Any]] = Field(
        default_factory=dict,
        description="per medium, what this replica's KV events say it holds: count and xor "
        "(hex of the XOR of each key's first 8 bytes, little-endian); an index whose digest "
        "differs fetches the keys from /v1/fleet/blocks",
    )


MAX_LISTED_KEYS = 1 << 18
"""Keys one ``/v1/fleet/blocks`` answer lists at most (17 MiB of JSON)."""


class FleetBlocks(BaseModel):
    object: str = "fleet.blocks"
    medium: str
    epoch: int = Field(description="the KV events' epoch these keys belong to")
    keys: list[str] = Field(description="block keys, hex")
    truncated: bool = Field(description="more are held than were listed")


@v1.get("/fleet/state", response_model=FleetState)
async def fleet_state(request: Request) -> FleetState:
    serving = get_serving(request)
    stats = serving.engine.stats()
    engine = serving.engine.engine
    ns = engine.namespace  # the pool's keys and the tiers' records are chained from it
    namespace = {
        "model_fingerprint": ns.model_fingerprint,
        "layout": asdict(ns.layout),
        "tenant": ns.tenant,
    }
    publisher = serving.kv_events
    events = None
    if publisher is not None:
        events = {
            "endpoint": publisher.endpoint,
            "replay_endpoint": publisher.replay_endpoint,
            "epoch": publisher.epoch,
            "num_dropped_events": publisher.stats().num_dropped_events,
        }
    held = engine.kv_events.held if engine.kv_events is not None else None
    digest = {
        medium: {"count": count, "xor": f"{acc:016x}"}
        for medium, (count, acc) in (held.digests() if held is not None else {}).items()
    }
    cost = stats.get("cost_model") or {}
    return FleetState(
        model=serving.config.model_name,
        num_in_flight=serving.num_in_flight,
        num_running=stats["num_running"],
        num_waiting=stats["num_waiting"],
        max_num_seqs=engine.config.max_num_seqs,
        max_num_batched_tokens=engine.config.max_num_batched_tokens,
        max_request_bytes=serving.config.max_request_bytes,
        namespace=namespace,
        # Without tiers there is no cost model, but the prefill speed is still measured (the
        # warm-up's forwards): a router weighs the recompute on every replica.
        prefill=cost.get("prefill") or engine.prefill_model.snapshot(),
        tiers=cost.get("tiers") or {},
        kv_events=events,
        kv_digest=digest,
    )


@v1.get("/fleet/blocks", response_model=FleetBlocks)
async def fleet_blocks(
    request: Request,
    medium: str = Query(min_length=1, max_length=64),
    limit: int = Query(MAX_LISTED_KEYS, ge=1, le=MAX_LISTED_KEYS),
) -> FleetBlocks:
    """The keys this replica's KV events say ``medium`` holds: what an index resyncs from."""
    serving = get_serving(request)
    events = serving.engine.engine.kv_events
    if events is None or serving.kv_events is None:
        raise APIError(
            404,
            "this server publishes no KV events: start it with --kv-events",
            type="not_found_error",
        )
    keys = events.held.keys(medium, limit + 1)
    return FleetBlocks(
        medium=medium,
        epoch=serving.kv_events.epoch,
        keys=[k.hex() for k in keys[:limit]],
        truncated=len(keys) > limit,
    )
