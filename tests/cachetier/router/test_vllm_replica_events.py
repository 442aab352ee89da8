"""A ``vllm serve`` replica's KV events: the router follows the endpoints it is given for that
replica (vLLM's framing, no topic of ours) and files what vLLM's own publisher sends under the
router's name for the replica."""

from __future__ import annotations

import time
from pathlib import Path
from types import ModuleType

import pytest
import zmq.auth

from cachetier.kvevents import BlockStored, KVEventPublisher, PublisherConfig
from cachetier.kvindex import PrefixIndex
from cachetier.router.app import create_app
from cachetier.router.config import RouterConfig
from cachetier.router.decide import FleetDecider
from cachetier.router.events import EventFeed
from cachetier.router.replicas import ReplicaSet
from tests.engine.server.live import EngineServer
from tests.support import AppThread

KEYS = [bytes([i]) * 32 for i in range(1, 5)]


@pytest.fixture(scope="module")
def vllm_events() -> ModuleType:
    return pytest.importorskip("vllm.distributed.kv_events")


@pytest.mark.vllm
def test_a_vllm_replicas_tier_events_are_routed_on(
    vllm_events: ModuleType, replica: EngineServer, tmp_path: Path
) -> None:
    pub, replay = f"ipc://{tmp_path}/pub", f"ipc://{tmp_path}/replay"
    publisher = vllm_events.ZmqEventPublisher(
        data_parallel_rank=0, endpoint=pub, replay_endpoint=replay
    )
    index = PrefixIndex()
    config = RouterConfig(
        (replica.url,), port=0, poll_interval_s=0.2, replica_events=(f"r0={pub},{replay}",)
    )
    router = AppThread(
        lambda: create_app(config, FleetDecider("tier_aware", index), index=index), name="router"
    )
    router.start_thread()
    try:
        stored = vllm_events.BlockStored(
            block_hashes=KEYS,
            parent_block_hash=None,
            token_ids=[],
            block_size=16,
            lora_id=None,
            medium="disk",
            lora_name=None,
        )
        deadline = time.monotonic() + 15
        while index.holdings(KEYS, ["r0"])[0].media != ("disk",) * 4:
            assert time.monotonic() < deadline, "the router never filed vLLM's events"
            # Published until seen: a SUB socket that connects late misses the first ones.
            publisher.publish(vllm_events.KVEventBatch(ts=time.time(), events=[stored]))
            time.sleep(0.05)
    finally:
        router.stop()
        publisher.shutdown()


def test_replica_events_must_name_a_replica_and_endpoints() -> None:
    urls = ("http://127.0.0.1:8001",)
    with pytest.raises(ValueError, match="NAME=ENDPOINT"):
        RouterConfig(urls, replica_events=("r1=tcp://127.0.0.1:5557",))
    with pytest.raises(ValueError, match="replica_events"):
        RouterConfig(urls, replica_events=("r0=http://127.0.0.1:5557",))
    config = RouterConfig(urls, replica_events=("r0=tcp://h:5557",))
    assert config.events_of() == {"r0": ("tcp://h:5557", None)}


def _feed_files(
    feed_curve: tuple[str, str] | None, publisher: KVEventPublisher, wait_s: float
) -> bool:
    """Whether a router's ``EventFeed`` with ``feed_curve`` files the publisher's blocks."""
    index = PrefixIndex()
    feed = EventFeed(
        ReplicaSet(["http://127.0.0.1:9"]),
        index,
        fixed={"r0": (publisher.endpoint, None)},
        curve=feed_curve,
    )
    feed.start()
    try:
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            publisher.publish([BlockStored(tuple(KEYS), None, (), 16, "disk")])
            if index.holdings(KEYS, ["r0"])[0].media == ("disk",) * 4:
                return True
            time.sleep(0.05)
        return False
    finally:
        feed.close()


def test_the_router_reads_curve_protected_events_with_its_listed_key_only(
    tmp_path: Path,
) -> None:
    allowed = tmp_path / "allowed"
    allowed.mkdir()
    certs = {name: zmq.auth.create_certificates(tmp_path, name) for name in ("pub", "router", "x")}
    (allowed / "router.key").write_bytes(Path(certs["router"][0]).read_bytes())
    config = PublisherConfig(
        "pod-a",
        replay_endpoint=None,
        curve_secret_key_file=certs["pub"][1],
        curve_public_keys_dir=str(allowed),
    )
    with KVEventPublisher(config) as publisher:
        assert _feed_files((certs["router"][1], certs["pub"][0]), publisher, 10)
        assert not _feed_files((certs["x"][1], certs["pub"][0]), publisher, 1.5)
        assert not _feed_files(None, publisher, 1.5)
