"""Quarantines on a live sidecar: a client's guard shares the writer it found bad, whose
records every client then misses, tenants see and touch only their own, and an admin lifts
them."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from prometheus_client.parser import text_string_to_metric_families

from cachetier.primitives.keys import Namespace
from cachetier.record import KVBlock, writer_name
from cachetier.record.writer import start_new_writer
from cachetier.store.tiered import TieredStore
from cachetier.tiers.remote import RemoteTier
from tests.server.live import TOKENS, ThreadServer, call, call_json
from tests.support import make_blocks

ALICE, BOB, OPS = TOKENS["alice"], TOKENS["bob"], TOKENS["ops"]


def _swapped(block: KVBlock) -> KVBlock:
    values = np.frombuffer(block.data, dtype=block.dtype).reshape(block.shape)
    data = np.ascontiguousarray(values[:, ::-1]).tobytes()
    return KVBlock(block.key, block.fingerprint, block.dtype, block.shape, block.num_tokens, data)


def test_a_clients_guard_quarantines_the_bad_writer_for_every_client(
    shared_server: ThreadServer,
    make_remote: Callable[..., RemoteTier],
    own_namespace: Namespace,
) -> None:
    computed = make_blocks(own_namespace, 3)
    keys = [b.key for b in computed]
    bad = start_new_writer()  # the process that writes K where V belongs
    first = make_remote(shared_server.url)
    assert first.put_many(own_namespace.id, [_swapped(b) for b in computed]) == 3
    verdict = TieredStore([first]).verify(own_namespace.id, "remote", computed)
    assert verdict.quarantined and len(verdict.mismatches) == 3
    assert verdict.bad_writers == (writer_name(bad),)
    # Told the server: that writer's records are refused to every client as they are read.
    other = make_remote(shared_server.url)
    assert other.put_many(own_namespace.id, [_swapped(b) for b in computed]) == 3
    assert other.get_many(own_namespace.id, keys) == [None] * 3
    # Another writer's records of the same keys serve every client: not the whole namespace.
    start_new_writer()
    assert other.put_many(own_namespace.id, computed) == 3
    assert all(b is not None for b in other.get_many(own_namespace.id, keys))
    status, answer = call_json(shared_server.url, "GET", "/v1/quarantines", token=ALICE)
    assert status == 200
    mine = [q for q in answer["quarantines"] if q["namespace"] == own_namespace.id]
    assert {q["tier"] for q in mine} == {"cpu", "disk"} and mine[0]["tenant"] == "alice"
    assert {q["writer"] for q in mine} == {writer_name(bad)} and "layer" in mine[0]["reason"]
    # Only an admin lifts it.
    lift = {"namespace": own_namespace.id, "tenant": "alice"}
    assert call_json(shared_server.url, "POST", "/v1/quarantines/lift", lift, token=ALICE)[0] == 403
    status, lifted = call_json(shared_server.url, "POST", "/v1/quarantines/lift", lift, token=OPS)
    assert status == 200 and {q["tier"] for q in lifted["quarantines"]} == {"cpu", "disk"}


def test_a_tenant_quarantines_and_sees_only_its_own_namespaces(
    shared_server: ThreadServer, make_remote: Callable[..., RemoteTier], own_namespace: Namespace
) -> None:
    url = shared_server.url
    report = {"namespace": own_namespace.id, "reason": "K and V swapped"}
    assert call_json(url, "POST", "/v1/quarantines", report, token=BOB)[0] == 200
    # Bob's report named his own namespace: alice's of the same name is served as before.
    blocks = make_blocks(own_namespace, 2)
    alice = make_remote(url)
    assert alice.put_many(own_namespace.id, blocks) == 2
    assert alice.lookup(own_namespace.id, [b.key for b in blocks]).num_blocks == 2
    bob = make_remote(url, token_of="bob")
    assert bob.put_many(own_namespace.id, blocks) == 2
    assert bob.lookup(own_namespace.id, [b.key for b in blocks]).num_blocks == 0
    _, seen_by_alice = call_json(url, "GET", "/v1/quarantines", token=ALICE)
    assert own_namespace.id not in {q["namespace"] for q in seen_by_alice["quarantines"]}
    _, seen_by_ops = call_json(url, "GET", "/v1/quarantines", token=OPS)
    assert ("bob", own_namespace.id) in {
        (q["tenant"], q["namespace"]) for q in seen_by_ops["quarantines"]
    }
    lift = {"namespace": own_namespace.id, "tenant": "bob", "tier": "disk"}
    _, lifted = call_json(url, "POST", "/v1/quarantines/lift", lift, token=OPS)
    assert [q["tier"] for q in lifted["quarantines"]] == ["disk"]


def test_quarantine_requests_without_a_token_or_with_bad_input_are_refused(
    shared_server: ThreadServer,
) -> None:
    url = shared_server.url
    assert call_json(url, "POST", "/v1/quarantines", {"namespace": "x"})[0] == 401
    assert call_json(url, "GET", "/v1/quarantines")[0] == 401
    bad = {"namespace": "../etc", "reason": "x"}
    assert call_json(url, "POST", "/v1/quarantines", bad, token=ALICE)[0] in (400, 422)
    long_reason = {"namespace": "fine", "reason": "x" * 501}
    assert call_json(url, "POST", "/v1/quarantines", long_reason, token=ALICE)[0] == 422
    extra = {"namespace": "fine", "tier": "disk"}
    assert call_json(url, "POST", "/v1/quarantines", extra, token=ALICE)[0] == 422
    lift = {"namespace": "fine", "tenant": "nobody"}
    assert call_json(url, "POST", "/v1/quarantines/lift", lift, token=OPS)[0] == 404


def test_guard_counters_and_quarantines_are_metrics(
    shared_server: ThreadServer, own_namespace: Namespace
) -> None:
    url = shared_server.url
    report = {"namespace": own_namespace.id, "reason": "metrics"}
    assert call_json(url, "POST", "/v1/quarantines", report, token=ALICE)[0] == 200
    status, _, body = call(url, "GET", "/metrics", token=OPS)
    assert status == 200
    samples = {
        s.name: s.value
        for family in text_string_to_metric_families(body.decode())
        for s in family.samples
    }
    assert samples["cachetier_quarantines_held"] >= 2  # cpu and disk
    names = {f.name for f in text_string_to_metric_families(body.decode())}
    assert {"cachetier_guard_verified_blocks", "cachetier_guard_quarantined_lookups"} <= names
