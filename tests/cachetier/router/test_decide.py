"""The router's policy over real replica figures: views built from a real engine server's
``/v1/fleet/state``, holdings from the prefix index, and each policy's order. The replica that
holds the prompt's blocks wins under ``tier_aware`` until its queue costs more than the
recompute it saves; ``pool_only`` sees only pools; ``round_robin`` turns."""

from __future__ import annotations

import json

import pytest

from cachetier.kvindex import PrefixIndex
from cachetier.primitives.keys import KVLayout, Namespace, block_keys
from cachetier.router.decide import FleetDecider
from cachetier.router.replicas import Replica
from tests.engine.server.live import EngineServer, get, post

TOKENS = [(i * 17 + 9) % 250 for i in range(16 * 12 + 3)]


@pytest.fixture(scope="module")
def state(replica: EngineServer) -> dict:
    """A real replica's state, after a prompt so that its prefill is measured."""
    post(replica.url, "/v1/completions", {"prompt": TOKENS, "max_tokens": 1, "temperature": 0})
    return json.loads(get(replica.url, "/v1/fleet/state")[1])


def _replicas(state: dict, n: int = 3) -> list[Replica]:
    namespace = Namespace("router-test", KVLayout("float32", 16, 2, 2, 16))
    out = []
    for i in range(n):
        r = Replica(f"r{i}", f"http://replica-{i}", up=True, state=dict(state), version=1)
        r.namespace = namespace
        out.append(r)
    return out


def test_tier_aware_sends_a_prompt_where_its_blocks_are(state: dict) -> None:
    replicas = _replicas(state)
    index = PrefixIndex()
    keys = block_keys(replicas[0].namespace, TOKENS)
    index.apply("r2", 1, 0, [("stored", "gpu", keys)])  # r2's pool holds all 12 blocks
    decision = FleetDecider("tier_aware", index)(TOKENS, None, replicas)
    assert decision.order[0].name == "r2"
    assert set(decision.estimates) == {"r0", "r1", "r2"}
    assert decision.estimates["r2"] < decision.estimates["r0"] == decision.estimates["r1"]
    assert decision.work_s["r2"] < decision.work_s["r0"]


def test_a_loaded_holder_loses_to_an_idle_replica_past_the_bound(state: dict) -> None:
    replicas = _replicas(state)
    index = PrefixIndex()
    index.apply("r2", 1, 0, [("stored", "gpu", block_keys(replicas[0].namespace, TOKENS))])
    replicas[2].in_flight, replicas[2].pending_s = 6, 60.0  # a queue of a minute
    decision = FleetDecider("tier_aware", index)(TOKENS, None, replicas)
    assert decision.order[0].name != "r2" and decision.order[-1].name == "r2"


def test_pool_only_sees_pools_and_round_robin_turns(state: dict) -> None:
    replicas = _replicas(state)
    index = PrefixIndex()
    keys = block_keys(replicas[0].namespace, TOKENS)
    index.apply("r1", 1, 0, [("stored", "disk", keys)])
    index.apply("r0", 1, 0, [("stored", "gpu", keys[:2])])
    assert FleetDecider("pool_only", index)(TOKENS, None, replicas).order[0].name == "r0"
    turns = FleetDecider("round_robin", index)
    assert [turns(TOKENS, None, replicas).order[0].name for _ in range(4)] == [
        "r0",
        "r1",
        "r2",
        "r0",
    ]


def test_no_replica_up_and_an_untokenized_prompt(state: dict) -> None:
    decide = FleetDecider("tier_aware", PrefixIndex())
    assert list(decide([1, 2, 3], None, []).order) == []
    replicas = _replicas(state, 2)
    assert [r.name for r in decide(None, "s", replicas).order] == ["r0", "r1"]
