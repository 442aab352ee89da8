"""``GET /v1/fleet/state``: a router reads this replica's load, its measured rates and the
namespace its block keys are chained from. Behind the API key like every /v1 route."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

from cachetier.kvevents import KVEventSubscriber, SubscriberConfig
from cachetier.kvevents.held import key_digest
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


def _digest_of_listed(server: EngineServer, medium: str) -> tuple[int, str]:
    status, raw = get(server.url, f"/v1/fleet/blocks?medium={medium}")
    assert status == 200
    listed = json.loads(raw)
    assert listed["medium"] == medium and not listed["truncated"]
    count, acc = key_digest(bytes.fromhex(k) for k in listed["keys"])
    return count, f"{acc:016x}"


def test_the_digests_describe_the_listed_blocks_of_pool_and_tiers(
    make_server: Callable[..., EngineServer], tmp_path: Path
) -> None:
    """What a router's index reconciles against: per medium, a digest in the state and the
    keys behind it."""
    store = StoreConfig(cpu_bytes=1 << 20, disk_path=str(tmp_path / "disk"), fsync=False)
    server = make_server(store=store, kv_events=True)
    post(server.url, "/v1/completions", {"prompt": PROMPT, "max_tokens": 2, "temperature": 0})
    deadline = time.monotonic() + 10
    while True:  # the disk tier is written in the background
        state = json.loads(get(server.url, "/v1/fleet/state")[1])
        digest = state["kv_digest"]
        if digest.get("disk", {}).get("count") == 2 or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert set(digest) == {"GPU", "cpu", "disk"}
    assert {medium: d["count"] for medium, d in digest.items()} == {"GPU": 2, "cpu": 2, "disk": 2}
    for medium, d in digest.items():
        assert _digest_of_listed(server, medium) == (d["count"], d["xor"])
    assert state["kv_events"]["num_dropped_events"] == 0
    assert _digest_of_listed(server, "redis") == (0, f"{0:016x}")  # a medium it does not hold


def test_blocks_are_listed_only_where_events_are_published_and_within_bounds(
    make_server: Callable[..., EngineServer],
) -> None:
    plain = make_server()
    status, raw = get(plain.url, "/v1/fleet/blocks?medium=GPU")
    assert status == 404 and "--kv-events" in json.loads(raw)["error"]["message"]
    server = make_server(kv_events=True)
    assert get(server.url, "/v1/fleet/blocks")[0] == 400  # the medium is required
    assert get(server.url, "/v1/fleet/blocks?medium=GPU&limit=0")[0] == 400
    assert get(server.url, f"/v1/fleet/blocks?medium={'x' * 65}")[0] == 400
