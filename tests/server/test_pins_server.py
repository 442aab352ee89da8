"""Pins on a live sidecar: who may pin, the bound, stats and metrics, a restart, a flood."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from benchmarks.ops.pins import flood_pinned_chain, flood_then_switch_pods
from cachetier.primitives.keys import Namespace, block_keys
from tests.server.batches import ALICE, put_batch
from tests.server.live import TOKENS, ThreadServer, call, call_json, test_config
from tests.support import PrivateRedis, make_blocks

BOB, OPS = TOKENS["bob"], TOKENS["ops"]


def _pin_body(namespace: Namespace, blocks: list, **extra: object) -> dict:
    return {"namespace": namespace.id, "keys": [b.key.hex() for b in blocks], **extra}


def test_a_pinned_chain_survives_a_flood_past_capacity_and_a_restart(
    make_server: Callable[..., ThreadServer],
) -> None:
    server = make_server(cpu_bytes=2 << 20, disk_bytes=4 << 20)
    result = flood_pinned_chain(server.url, server.restart, capacity_bytes=6 << 20)
    assert result["flood_over_capacity"] >= 4
    assert result["pinned_blocks"] == result["pinned_chain_blocks"] == 8
    assert result["pinned_blocks_restored_after_flood"] == result["pinned_blocks"]
    assert result["unpinned_blocks_restored_after_flood"] == 0  # the flood did evict
    assert result["pins_listed_after_restart"] == 8
    assert result["tier_pins"]["disk"]["pinned_blocks"] == 8


def test_a_pinned_chain_is_restored_from_redis_after_cpu_and_disk_lost_it(
    redis_url: str, redis_prefix: str, tmp_path: Path
) -> None:
    config = test_config(
        tmp_path / "server",
        cpu_bytes=2 << 20,
        disk_bytes=4 << 20,
        redis_url=redis_url,
        redis_key_prefix=redis_prefix,
        redis_bytes=4 << 20,
    )
    # The read back goes through another pod whose CPU tier and disk folder start empty, with
    # no pin file: only the pins Redis keeps itself protected the chain there.
    result = flood_then_switch_pods(config, tmp_path / "other-pod")
    assert result["pinned_blocks"] == 8  # protected in cpu, disk and redis alike
    assert result["pinned_blocks_restored_after_flood"] == 8
    assert result["unpinned_blocks_restored_after_flood"] == 0  # Redis evicted that one
    assert result["pins_listed_after_restart"] == 0  # the other pod has no pin file
    assert result["tier_pins"]["redis"]["pinned_blocks"] == 8


def test_a_pin_is_answered_503_while_redis_is_down(
    make_server: Callable[..., ThreadServer], own_namespace: Namespace, tmp_path: Path
) -> None:
    redis = PrivateRedis(tmp_path / "redis")
    redis.folder.mkdir()
    redis.start()
    try:
        blocks = make_blocks(own_namespace, 2)
        server = make_server(redis_url=redis.url, redis_bytes=1 << 20)
        put_batch(server.url, own_namespace.id, blocks)
        redis.stop()
        status, answer = call_json(
            server.url, "POST", "/v1/pins", _pin_body(own_namespace, blocks), token=ALICE
        )
        assert status == 503 and answer["error"] == "tier_unavailable", answer
        assert "redis tier could not pin" in answer["message"]
        _, listing = call_json(server.url, "GET", "/v1/pins", token=OPS)
        assert listing["pins"] == [] and listing["tiers"]["cpu"]["pinned_keys"] == 0
    finally:
        redis.stop()


def test_a_tenant_pins_its_own_blocks_and_no_one_else_s(
    make_server: Callable[..., ThreadServer], own_namespace: Namespace
) -> None:
    server = make_server()
    url = server.url
    blocks = make_blocks(own_namespace, 3)
    put_batch(url, own_namespace.id, blocks)
    body = _pin_body(own_namespace, blocks)
    assert call_json(url, "POST", "/v1/pins", body)[0] == 401  # no token
    assert call_json(url, "POST", "/v1/pins", body, token="not-a-token-at-all-x")[0] == 401
    status, answer = call_json(url, "POST", "/v1/pins", {**body, "tenant": "alice"}, token=BOB)
    assert status == 403 and "admin" in answer["message"]
    status, answer = call_json(url, "POST", "/v1/pins", body, token=ALICE)
    assert status == 200, answer
    assert answer["tenant"] == "alice" and answer["num_new"] == 3
    assert answer["protected"] == {"cpu": 3, "disk": 3}
    # bob's pins of the same keys are his own namespace's: nothing of alice's is listed.
    assert call_json(url, "GET", "/v1/pins", token=BOB)[1]["pins"] == []
    assert call_json(url, "GET", "/v1/pins?tenant=alice", token=BOB)[0] == 403
    status, mine = call_json(url, "GET", "/v1/pins", token=ALICE)
    assert status == 200 and mine["tiers"] is None  # tier figures are for admins
    assert mine["pins"] == [
        {"tenant": "alice", "namespace": own_namespace.id, "keys": body["keys"]}
    ]
    # An admin may pin for alice (and unpin); it lands in alice's namespace.
    more = make_blocks(own_namespace, 5)[3:]
    status, answer = call_json(
        url, "POST", "/v1/pins", {**_pin_body(own_namespace, more), "tenant": "alice"}, token=OPS
    )
    assert status == 200 and answer["tenant"] == "alice" and answer["protected"]["cpu"] == 0
    _, listing = call_json(url, "GET", "/v1/pins", token=OPS)
    assert [len(p["keys"]) for p in listing["pins"] if p["tenant"] == "alice"] == [5]
    assert listing["tiers"]["cpu"]["pinned_keys"] == 5
    assert listing["tiers"]["cpu"]["pinned_waiting"] == 2  # pinned before they arrive
    status, answer = call_json(url, "POST", "/v1/pins/delete", body, token=ALICE)
    assert status == 200 and answer == {"num_unpinned": 3}
    assert call_json(url, "POST", "/v1/pins", {**body, "tenant": "nobody"}, token=OPS)[0] == 404


def test_a_pin_past_the_bound_is_refused_with_409(
    make_server: Callable[..., ThreadServer], own_namespace: Namespace
) -> None:
    blocks = make_blocks(own_namespace, 4)
    server = make_server(cpu_bytes=8 * blocks[0].nbytes, max_pinned_fraction=0.25)
    put_batch(server.url, own_namespace.id, blocks)
    status, answer = call_json(
        server.url, "POST", "/v1/pins", _pin_body(own_namespace, blocks[:3]), token=ALICE
    )
    assert status == 409 and answer["error"] == "pin_limit"
    assert "cpu tier" in answer["message"] and "max_pinned_fraction" in answer["message"]
    _, listing = call_json(server.url, "GET", "/v1/pins", token=OPS)
    assert listing["pins"] == [] and listing["tiers"]["disk"]["pinned_keys"] == 0
    status, _ = call_json(
        server.url, "POST", "/v1/pins", _pin_body(own_namespace, blocks[:2]), token=ALICE
    )
    assert status == 200


def test_token_ids_pin_the_chain_of_keys_of_the_prompt(
    make_server: Callable[..., ThreadServer], own_namespace: Namespace
) -> None:
    server = make_server()
    tokens = list(range(7, 7 + 2 * own_namespace.block_size + 3))
    body = {"namespace": own_namespace.id, "token_ids": tokens, "block_size": 16}
    status, answer = call_json(server.url, "POST", "/v1/pins", body, token=ALICE)
    assert status == 200
    assert answer["keys"] == [k.hex() for k in block_keys(own_namespace, tokens)]
    for bad, code in [
        ({**body, "namespace": "not-a-fingerprint"}, 400),  # no root for the chain
        ({k: v for k, v in body.items() if k != "block_size"}, 400),
        ({**body, "keys": answer["keys"]}, 400),  # both
        ({"namespace": own_namespace.id}, 400),  # neither
        ({**body, "token_ids": [-1] * 16}, 422),
        ({**body, "block_size": 0}, 422),
        ({**body, "surprise": 1}, 422),
        ({**body, "token_ids": tokens[:5]}, 400),  # no full block
        ({**body, "namespace": "../etc"}, 400),
    ]:
        status, answer = call_json(server.url, "POST", "/v1/pins", bad, token=ALICE)
        assert status == code, (bad, answer)
        assert answer["message"]
    too_many = {**body, "token_ids": [1] * 16 * 257}  # max_keys is 256 in test_config
    assert call_json(server.url, "POST", "/v1/pins", too_many, token=ALICE)[0] == 413


def test_pins_are_counted_in_stats_and_metrics(
    make_server: Callable[..., ThreadServer], own_namespace: Namespace
) -> None:
    server = make_server()
    blocks = make_blocks(own_namespace, 4)
    put_batch(server.url, own_namespace.id, blocks)
    call_json(server.url, "POST", "/v1/pins", _pin_body(own_namespace, blocks[:3]), token=ALICE)
    _, mine = call_json(server.url, "GET", "/v1/stats", token=ALICE)
    assert mine["tenants"]["alice"]["pinned_keys"] == 3
    _, ops = call_json(server.url, "GET", "/v1/stats", token=OPS)
    assert ops["tiers"]["cpu"]["pinned_blocks"] == 3
    assert ops["tiers"]["cpu"]["pinned_bytes"] == 3 * blocks[0].nbytes
    status, _, text = call(server.url, "GET", "/metrics", token=OPS)
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text.decode())
        for s in family.samples
    }
    assert samples[("cachetier_tier_pinned_blocks", (("tier", "disk"),))] == 3
    assert samples[("cachetier_tier_pinned_bytes", (("tier", "cpu"),))] == 3 * blocks[0].nbytes
    assert samples[("cachetier_tier_max_pinned_bytes", (("tier", "cpu"),))] > 0
