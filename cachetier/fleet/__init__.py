"""The fleet's routing decision: which engine replica a request goes to (no network here).

- ``view``: ``RouteRequest`` and ``ReplicaView``, what a decision is made from, and
  ``RoutingConfig``;
- ``estimate``: a replica's estimated TTFT, its queue plus the cost model's load-or-recompute
  of the prompt from where it holds it;
- ``policies``: ``round_robin``, ``least_loaded``, ``session_affinity``, ``pool_only`` and
  ``tier_aware``, one interface, each decision with every replica's estimate;
- ``measured``: a replica's ``CostModel`` rebuilt from the figures it reports.
"""

from cachetier.fleet.estimate import LOCAL_MEDIA, ReplicaEstimate, estimate_all
from cachetier.fleet.measured import (
    cost_model_from_snapshot,
    prefill_from_snapshot,
    tier_rates_from_snapshot,
)
from cachetier.fleet.policies import POLICIES, Decision, Policy, decide, over_bound
from cachetier.fleet.view import ReplicaView, RouteRequest, RoutingConfig

__all__ = [
    "LOCAL_MEDIA",
    "POLICIES",
    "Decision",
    "Policy",
    "ReplicaEstimate",
    "ReplicaView",
    "RouteRequest",
    "RoutingConfig",
    "cost_model_from_snapshot",
    "decide",
    "estimate_all",
    "over_bound",
    "prefill_from_snapshot",
    "tier_rates_from_snapshot",
]
