"""Issue 7, part 6: isolation. Two tenants with identical prompts (so identical block keys):
neither can read, overwrite, delete or even detect the other's blocks, through the real HTTP
server, through ``RemoteTier`` and through two engines sharing one store.

"Detect" is checked as equality: every answer another tenant gets about a stored key is the
same, status and body, as its answer about a key nobody stored.

Figure: ``cross_tenant_reads`` (blocks or facts one tenant got of another's; any one also
fails its test).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from cachetier.engine.llm import LLM
from cachetier.engine.sampling import SamplingParams
from cachetier.primitives.keys import Namespace
from cachetier.protocol.http_batch import (
    BATCH_MEDIA_TYPE,
    RECORD_MEDIA_TYPE,
    BatchReader,
    batch_parts,
)
from cachetier.record import KVBlock, encode_record
from cachetier.store.tiered import TieredStore
from cachetier.tiers.disk.tier import DiskTier, DiskTierConfig
from cachetier.tiers.redis import RedisTier, RedisTierConfig
from cachetier.tiers.remote import RemoteTier, RemoteTierConfig
from tests.server.live import TOKENS, ThreadServer, call, test_config
from tests.support import SMALL_LAYOUT, make_blocks

PROMPT_NS = Namespace("isolation-model", SMALL_LAYOUT)
NUM_BLOCKS = 6
GREEDY = SamplingParams(temperature=0, max_tokens=8)
PROMPT = [(i * 13 + 5) % 250 for i in range(150)]  # 9 full blocks of 16 and a partial one


class Leaks:
    """What one tenant learned of another's blocks; added to the figures when the test ends."""

    def __init__(self) -> None:
        self.found: list[str] = []

    def check(self, ok: bool, what: str, num_blocks: int = 1) -> None:
        if not ok:
            self.found.extend([what] * num_blocks)


@pytest.fixture
def leaks(fault_figures) -> Iterator[Leaks]:
    seen = Leaks()
    yield seen
    fault_figures.add("cross_tenant_reads", len(seen.found))


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ThreadServer]:
    running = ThreadServer(test_config(tmp_path_factory.mktemp("isolation"))).start()
    yield running
    running.stop()


def same_prompt_blocks(seed: int) -> tuple[list[KVBlock], list[KVBlock]]:
    """Alice's blocks, and bob's of the same prompt: the same keys with other payloads (so an
    overwrite would show)."""
    alice = make_blocks(PROMPT_NS, NUM_BLOCKS, seed=seed)
    payloads = make_blocks(PROMPT_NS, NUM_BLOCKS, seed=seed + 1000)
    bob = [
        KVBlock(a.key, a.fingerprint, a.dtype, a.shape, a.num_tokens, p.data)
        for a, p in zip(alice, payloads)
    ]
    assert [b.key for b in bob] == [a.key for a in alice]
    return alice, bob


def frame(blocks: list[KVBlock]) -> bytes:
    parts, _ = batch_parts([[encode_record(b)] for b in blocks])
    return b"".join(bytes(p) for p in parts)


def unframe(body: bytes) -> list[bytes | None]:
    reader = BatchReader(max_records=1024, max_record_bytes=1 << 24, max_batch_bytes=1 << 26)
    reader.feed(body)
    return [None if r is None else bytes(r) for r in reader.finish()]


class Client:
    """One tenant's raw HTTP calls to one namespace of the server."""

    def __init__(self, server: ThreadServer, tenant: str, namespace: str) -> None:
        self.url = server.url
        self.token = TOKENS[tenant]
        self.base = f"/v1/namespaces/{namespace}"

    def ask(self, method: str, path: str, body: object = None) -> tuple[int, bytes]:
        """A call; a ``list`` body is sent as ``{"keys": [...hex]}``."""
        content_type = None
        if isinstance(body, list):
            body = json.dumps({"keys": [k.hex() for k in body]}).encode()
            content_type = "application/json"
        elif isinstance(body, bytes):
            content_type = BATCH_MEDIA_TYPE if path == "/batch/put" else RECORD_MEDIA_TYPE
        status, _, answer = call(
            self.url, method, self.base + path, body, token=self.token, content_type=content_type
        )
        return status, answer

    def put(self, blocks: list[KVBlock]) -> None:
        first, rest = blocks[0], blocks[1:]
        status, answer = self.ask("PUT", f"/blocks/{first.key.hex()}", encode_record(first))
        assert status == 200, answer
        status, answer = self.ask("POST", "/batch/put", frame(rest))
        assert status == 200, answer

    def records(self, blocks: list[KVBlock]) -> list[bytes | None]:
        status, answer = self.ask("POST", "/batch/get", [b.key for b in blocks])
        assert status == 200, answer
        return unframe(answer)


def every_view(client: Client, keys: list) -> list[tuple[str, int, bytes]]:
    """Every read-only answer a tenant can get about ``keys``: status and body of each."""
    views = []
    for path in ("/lookup", "/batch/exists", "/batch/get"):
        views.append((path, *client.ask("POST", path, keys)))
    for key in keys[:2]:
        for method in ("GET", "HEAD"):
            views.append((f"{method} one", *client.ask(method, f"/blocks/{key.hex()}")))
    return views


@pytest.mark.parametrize("bob_namespace", ["same", "alice's storage name"])
def test_same_prompts_over_http(leaks: Leaks, server: ThreadServer, bob_namespace: str) -> None:
    alice_blocks, bob_blocks = same_prompt_blocks(seed=1 if bob_namespace == "same" else 2)
    stored = [b.key for b in alice_blocks]
    unstored = [b.key for b in make_blocks(PROMPT_NS, NUM_BLOCKS, seed=99)]
    alice = Client(server, "alice", PROMPT_NS.id)
    # The second form names alice's storage namespace outright (t.<tenant>.<namespace>).
    bob = Client(
        server, "bob", PROMPT_NS.id if bob_namespace == "same" else f"t.alice.{PROMPT_NS.id}"
    )
    alice.put(alice_blocks)
    originals = [encode_record(b) for b in alice_blocks]
    assert alice.records(alice_blocks) == originals

    # Read or detect: bob's answers about alice's keys equal those about keys nobody stored.
    for (what, status, body), (_, fresh_status, fresh_body) in zip(
        every_view(bob, stored), every_view(bob, unstored)
    ):
        leaks.check((status, body) == (fresh_status, fresh_body), f"bob tells apart: {what}")
        leaks.check(
            not any(r in body for r in originals), f"bob read alice's block: {what}", NUM_BLOCKS
        )
    # Delete: bob's deletes and clears answer as for nothing stored, and remove nothing of hers.
    for (status, body), (fresh_status, fresh_body) in [
        (
            bob.ask("DELETE", f"/blocks/{stored[0].hex()}"),
            bob.ask("DELETE", f"/blocks/{unstored[0].hex()}"),
        ),
        (bob.ask("POST", "/batch/delete", stored), bob.ask("POST", "/batch/delete", unstored)),
    ]:
        leaks.check((status, body) == (fresh_status, fresh_body), "bob's delete tells apart")
    assert bob.ask("DELETE", "")[1] == b'{"num_deleted":0}'
    leaks.check(alice.records(alice_blocks) == originals, "bob deleted alice's blocks")
    # Overwrite: bob's puts of the same keys land in his own storage.
    bob.put(bob_blocks)
    assert bob.records(bob_blocks) == [encode_record(b) for b in bob_blocks], "bob's puts work"
    got = alice.records(alice_blocks)
    leaks.check(got == originals, "bob overwrote alice's blocks", NUM_BLOCKS)
    # And bob's deletes now take his own blocks only.
    assert json.loads(bob.ask("POST", "/batch/delete", stored)[1]) == {"num_deleted": NUM_BLOCKS}
    assert bob.ask("DELETE", "")[0] == 200
    leaks.check(alice.records(alice_blocks) == originals, "bob deleted alice's blocks")
    assert not leaks.found, leaks.found


def test_stats_tell_a_tenant_only_its_own(leaks: Leaks, server: ThreadServer) -> None:
    alice_blocks, _ = same_prompt_blocks(seed=3)
    alice = Client(server, "alice", PROMPT_NS.id)
    ops = {"Authorization": f"Bearer {TOKENS['ops']}"}

    def stats(tenant: str) -> dict:
        status, _, body = call(server.url, "GET", "/v1/stats", token=TOKENS[tenant])
        assert status == 200, body
        return json.loads(body)

    before = stats("bob")
    alice.put(alice_blocks)
    alice.records(alice_blocks)
    after = stats("bob")
    leaks.check(set(after["tenants"]) == {"bob"}, "bob's stats name other tenants")
    leaks.check(after["tiers"] is None, "bob's stats show the server's tiers")
    leaks.check(before == after, "bob's stats moved with alice's requests")
    leaks.check(call(server.url, "GET", "/metrics", token=TOKENS["bob"])[0] == 403, "metrics")
    # An admin tenant does see everyone: the stats above are not empty by accident.
    admin = json.loads(call(server.url, "GET", "/v1/stats", headers=ops)[2])
    assert {"alice", "bob"} <= set(admin["tenants"]) and admin["tenants"]["alice"]["puts"] > 0
    assert not leaks.found, leaks.found


@pytest.fixture
def remote(server: ThreadServer) -> Iterator[Callable[..., RemoteTier]]:
    opened: list[RemoteTier] = []

    def make(tenant: str, claim: str | None = None) -> RemoteTier:
        tier = RemoteTier(RemoteTierConfig(url=server.url, token=TOKENS[tenant], tenant=claim))
        opened.append(tier)
        return tier

    yield make
    for tier in opened:
        tier.close()


def test_same_prompts_through_remote_tiers(leaks: Leaks, remote: Callable[..., RemoteTier]) -> None:
    alice_blocks, bob_blocks = same_prompt_blocks(seed=4)
    keys = [b.key for b in alice_blocks]
    unstored = [b.key for b in make_blocks(PROMPT_NS, NUM_BLOCKS, seed=98)]
    alice, bob, bob_as_alice = remote("alice"), remote("bob"), remote("bob", claim="alice")
    ns = PROMPT_NS.id
    assert alice.put_many(ns, alice_blocks) == NUM_BLOCKS
    originals = [bytes(b.data) for b in alice_blocks]

    def datas(tier: RemoteTier) -> list[bytes | None]:
        return [None if b is None else bytes(b.data) for b in tier.get_many(ns, keys)]

    for tier, who in [(bob, "bob"), (bob_as_alice, "bob claiming alice")]:
        got = datas(tier)
        leaks.check(got == [None] * NUM_BLOCKS, f"{who} read alice's blocks", NUM_BLOCKS)
        leaks.check(tier.lookup(ns, keys) == tier.lookup(ns, unstored), f"{who} lookup differs")
        leaks.check(tier.contains_prefix(ns, keys) == 0, f"{who} sees alice's prefix")
    assert bob.put_many(ns, bob_blocks) == NUM_BLOCKS
    assert datas(bob) == [bytes(b.data) for b in bob_blocks], "bob's own puts work"
    leaks.check(datas(alice) == originals, "bob overwrote alice's blocks", NUM_BLOCKS)
    assert bob.delete(ns, keys) == NUM_BLOCKS  # his own
    bob.clear(ns)
    bob_as_alice.delete(ns, keys)
    bob_as_alice.clear(ns)
    leaks.check(datas(alice) == originals, "bob deleted alice's blocks", NUM_BLOCKS)
    assert not leaks.found, leaks.found


def shared_store(kind: str, tmp_path: Path, redis_url: str, redis_prefix: str) -> TieredStore:
    if kind == "disk":
        tier = DiskTier(
            DiskTierConfig(str(tmp_path / "disk"), capacity_bytes=64 << 20, fsync=False)
        )
    else:
        tier = RedisTier(RedisTierConfig(url=redis_url, key_prefix=redis_prefix))
    return TieredStore([tier])


@pytest.mark.slow(reason="starts three tiny-model engines in turn on a shared disk or Redis store")
@pytest.mark.parametrize("kind", ["disk", "redis"])
def test_engines_of_two_tenants_share_a_store_not_blocks(
    leaks: Leaks,
    tiny_model_dir: Path,
    tmp_path: Path,
    request: pytest.FixtureRequest,
    kind: str,
) -> None:
    redis_url = redis_prefix = ""
    if kind == "redis":
        redis_url = request.getfixturevalue("redis_url")
        redis_prefix = request.getfixturevalue("redis_prefix")
    store = shared_store(kind, tmp_path, redis_url, redis_prefix)
    try:
        outputs = {}
        for name, tenant in [("a", "a"), ("b", "b"), ("a again", "a")]:
            with LLM(
                tiny_model_dir, store=store, kv_cache_bytes=4 << 20, tenant=tenant, guard=False
            ) as llm:
                outputs[name] = llm.generate([PROMPT], GREEDY)[0]
    finally:
        store.close()
    b = outputs["b"]
    leaks.check(b.num_cached_tokens == 0, "tenant b restored a's blocks", b.num_cached_tokens // 16)
    # The store did hold a's blocks: a new engine of tenant a restores them.
    assert outputs["a again"].cached_tokens_by_source == {kind: 144}
    assert b.token_ids == outputs["a"].token_ids == outputs["a again"].token_ids
    assert not leaks.found, leaks.found


@pytest.mark.slow(reason="starts three tiny-model engines in turn behind a live server")
def test_engines_with_the_same_keys_behind_the_server(
    leaks: Leaks, tiny_model_dir: Path, server: ThreadServer
) -> None:
    # Both engines use tenant "" (identical keys): only the server's tokens keep them apart.
    outputs = {}
    for name, tenant in [("alice", "alice"), ("bob", "bob"), ("alice again", "alice")]:
        store = TieredStore([RemoteTier(RemoteTierConfig(url=server.url, token=TOKENS[tenant]))])
        try:
            with LLM(tiny_model_dir, store=store, kv_cache_bytes=4 << 20, guard=False) as llm:
                outputs[name] = llm.generate([PROMPT], GREEDY)[0]
        finally:
            store.close()
    bob = outputs["bob"]
    leaks.check(
        bob.num_cached_tokens == 0, "bob restored alice's blocks", bob.num_cached_tokens // 16
    )
    assert outputs["alice again"].cached_tokens_by_source == {"remote": 144}
    assert bob.token_ids == outputs["alice"].token_ids
    assert not leaks.found, leaks.found
