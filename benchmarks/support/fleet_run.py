"""One policy driven through a simulated fleet (``benchmarks.fleet_sim``).

Each request, at its arrival, is routed by ``cachetier.fleet.decide``, the router's own code,
from views of every simulated replica: where the replica holds the prompt's blocks (its pool,
its disk, the shared tier), its queue, and the cost model of the measured figures. The chosen
replica serves it after the requests queued before it, for the time the chosen estimate gives
to load or compute the prompt plus a fixed decode time; its blocks are then in that replica's
pool and disk and in the shared tier.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from benchmarks.support.fleet_replica import LRUBlocks, SimReplica
from cachetier.fleet import ReplicaView, RouteRequest, RoutingConfig, decide
from cachetier.store.costmodel import CostModel
from cachetier.util.checks import positive_int


@dataclass(frozen=True, slots=True)
class SimRequest:
    """One request of the simulated trace.

    Args:
        arrival_s: when it arrives (scaled trace time).
        num_tokens: prompt tokens.
        blocks: the prompt's block ids (the trace's chained hash ids).
        session_id: its conversation, or ``None``.
    """

    arrival_s: float
    num_tokens: int
    blocks: tuple[int, ...]
    session_id: str | None


@dataclass(frozen=True, slots=True)
class FleetShape:
    """The simulated fleet.

    Args:
        num_replicas: replicas.
        pool_blocks: blocks each engine pool holds.
        disk_blocks: blocks each node-local disk tier holds.
        shared_blocks: blocks the shared tier holds.
        decode_s: seconds a request holds its replica after its first token.
        block_size: tokens per block.
        block_bytes: bytes of one block.
        chunk_tokens: most tokens an engine computes in one step.
        max_imbalance: the routing's imbalance bound.
    """

    num_replicas: int
    pool_blocks: int
    disk_blocks: int
    shared_blocks: int
    decode_s: float
    block_size: int
    block_bytes: int
    chunk_tokens: int
    max_imbalance: float

    def __post_init__(self) -> None:
        for name in ("num_replicas", "pool_blocks", "disk_blocks", "shared_blocks"):
            positive_int(name, getattr(self, name))
        if not self.decode_s >= 0:
            raise ValueError(f"decode_s must be >= 0, got {self.decode_s}")


@dataclass(slots=True)
class PolicyRun:
    """What one policy's run measured.

    Args:
        policy: the policy.
        ttft_s: each request's TTFT, in arrival order.
        routed: requests each replica served.
        held_tokens: prompt tokens each medium (pool, disk, shared) held for the chosen
            replica.
        num_tokens: prompt tokens in all.
        busy_s: seconds the replicas were serving, summed.
        end_s: when the last request finished.
        max_estimate_error_s: largest gap between a request's TTFT and the chosen estimate.
    """

    policy: str
    ttft_s: list[float] = field(default_factory=list)
    routed: list[int] = field(default_factory=list)
    held_tokens: dict[str, int] = field(default_factory=dict)
    num_tokens: int = 0
    busy_s: float = 0.0
    end_s: float = 0.0
    max_estimate_error_s: float = 0.0


def _views(
    replicas: list[SimReplica], request: SimRequest, shared_run: int, cost: CostModel, chunk: int
) -> list[ReplicaView]:
    views = []
    for replica in replicas:
        num_requests, pending_s = replica.load_at(request.arrival_s)
        media = replica.media(request.blocks, shared_run)
        views.append(
            ReplicaView(
                replica.name,
                media,
                num_requests,
                pending_s,
                cost,
                chunk_tokens=chunk,
                num_routed=replica.num_routed,
            )
        )
    return views


def run_policy(
    policy: str, requests: list[SimRequest], shape: FleetShape, cost: CostModel
) -> PolicyRun:
    """Route and serve ``requests`` in order of arrival under ``policy``.

    Args:
        policy: a ``cachetier.fleet.POLICIES`` name.
        requests: the trace, sorted by arrival.
        shape: the fleet.
        cost: every replica's cost model (one hardware).

    Returns:
        What the run measured.
    """
    replicas = [
        SimReplica(f"r{i}", shape.pool_blocks, shape.disk_blocks) for i in range(shape.num_replicas)
    ]
    by_name = {r.name: r for r in replicas}
    shared = LRUBlocks(shape.shared_blocks)
    config = RoutingConfig(shape.max_imbalance)
    run = PolicyRun(policy, held_tokens={"pool": 0, "disk": 0, "shared": 0})
    bs = shape.block_size
    for seq, req in enumerate(requests):
        views = _views(replicas, req, shared.leading_run(req.blocks), cost, shape.chunk_tokens)
        route = RouteRequest(req.num_tokens, bs, shape.block_bytes, req.session_id, seq)
        decision = decide(policy, route, views, config)
        assert decision is not None, "every simulated replica is up"
        est = decision.estimates[decision.replica]
        assert est.prefix_s is not None and est.ttft_s is not None, "the prefill is measured"
        replica = by_name[decision.replica]
        ttft = replica.serve(req.arrival_s, est.prefix_s, shape.decode_s)
        run.ttft_s.append(ttft)
        run.max_estimate_error_s = max(run.max_estimate_error_s, abs(ttft - est.ttft_s))
        replica.store(req.blocks)
        shared.store(req.blocks)
        n = req.num_tokens
        pool = min(est.pool_blocks * bs, n)
        local = min((est.pool_blocks + est.local_blocks) * bs, n)
        run.held_tokens["pool"] += pool
        run.held_tokens["disk"] += local - pool
        run.held_tokens["shared"] += min(est.held_blocks * bs, n) - local
        run.num_tokens += n
    run.routed = [r.num_routed for r in replicas]
    run.busy_s = sum(r.busy_s for r in replicas)
    run.end_s = max(r.busy_until for r in replicas)
    return run
