"""The routing policies: one interface, five ways to order the replicas for a request.

Every policy is a function ``(request, views, config) -> Decision | None`` (``None``: no
replica is up). Each orders the replicas that are up, best first (the router tries them in
that order), and every decision carries each up replica's TTFT estimate, whichever policy
decided, so that the log line and /metrics show what each choice was expected to cost.

- ``round_robin``: the next replica in turn (``RouteRequest.seq``).
- ``least_loaded``: the fewest requests running and queued.
- ``session_affinity``: the session's replica by rendezvous hashing, so a replica that goes
  down moves only its own sessions; without a session id, ``least_loaded``.
- ``pool_only``: the longest prefix in the engine's pool (what a router that sees only engine
  pools, such as llm-d's precise prefix scorer, weighs), ties broken by load.
- ``tier_aware``: the smallest estimated TTFT (``estimate``): queue wait, then the cost
  model's load-or-recompute of the prompt from the replica's pool, its node-local tiers and
  the shared tiers at its measured rates.

The last two pass over a replica whose load exceeds ``RoutingConfig.max_imbalance`` times the
mean (it goes to the end of the order). Ties at equal scores rotate with ``RouteRequest.seq``.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from cachetier.fleet.estimate import ReplicaEstimate, estimate_all
from cachetier.fleet.view import ReplicaView, RouteRequest, RoutingConfig


@dataclass(frozen=True, slots=True)
class Decision:
    """A policy's answer for one request.

    Args:
        policy: the policy's name.
        replica: the chosen replica (``order[0]``).
        order: every up replica, best first: where to retry if the chosen one fails.
        estimates: every up replica's estimate, by name.
        skipped: replicas passed over by the imbalance bound.
    """

    policy: str
    replica: str
    order: tuple[str, ...]
    estimates: Mapping[str, ReplicaEstimate]
    skipped: tuple[str, ...] = ()


Policy = Callable[[RouteRequest, Sequence[ReplicaView], RoutingConfig], Decision | None]
"""A policy: the request, every replica (up or not), the bound -> its decision."""


Score = Callable[[ReplicaView, ReplicaEstimate], tuple[float, ...]]
"""A policy's sort key for one replica: smaller is better."""


def _decide(
    policy: str,
    request: RouteRequest,
    views: Sequence[ReplicaView],
    score: Score,
    max_imbalance: float | None = None,
) -> Decision | None:
    """The decision that orders the up replicas by (passed over by the imbalance bound, where
    one is given; ``score``; turn)."""
    up = [v for v in views if v.up]
    if not up:
        return None
    if len({v.name for v in up}) != len(up):
        raise ValueError(f"replica names must be unique, got {[v.name for v in up]}")
    estimates = estimate_all(request, up)
    skipped = frozenset() if max_imbalance is None else over_bound(up, max_imbalance)
    n = len(up)
    # A replica's turn: 0 for the one at ``seq`` (mod n), then onwards in listed order.
    turn = {v.name: (i - request.seq) % n for i, v in enumerate(up)}
    order = sorted(
        up, key=lambda v: (v.name in skipped, *score(v, estimates[v.name]), turn[v.name])
    )
    names = tuple(v.name for v in order)
    return Decision(policy, names[0], names, estimates, tuple(v for v in names if v in skipped))


def over_bound(up: Sequence[ReplicaView], max_imbalance: float) -> frozenset[str]:
    """Replicas whose load exceeds ``max_imbalance`` times the mean load of ``up``, or whose
    requests routed lately reach ``max_imbalance`` times their mean plus one.

    The second bound is the one a fleet's balance is judged by (requests per replica over
    time): cache affinity alone keeps sending a prompt family to the replica that served it,
    and a replica that never served holds nothing, so it would never be chosen while the
    others keep up. The slack of one keeps small counts from tripping it. Neither bound
    excludes the replica at the bottom of its own measure; when the two together would
    exclude every replica, only the load bound applies.

    Args:
        up: the replicas that are up.
        max_imbalance: the bound (>= 1).

    Returns:
        Their names.
    """
    if not up:
        return frozenset()
    mean = sum(v.num_requests for v in up) / len(up)
    over = frozenset(v.name for v in up if v.num_requests > max_imbalance * mean)
    assert len(over) < len(up), "the least loaded replica is within any bound >= 1"
    routed = sum(v.num_routed for v in up) / len(up)
    busy = frozenset(v.name for v in up if v.num_routed >= max_imbalance * routed + 1)
    return over | busy if len(over | busy) < len(up) else over


def round_robin(
    request: RouteRequest, views: Sequence[ReplicaView], config: RoutingConfig
) -> Decision | None:
    """The up replica at ``request.seq`` modulo their number, then the ones after it."""
    return _decide("round_robin", request, views, lambda v, e: ())


def least_loaded(
    request: RouteRequest, views: Sequence[ReplicaView], config: RoutingConfig
) -> Decision | None:
    """The up replica with the fewest requests running and queued."""
    return _decide("least_loaded", request, views, lambda v, e: (v.num_requests,))


def _session_weight(session_id: str, replica: str) -> int:
    # Rendezvous (highest random weight) hashing: each session ranks every replica by its own
    # pseudo-random weight, so a replica leaving moves only the sessions it ranked first. A
    # digest, not hash(): Python salts str hashes per process, and every router process must
    # send a session to the same replica. The session's length first keeps pairs apart.
    session = session_id.encode()
    data = len(session).to_bytes(8, "big") + session + replica.encode()
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big")


def session_affinity(
    request: RouteRequest, views: Sequence[ReplicaView], config: RoutingConfig
) -> Decision | None:
    """The up replica the session hashes to (the next one in its ranking while that one is
    down); ``least_loaded`` for a request without a session id."""
    session = request.session_id
    if session is None:
        return _decide("session_affinity", request, views, lambda v, e: (v.num_requests,))
    return _decide(
        "session_affinity", request, views, lambda v, e: (-_session_weight(session, v.name),)
    )


def pool_only(
    request: RouteRequest, views: Sequence[ReplicaView], config: RoutingConfig
) -> Decision | None:
    """The up replica with the longest leading run in its engine's pool, within the imbalance
    bound; ties broken by load."""
    return _decide(
        "pool_only",
        request,
        views,
        lambda v, e: (-e.pool_blocks, v.num_requests),
        config.max_imbalance,
    )


def tier_aware(
    request: RouteRequest, views: Sequence[ReplicaView], config: RoutingConfig
) -> Decision | None:
    """The up replica with the smallest estimated TTFT, within the imbalance bound; ties
    broken by load. A replica whose prefill is not measured yet comes after those measured."""

    def score(v: ReplicaView, e: ReplicaEstimate) -> tuple[float, ...]:
        ttft = e.ttft_s
        return (math.inf if ttft is None else ttft, v.num_requests)

    return _decide("tier_aware", request, views, score, config.max_imbalance)


POLICIES: dict[str, Policy] = {
    "tier_aware": tier_aware,
    "pool_only": pool_only,
    "least_loaded": least_loaded,
    "session_affinity": session_affinity,
    "round_robin": round_robin,
}
"""Every policy by name (the router's ``--policy``)."""


def decide(
    policy: str,
    request: RouteRequest,
    views: Sequence[ReplicaView],
    config: RoutingConfig | None = None,
) -> Decision | None:
    """Route ``request`` by the policy named ``policy``.

    Args:
        policy: a key of ``POLICIES``.
        request: the request.
        views: every replica, up or not.
        config: the imbalance bound (``RoutingConfig()`` if ``None``).

    Returns:
        The decision, or ``None`` when no replica is up.

    Raises:
        ValueError: ``policy`` is not one of ``POLICIES``, or two replicas that are up have
            one name.
    """
    chosen = POLICIES.get(policy)
    if chosen is None:
        raise ValueError(f"policy must be one of {tuple(POLICIES)}, got {policy!r}")
    return chosen(request, views, config if config is not None else RoutingConfig())
