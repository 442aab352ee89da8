"""The HTTP API against a real uvicorn server: binary put/get/exists of one block and of a
batch, prefix lookup, delete, clear, stats, metrics, OpenAPI, restart, Redis behind it."""

from __future__ import annotations

from collections.abc import Callable

import redis
from prometheus_client.parser import text_string_to_metric_families

from cachetier.primitives.keys import Namespace
from cachetier.protocol.http_batch import BATCH_MEDIA_TYPE
from cachetier.record import decode_record, encode_record
from tests.server.batches import ALICE, get_batch, put_batch
from tests.server.live import TOKENS, ThreadServer, call, call_json
from tests.support import make_blocks


def test_batch_put_then_get_returns_the_same_bytes(
    shared_server: ThreadServer, own_namespace: Namespace
) -> None:
    url, ns = shared_server.url, own_namespace.id
    blocks = make_blocks(own_namespace, 4)
    status, answer = put_batch(url, ns, blocks)
    assert status == 200 and answer["num_stored"] == 4 and answer["tiers"] == {"cpu": 4, "disk": 4}
    absent = make_blocks(own_namespace, 5, seed=9)[4]
    got = get_batch(url, ns, [b.key for b in blocks] + [absent.key])
    assert got[4] is None
    for block, back in zip(blocks, got[:4]):
        assert back is not None and bytes(back.data) == bytes(block.data)
        assert back.fingerprint == own_namespace.fingerprint and back.shape == block.shape


def test_one_block_put_get_head_delete(
    shared_server: ThreadServer, own_namespace: Namespace
) -> None:
    url, ns = shared_server.url, own_namespace.id
    block = make_blocks(own_namespace, 1)[0]
    path = f"/v1/namespaces/{ns}/blocks/{block.key.hex()}"
    assert call(url, "HEAD", path, token=ALICE)[0] == 404
    status, _, body = call(url, "GET", path, token=ALICE)
    assert status == 404 and b"not_found" in body
    record = encode_record(block)
    status, _, _ = call(
        url, "PUT", path, record, token=ALICE, content_type="application/octet-stream"
    )
    assert status == 200
    assert call(url, "HEAD", path, token=ALICE)[0] == 200
    status, headers, body = call(url, "GET", path, token=ALICE)
    assert status == 200 and body == record
    assert headers["content-type"] == "application/octet-stream"
    assert call_json(url, "DELETE", path, token=ALICE) == (200, {"num_deleted": 1})
    assert call(url, "HEAD", path, token=ALICE)[0] == 404


def test_lookup_counts_the_leading_run_and_names_tiers(
    make_server: Callable[..., ThreadServer], own_namespace: Namespace
) -> None:
    server = make_server()
    ns = own_namespace.id
    blocks = make_blocks(own_namespace, 6)
    put_batch(server.url, ns, blocks[:3] + blocks[4:])
    keys = {"keys": [b.key.hex() for b in blocks]}
    status, answer = call_json(server.url, "POST", f"/v1/namespaces/{ns}/lookup", keys, token=ALICE)
    assert status == 200
    assert answer == {
        "num_blocks": 3,
        "spans": [{"tier": "cpu", "start": 0, "end": 3}],
        "blocks_per_tier": {"cpu": 3},
    }
    server.restart()  # the CPU tier starts empty; the disk tier still has everything
    get_batch(server.url, ns, [blocks[0].key])  # promoted into the CPU tier
    _, answer = call_json(server.url, "POST", f"/v1/namespaces/{ns}/lookup", keys, token=ALICE)
    assert answer["num_blocks"] == 3
    assert answer["spans"] == [
        {"tier": "cpu", "start": 0, "end": 1},
        {"tier": "disk", "start": 1, "end": 3},
    ]


def test_exists_delete_and_clear(shared_server: ThreadServer, own_namespace: Namespace) -> None:
    url, ns = shared_server.url, own_namespace.id
    blocks = make_blocks(own_namespace, 4)
    other = Namespace(own_namespace.model_fingerprint + "-other", own_namespace.layout)
    other_blocks = make_blocks(other, 2)
    put_batch(url, ns, blocks[:3])
    put_batch(url, other.id, other_blocks)
    keys = {"keys": [b.key.hex() for b in blocks]}
    exists = f"/v1/namespaces/{ns}/batch/exists"
    assert call_json(url, "POST", exists, keys, token=ALICE) == (
        200,
        {"present": [True, True, True, False]},
    )
    one = {"keys": [blocks[0].key.hex()]}
    deleted = call_json(url, "POST", f"/v1/namespaces/{ns}/batch/delete", one, token=ALICE)
    assert deleted == (200, {"num_deleted": 1})
    assert call_json(url, "DELETE", f"/v1/namespaces/{ns}", token=ALICE) == (
        200,
        {"num_deleted": 2},
    )
    assert call_json(url, "POST", exists, keys, token=ALICE)[1]["present"] == [False] * 4
    assert all(get_batch(url, other.id, [b.key for b in other_blocks]))


def test_stats_per_tenant_and_per_tier(
    make_server: Callable[..., ThreadServer], own_namespace: Namespace
) -> None:
    server = make_server()
    blocks = make_blocks(own_namespace, 3)
    put_batch(server.url, own_namespace.id, blocks)
    get_batch(server.url, own_namespace.id, [b.key for b in blocks] + [bytes(32)])
    status, mine = call_json(server.url, "GET", "/v1/stats", token=ALICE)
    assert status == 200 and mine["tenant"] == "alice"
    assert set(mine["tenants"]) == {"alice"} and mine["tiers"] is None  # not an admin
    alice = mine["tenants"]["alice"]
    payload = sum(b.nbytes for b in blocks)
    assert (alice["puts"], alice["hits"], alice["misses"]) == (3, 3, 1)
    assert alice["bytes_in"] == payload and alice["bytes_out"] == payload
    _, ops = call_json(server.url, "GET", "/v1/stats", token=TOKENS["ops"])
    assert set(ops["tenants"]) == {"alice", "bob", "ops"} and ops["tenants"]["bob"]["puts"] == 0
    assert ops["tiers"]["cpu"]["hits"] == 3 and ops["tiers"]["cpu"]["used_bytes"] == payload
    assert ops["tiers"]["disk"]["puts"] == 3 and ops["tiers"]["disk"]["used_bytes"] > payload


def test_metrics_are_prometheus_text(
    make_server: Callable[..., ThreadServer], own_namespace: Namespace
) -> None:
    server = make_server()
    blocks = make_blocks(own_namespace, 2)
    put_batch(server.url, own_namespace.id, blocks)
    get_batch(server.url, own_namespace.id, [b.key for b in blocks])
    status, headers, body = call(server.url, "GET", "/metrics", token=TOKENS["ops"])
    assert status == 200 and headers["content-type"].startswith("text/plain")
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(body.decode())
        for s in family.samples
    }
    assert samples[("cachetier_tier_hits_total", (("tier", "cpu"),))] == 2
    assert samples[("cachetier_tier_puts_total", (("tier", "disk"),))] == 2
    # The cost model's inputs: measured on the real get above.
    assert samples[("cachetier_tier_read_bytes_per_second", (("tier", "cpu"),))] > 0
    assert ("cachetier_tier_latency_seconds", (("tier", "cpu"),)) in samples
    assert samples[("cachetier_tenant_bytes_out_total", (("tenant", "alice"),))] == sum(
        b.nbytes for b in blocks
    )
    route = "/v1/namespaces/{namespace}/batch/get"
    key = (
        "cachetier_http_requests_total",
        (("method", "POST"), ("route", route), ("status", "200")),
    )
    assert samples[key] == 1
    assert call(server.url, "GET", "/metrics", token=ALICE)[0] == 403  # admins only


def test_openapi_describes_the_binary_bodies(shared_server: ThreadServer) -> None:
    status, spec = call_json(shared_server.url, "GET", "/openapi.json")
    assert status == 200
    paths = spec["paths"]
    put = paths["/v1/namespaces/{namespace}/batch/put"]["post"]
    assert list(put["requestBody"]["content"]) == [BATCH_MEDIA_TYPE]
    get = paths["/v1/namespaces/{namespace}/batch/get"]["post"]
    assert list(get["requestBody"]["content"]) == ["application/json"]
    assert list(get["responses"]["200"]["content"]) == [BATCH_MEDIA_TYPE]
    one = paths["/v1/namespaces/{namespace}/blocks/{key}"]
    assert list(one["put"]["requestBody"]["content"]) == ["application/octet-stream"]
    assert list(one["get"]["responses"]["200"]["content"]) == ["application/octet-stream"]
    assert "content" not in one["head"]["responses"]["200"]
    for schema in (put["requestBody"]["content"][BATCH_MEDIA_TYPE]["schema"],):
        assert schema == {"type": "string", "contentMediaType": BATCH_MEDIA_TYPE}  # no base64
    assert spec["components"]["securitySchemes"]["HTTPBearer"]["scheme"] == "bearer"
    assert call(shared_server.url, "GET", "/healthz")[0] == 200  # no token needed


def test_blocks_on_disk_survive_a_restart(
    make_server: Callable[..., ThreadServer], own_namespace: Namespace
) -> None:
    server = make_server()
    blocks = make_blocks(own_namespace, 5)
    put_batch(server.url, own_namespace.id, blocks)
    server.restart()
    got = get_batch(server.url, own_namespace.id, [b.key for b in blocks])
    assert [bytes(g.data) for g in got if g] == [bytes(b.data) for b in blocks]


def test_background_writes_are_flushed_at_shutdown(
    make_server: Callable[..., ThreadServer], own_namespace: Namespace
) -> None:
    server = make_server(sync_puts=False)
    blocks = make_blocks(own_namespace, 40)
    for i in range(0, 40, 8):
        assert put_batch(server.url, own_namespace.id, blocks[i : i + 8])[1]["tiers"] == {"cpu": 8}
    server.restart()  # the lifespan's shutdown waits for the disk writer's queue
    assert all(get_batch(server.url, own_namespace.id, [b.key for b in blocks]))


def test_redis_behind_the_server(
    make_server: Callable[..., ThreadServer],
    own_namespace: Namespace,
    redis_url: str,
    redis_prefix: str,
) -> None:
    server = make_server(
        cpu_bytes=0, disk_bytes=0, redis_url=redis_url, redis_key_prefix=redis_prefix
    )
    blocks = make_blocks(own_namespace, 3)
    assert put_batch(server.url, own_namespace.id, blocks)[1]["tiers"] == {"redis": 3}
    client = redis.Redis.from_url(redis_url)
    try:
        stored = client.get(f"{redis_prefix}:t.alice.{own_namespace.id}:{blocks[0].key.hex()}")
    finally:
        client.close()
    assert stored is not None and decode_record(stored).key == blocks[0].key
    server.restart()
    got = get_batch(server.url, own_namespace.id, [b.key for b in blocks])
    assert [bytes(g.data) for g in got if g] == [bytes(b.data) for b in blocks]


def test_each_tenants_misses_are_counted_by_cause(
    make_server: Callable[..., ThreadServer], own_namespace: Namespace
) -> None:
    server = make_server()
    ns = own_namespace.id
    blocks = make_blocks(own_namespace, 4)
    put_batch(server.url, ns, blocks[:2])
    keys = {"keys": [b.key.hex() for b in blocks]}
    for _ in range(2):  # two blocks never stored, twice
        call_json(server.url, "POST", f"/v1/namespaces/{ns}/lookup", keys, token=ALICE)
    _, _, body = call(server.url, "GET", "/metrics", token=TOKENS["ops"])
    samples = {
        tuple(sorted(s.labels.items())): s.value
        for family in text_string_to_metric_families(body.decode())
        for s in family.samples
        if s.name == "cachetier_tenant_lookup_misses_total"
    }
    assert samples == {(("cause", "never_stored"), ("tenant", "alice"), ("tier", "")): 4}
