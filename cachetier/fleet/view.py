"""What a routing decision is made from: the request, and each replica as the router sees it.

Both are plain values built by the caller (the router from its prefix index and the replicas'
``GET /v1/fleet/state``; the fleet simulator from its simulated replicas), so that a decision
is a pure function of them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from cachetier.store.costmodel import CostModel
from cachetier.util.checks import positive_int


@dataclass(frozen=True, slots=True)
class RouteRequest:
    """The request being routed.

    Args:
        num_tokens: prompt tokens (what must be loaded or computed before the first token).
        block_size: tokens per block of the replicas' keys.
        block_bytes: payload bytes of one block (what a tier read of it moves).
        session_id: the client's session (``x-session-id``, the body's ``user``), or ``None``.
        seq: the router's count of requests routed before this one: round robin turns on it,
            and ties between equal replicas rotate with it (so that, at equal scores, the
            first replica listed does not take every request).
    """

    num_tokens: int
    block_size: int
    block_bytes: int
    session_id: str | None = None
    seq: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.num_tokens, bool) or not isinstance(self.num_tokens, int):
            raise ValueError(f"num_tokens must be an int >= 0, got {self.num_tokens!r}")
        if self.num_tokens < 0:
            raise ValueError(f"num_tokens must be an int >= 0, got {self.num_tokens!r}")
        positive_int("block_size", self.block_size)
        positive_int("block_bytes", self.block_bytes)
        if isinstance(self.seq, bool) or not isinstance(self.seq, int) or self.seq < 0:
            raise ValueError(f"seq must be an int >= 0, got {self.seq!r}")


@dataclass(frozen=True, slots=True)
class ReplicaView:
    """One replica, as a decision sees it.

    Args:
        name: the replica's name (``r0``...).
        media: where the replica reads each leading block of the prompt from, fastest first
            (``cachetier.kvindex.Holding.media``): ``pool``/``gpu`` (its engine's pool),
            ``cpu``/``disk`` (its node-local tiers), ``redis``/``sidecar``/``remote`` (the
            shared tiers every replica reads). Its length is the longest prefix it can get
            without computing.
        num_requests: requests running and queued on it (the load the imbalance bound and
            ``least_loaded`` weigh).
        pending_s: estimated seconds of work ahead of a new request on it (its queue wait).
        cost: its cost model: its own measured tier rates and prefill speed.
        chunk_tokens: most tokens its engine computes in one step.
        up: whether it is in the rotation (a replica that is down is never chosen).
        prefix_only: its engine takes loaded blocks only as a leading run (vLLM).
        overlap_tiers: tiers its engine reads beside a recompute (``CostModel.plan``).
        num_routed: requests routed to it lately (the router's count, decayed as it goes;
            the simulator's, whole): the bound on how the fleet's work is spread over time.
    """

    name: str
    media: tuple[str, ...]
    num_requests: int
    pending_s: float
    cost: CostModel = field(compare=False)
    chunk_tokens: int = 2048
    up: bool = True
    prefix_only: bool = False
    overlap_tiers: frozenset[str] = frozenset()
    num_routed: float = 0.0

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("a replica needs a name")
        if isinstance(self.num_requests, bool) or not isinstance(self.num_requests, int):
            raise ValueError(f"num_requests must be an int >= 0, got {self.num_requests!r}")
        if self.num_requests < 0:
            raise ValueError(f"num_requests must be an int >= 0, got {self.num_requests!r}")
        if not (math.isfinite(self.pending_s) and self.pending_s >= 0):
            raise ValueError(f"pending_s must be a finite number >= 0, got {self.pending_s!r}")
        positive_int("chunk_tokens", self.chunk_tokens)
        if not (math.isfinite(self.num_routed) and self.num_routed >= 0):
            raise ValueError(f"num_routed must be a finite number >= 0, got {self.num_routed!r}")


@dataclass(frozen=True, slots=True)
class RoutingConfig:
    """How the load-aware policies bound imbalance.

    Args:
        max_imbalance: ``tier_aware`` and ``pool_only`` pass over a replica whose load
            (``num_requests``) exceeds this multiple of the mean load of the replicas that are
            up, or whose ``num_routed`` reaches it times their mean plus one
            (``policies.over_bound``).
    """

    max_imbalance: float = 1.3

    def __post_init__(self) -> None:
        if not (math.isfinite(self.max_imbalance) and self.max_imbalance >= 1.0):
            raise ValueError(f"max_imbalance must be a number >= 1, got {self.max_imbalance}")
