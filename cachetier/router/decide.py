"""The router's policy: the replicas as ``cachetier.fleet`` views, decided by the named policy.

Each replica that is up becomes a ``ReplicaView``: where it holds each leading block of the
prompt (the prefix index, keyed by the block keys of the namespace the replica reports), its
load, the seconds of work the router has sent it and not seen finish (``Replica.pending_s``),
and its cost model rebuilt from the rates it reports (``/v1/fleet/state``). A replica that
reports no rates (``vllm serve``) has an unmeasured cost model: ``tier_aware`` then orders it
by load after the measured ones.
"""

from __future__ import annotations

from collections.abc import Sequence

from cachetier.fleet import (
    ReplicaView,
    RouteRequest,
    RoutingConfig,
    cost_model_from_snapshot,
    decide,
)
from cachetier.kvindex import PrefixIndex
from cachetier.primitives.keys import BlockHash, Namespace, block_keys
from cachetier.router.app import RouteDecision
from cachetier.router.replicas import Replica
from cachetier.store.costmodel import CostModel

# Without a replica's namespace (none reports one yet) a request still needs a block size.
FALLBACK_BLOCK_SIZE = 16
FALLBACK_BLOCK_BYTES = 1


class FleetDecider:
    """The ``Decide`` of ``cachetier.router.app`` for a ``cachetier.fleet`` policy.

    Args:
        policy: a ``cachetier.fleet.POLICIES`` name.
        index: where replicas' holdings are known (fed by their KV events).
        max_imbalance: the policies' load bound (``RoutingConfig``).
    """

    def __init__(self, policy: str, index: PrefixIndex, max_imbalance: float = 1.3) -> None:
        self.policy = policy
        self.index = index
        self.config = RoutingConfig(max_imbalance)
        self._seq = 0
        self._costs: dict[str, tuple[int, CostModel]] = {}  # replica -> (state version, model)

    def __call__(
        self, tokens: list[int] | None, session: str | None, up: Sequence[Replica]
    ) -> RouteDecision:
        if not up:
            return RouteDecision(())
        namespace = next((r.namespace for r in up if r.namespace is not None), None)
        keys = _keys(namespace, tokens)
        holdings = {h.replica: h for h in self.index.holdings(keys, [r.name for r in up])}
        layout = namespace.layout if namespace is not None else None
        request = RouteRequest(
            num_tokens=len(tokens or ()),
            block_size=layout.block_size if layout else FALLBACK_BLOCK_SIZE,
            block_bytes=layout.block_bytes if layout else FALLBACK_BLOCK_BYTES,
            session_id=session,
            seq=self._seq,
        )
        self._seq += 1
        views = [
            ReplicaView(
                name=r.name,
                media=holdings[r.name].media,
                num_requests=r.load,
                pending_s=r.pending_s,
                cost=self._cost(r),
                chunk_tokens=int(r.state.get("max_num_batched_tokens", 2048)),
                num_routed=r.routed,
            )
            for r in up
        ]
        decision = decide(self.policy, request, views, self.config)
        if decision is None:
            return RouteDecision(())
        by_name = {r.name: r for r in up}
        estimates = {
            name: e.ttft_s for name, e in decision.estimates.items() if e.ttft_s is not None
        }
        prefix = {n: e.prefix_s for n, e in decision.estimates.items() if e.prefix_s is not None}
        return RouteDecision([by_name[n] for n in decision.order], estimates, prefix)

    def _cost(self, replica: Replica) -> CostModel:
        """The replica's cost model, rebuilt only when it reported new figures."""
        state = replica.state
        cached = self._costs.get(replica.name)
        if cached is None or cached[0] != replica.version:
            model = cost_model_from_snapshot(state.get("prefill"), state.get("tiers") or {})
            cached = self._costs[replica.name] = (replica.version, model)
        return cached[1]


def _keys(namespace: Namespace | None, tokens: list[int] | None) -> list[BlockHash]:
    if namespace is None or not tokens:
        return []
    return block_keys(namespace, tokens)
