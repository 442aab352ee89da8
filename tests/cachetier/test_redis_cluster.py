"""RedisTier on a real Redis Cluster: three local masters, keys spread over them, one lost.

The cluster is the session's ``redis_cluster`` (``tests/cachetier/local_cluster.py``); the
shared tier suite runs on it too. Tests that stop a master wait for it to be healthy again.
"""

from __future__ import annotations

import signal
import threading
import time
import uuid
from collections.abc import Callable, Iterator

import pytest
from redis.cluster import RedisCluster
from redis.connection import Connection

from cachetier.primitives.keys import BlockHash, Namespace
from cachetier.record import KVBlock
from cachetier.tiers.redis import RedisTier, RedisTierConfig, parse_cluster_url
from tests.cachetier.local_cluster import NUM_MASTERS, LocalCluster
from tests.support import (
    FAST_FAIL,
    TIMEOUT_S,
    FakeClock,
    make_blocks,
    opened_redis_tiers,
    refusing_port,
)

MakeTier = Callable[..., RedisTier]


@pytest.fixture(scope="module")
def raw(redis_cluster: LocalCluster) -> Iterator[RedisCluster]:
    """A plain redis-py cluster client, to look at what the tier stored and where."""
    client = RedisCluster(host="127.0.0.1", port=redis_cluster.ports[0], socket_timeout=2)
    yield client
    client.close()


@pytest.fixture
def make_tier(redis_cluster: LocalCluster) -> Iterator[MakeTier]:
    """Builds tiers on the cluster under this test's own key prefix; closes them afterwards.

    Keys are not deleted: the cluster keeps nothing past this session.
    """
    prefix = f"cachetier-test-{uuid.uuid4().hex[:12]}"
    with opened_redis_tiers(url=redis_cluster.url, key_prefix=prefix) as make:
        yield make


def _keys(blocks: list[KVBlock]) -> list[BlockHash]:
    return [b.key for b in blocks]


def _same(got: KVBlock | None, block: KVBlock) -> bool:
    return got is not None and got.key == block.key and bytes(got.data) == bytes(block.data)


def _owners(tier: RedisTier, raw: RedisCluster, ns: str, blocks: list[KVBlock]) -> list[int]:
    """The port of the master each block's slot belongs to."""
    return [raw.get_node_from_key(tier.storage_key(ns, b.key)).port for b in blocks]


# The URL and the config: no cluster needed


def test_cluster_url_lists_startup_nodes() -> None:
    address = parse_cluster_url("redis+cluster://10.0.0.1:7000,10.0.0.2:7001")
    assert address.nodes == (("10.0.0.1", 7000), ("10.0.0.2", 7001))
    assert address.node_url == "redis://10.0.0.1:7000"
    address = parse_cluster_url("rediss+cluster://me:p%40ss@[::1]:7000,cache-2/0")
    assert address.nodes == (("::1", 7000), ("cache-2", 6379))
    assert address.node_url == "rediss://me:p%40ss@[::1]:7000"
    assert RedisTierConfig(url="redis+cluster://127.0.0.1:7000").cluster
    assert not RedisTierConfig(url="redis://127.0.0.1:6379/0").cluster


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"url": "redis+cluster://"}, "host:port"),
        ({"url": "redis+cluster://127.0.0.1:7000,,127.0.0.1:7001"}, "host:port"),
        ({"url": "redis+cluster://127.0.0.1:70000"}, "bad port"),
        ({"url": "redis+cluster://127.0.0.1:7000/1"}, "only database 0"),
        ({"url": "redis+cluster://127.0.0.1:7000?timeout=1"}, "no query"),
        ({"url": "redis+cluster://127.0.0.1:7000", "capacity_bytes": 1 << 20}, "maxmemory"),
    ],
)
def test_config_rejects_bad_cluster_settings(settings: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        RedisTierConfig(**settings)  # type: ignore[arg-type]


def test_unreachable_cluster_gives_bounded_misses_then_opens_the_breaker(
    namespace: Namespace,
) -> None:
    with refusing_port() as port_a, refusing_port() as port_b:
        clock = FakeClock()
        url = f"redis+cluster://127.0.0.1:{port_a},127.0.0.1:{port_b}"
        config = RedisTierConfig(url=url, failure_threshold=2, **FAST_FAIL)  # type: ignore[arg-type]
        blocks = make_blocks(namespace, 3)
        with RedisTier(config, clock=clock) as tier:  # no I/O yet: nothing raises
            for _ in range(2):
                start = time.monotonic()
                assert tier.get_many(namespace.id, _keys(blocks)) == [None] * 3
                assert time.monotonic() - start < 10 * TIMEOUT_S
            stats = tier.stats()
            assert (stats["errors"], stats["breaker"]["state"]) == (2, "open")
            start = time.monotonic()
            assert tier.put_many(namespace.id, blocks) == 0
            assert tier.contains_prefix(namespace.id, _keys(blocks)) == 0
            assert tier.delete(namespace.id, _keys(blocks)) == 0
            assert tier.clear(namespace.id) == 0
            assert time.monotonic() - start < TIMEOUT_S  # skipped: no connection attempts
            stats = tier.stats()
            assert (stats["errors"], stats["skipped"], stats["node_breakers"]) == (2, 4, {})


# On the cluster


@pytest.mark.slow(reason="needs a local three-master Redis Cluster, started once per session")
def test_keys_of_one_request_spread_over_the_masters_in_one_batch_each(
    make_tier: MakeTier,
    raw: RedisCluster,
    redis_cluster: LocalCluster,
    namespace: Namespace,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    tier = make_tier()
    blocks = make_blocks(namespace, 32)
    assert tier.put_many(namespace.id, blocks) == 32
    names = [tier.storage_key(namespace.id, b.key) for b in blocks]
    assert not any("{" in name for name in names)  # no hash tag pins them to one slot
    owners = _owners(tier, raw, namespace.id, blocks)
    assert len(set(owners)) == NUM_MASTERS  # (>= 2 is what matters; 32 keys reach all 3)
    for port in redis_cluster.ports:  # each record is on the master its slot maps to
        node = redis_cluster.node(port)
        assert all(node.exists(n) for n, owner in zip(names, owners, strict=True) if owner == port)
        node.close()

    # One pipelined write per master for a whole get (connections are open by now).
    writes: list[int] = []
    send = Connection.send_packed_command

    def counting_send(conn: Connection, *args: object, **kwargs: object) -> None:
        writes.append(conn.port)
        send(conn, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(Connection, "send_packed_command", counting_send)
    assert all(tier.get_many(namespace.id, _keys(blocks)))
    assert sorted(writes) == sorted(set(owners))


@pytest.mark.slow(reason="needs a local three-master Redis Cluster, started once per session")
def test_ttl_is_set_on_every_record(
    make_tier: MakeTier, raw: RedisCluster, namespace: Namespace
) -> None:
    # Restart and corrupt records on the cluster: the shared suite (test_tier_suite.py).
    blocks = make_blocks(namespace, 12)
    tier = make_tier(ttl_s=60.0)
    assert tier.put_many(namespace.id, blocks) == 12
    names = [tier.storage_key(namespace.id, b.key) for b in blocks]
    assert all(0 < raw.pttl(name) <= 60_000 for name in names)


@pytest.mark.slow(reason="six threads share a local three-master Redis Cluster's pools")
def test_concurrent_callers_share_the_pools(make_tier: MakeTier, namespace: Namespace) -> None:
    # 2 connections per master for 6 threads: callers wait for free ones, and since a call
    # holds one connection per master at once, they must not wait for each other in a ring.
    tier = make_tier(max_connections=2)
    blocks = make_blocks(namespace, 24)
    errors: list[BaseException] = []

    def worker(offset: int) -> None:
        try:
            for round_ in range(20):
                picked = blocks[(offset + round_) % 20 :][:4]
                if tier.put_many(namespace.id, picked) != len(picked):
                    raise AssertionError("a put was not stored")
                if not all(tier.get_many(namespace.id, _keys(picked))):
                    raise AssertionError("a block just put was missing")
        except BaseException as exc:  # surfaced below: a thread cannot fail the test itself
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(seed,)) for seed in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors
    stats = tier.stats()
    assert (stats["errors"], stats["skipped"]) == (0, 0)


@pytest.mark.slow(
    reason="freezes a Redis Cluster master past a socket timeout, then waits for health"
)
@pytest.mark.faults
def test_a_silent_master_costs_a_socket_timeout_and_only_its_keys(
    make_tier: MakeTier, raw: RedisCluster, redis_cluster: LocalCluster, namespace: Namespace
) -> None:
    tier = make_tier(**FAST_FAIL)
    blocks = make_blocks(namespace, 24)
    assert tier.put_many(namespace.id, blocks) == 24
    owners = _owners(tier, raw, namespace.id, blocks)
    victim = owners[0]
    proc = redis_cluster.procs[victim]
    proc.send_signal(signal.SIGSTOP)  # frozen: the kernel still takes its bytes, nothing answers
    try:
        start = time.monotonic()
        got = tier.get_many(namespace.id, _keys(blocks))
        elapsed = time.monotonic() - start
    finally:
        proc.send_signal(signal.SIGCONT)  # back before the cluster flags it as failed
    assert elapsed < 5 * TIMEOUT_S
    assert [g is not None for g in got] == [owner != victim for owner in owners]
    stats = tier.stats()
    assert stats["errors"] == 1 and stats["node_breakers"][f"127.0.0.1:{victim}"]["num_failures"]
    assert all(tier.get_many(namespace.id, _keys(blocks)))  # it answers again
    redis_cluster.wait_healthy()


@pytest.mark.slow(reason="kills a Redis Cluster master, waits out its node timeout and restarts it")
@pytest.mark.faults
def test_a_lost_master_costs_only_its_own_keys(
    make_tier: MakeTier, raw: RedisCluster, redis_cluster: LocalCluster, namespace: Namespace
) -> None:
    clock = FakeClock()
    tier = make_tier(clock=clock, failure_threshold=2, **FAST_FAIL)
    blocks = make_blocks(namespace, 48)
    keys = _keys(blocks)
    ns = namespace.id
    assert tier.put_many(ns, blocks) == 48
    owners = _owners(tier, raw, ns, blocks)
    victim = owners[5]
    lost = [owner == victim for owner in owners]
    node_name = f"127.0.0.1:{victim}"

    def check_reads() -> None:
        start = time.monotonic()
        got = tier.get_many(ns, keys)
        assert time.monotonic() - start < 10 * TIMEOUT_S  # generous: a refusal is immediate
        assert [g is None for g in got] == lost
        assert all(_same(g, b) for g, b, gone in zip(got, blocks, lost) if not gone)
        assert tier.contains_prefix(ns, keys) == lost.index(True)

    fresh = make_blocks(namespace, 12, seed=3)
    fresh_lost = [owner == victim for owner in _owners(tier, raw, ns, fresh)]
    try:
        redis_cluster.stop_node(victim, signal.SIGKILL)
        check_reads()  # a get and a probe: both fail on the victim, and its breaker opens
        stats = tier.stats()
        assert stats["errors"] == 2 and stats["node_breakers"][node_name]["state"] == "open"
        check_reads()  # the victim is skipped now; the others' breakers stay closed
        assert tier.put_many(ns, fresh) == fresh_lost.count(False)
        assert tier.delete(ns, keys[:4]) == lost[:4].count(False)
        stats = tier.stats()
        skipped_calls = 2 + any(fresh_lost) + any(lost[:4])  # each that had a key on it
        assert (stats["errors"], stats["skipped"]) == (2, skipped_calls)
        assert [b["state"] for b in stats["node_breakers"].values()].count("closed") == 2

        # Once the others flag it as failed they still serve their own slots.
        redis_cluster.wait_flagged_failed(victim)
        got = tier.get_many(ns, keys[4:])
        assert [g is None for g in got] == lost[4:]
        assert all(_same(g, b) for g, b, gone in zip(got, blocks[4:], lost[4:]) if not gone)
    finally:
        redis_cluster.start_node(victim)  # empty: it kept nothing (--save "")
        redis_cluster.wait_healthy()

    assert tier.put_many(ns, fresh) == fresh_lost.count(False)  # its breaker is still open
    clock.advance(1.0)  # past the backoff: the next call to it is the trial
    assert tier.put_many(ns, blocks) == 48
    assert all(tier.get_many(ns, keys))
    assert tier.stats()["node_breakers"][node_name]["state"] == "closed"
