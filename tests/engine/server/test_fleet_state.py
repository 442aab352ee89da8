"""``GET /v1/fleet/state``: a router reads this replica's load, its measured rates and the
namespace its block keys are chained from. Behind the API key like every /v1 route."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

from cachetier.kvevents import KVEventSubscriber, SubscriberConfig
from cachetier.primitives.fingerprint import model_fingerprint
from cachetier.primitives.keys import KVLayout, Namespace, block_keys
from cachetier.store.config import StoreConfig
from tests.engine.server.live import EngineServer, get, post

PROMPT = [(i * 13 + 1) % 250 for i in range(40)]


def test_a_router_reads_load_rates_and_the_namespace(
    make_server: Callable[..., EngineServer], tmp_path: Path
) -> None:
    store = StoreConfig(cpu_bytes=1 << 20, disk_path=str(tmp_path / "disk"), fsync=False)
    server = make_server(store=store, engine_args={"tenant": "blue"})
    post(server.url, "/v1/completions", {"prompt": PROMPT, "max_tokens": 2, "temperature": 0})
    status, raw = get(server.url, "/v1/fleet/state")
    state = json.loads(raw)
    assert status == 200 and state["object"] == "fleet.state"
    assert state["model"] == "tiny" and state["num_in_flight"] == 0
    assert state["num_running"] == 0 and state["max_num_seqs"] > 0
    assert state["prefill"] is not None
    ns = state["namespace"]
    namespace = Namespace(ns["model_fingerprint"], KVLayout(**ns["layout"]), ns["tenant"])
    # The parts the engine chains its keys from (``LLMEngine.namespace``).
    assert namespace.model_fingerprint == model_fingerprint(server.config.model)
    assert (namespace.tenant, namespace.layout.block_size) == ("blue", 16)


def test_without_tiers_the_pools_keys_are_still_named_and_the_key_is_asked(
    make_server: Callable[..., EngineServer],
) -> None:
    plain = make_server()
    state = json.loads(get(plain.url, "/v1/fleet/state")[1])
    assert state["namespace"]["layout"]["block_size"] == 16 and state["kv_events"] is None
    locked = make_server(api_key="k-123")
    assert get(locked.url, "/v1/fleet/state")[0] == 401


def test_the_pools_blocks_are_published_as_kv_events(
    make_server: Callable[..., EngineServer],
) -> None:
    server = make_server(kv_events=True)
    state = json.loads(get(server.url, "/v1/fleet/state")[1])
    where = state["kv_events"]
    config = SubscriberConfig(where["endpoint"], where["replay_endpoint"])
    with KVEventSubscriber(config) as events:
        post(server.url, "/v1/completions", {"prompt": PROMPT, "max_tokens": 2})
        ns = state["namespace"]
        namespace = Namespace(ns["model_fingerprint"], KVLayout(**ns["layout"]), ns["tenant"])
        stored: set[bytes] = set()
        deadline = time.monotonic() + 10
        while len(stored) < 2 and time.monotonic() < deadline:
            for delivery in events.receive(timeout_s=0.2):  # replayed from 0: none is missed
                assert delivery.epoch == where["epoch"]
                for kind, medium, keys in delivery.batch.changes():
                    if kind == "stored" and medium == "GPU":
                        stored.update(bytes(k) for k in keys)
    assert stored == {bytes(k) for k in block_keys(namespace, PROMPT)}  # 40 tokens: 2 blocks
