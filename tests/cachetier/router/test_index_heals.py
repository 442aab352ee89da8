"""The router's prefix index heals itself: a restarted replica's disk is routable before it
serves anything, an index that lost events agrees with every replica again within the
reconcile period, and a replica that is down is forgotten. Real engine servers with CPU and
disk tiers publishing KV events; the router in a thread."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from fastapi import FastAPI, Response

from cachetier.kvindex import PrefixIndex
from cachetier.primitives.keys import KVLayout, Namespace, block_keys
from cachetier.router.app import create_app
from cachetier.router.config import RouterConfig
from cachetier.router.decide import FleetDecider
from cachetier.store.config import StoreConfig
from tests.engine.server.live import EngineServer, get, metric, post, server_config
from tests.support import AppThread

PROMPT = [(i * 31 + 5) % 250 for i in range(16 * 6)]


def _replica(model: Path, disk: Path) -> EngineServer:
    store = StoreConfig(cpu_bytes=1 << 20, disk_path=str(disk), fsync=False)
    return EngineServer(server_config(model, max_prompt_tokens=400, kv_events=True, store=store))


def _router(urls: list[str], index: PrefixIndex, reconcile_s: float) -> AppThread:
    config = RouterConfig(
        tuple(urls), port=0, poll_interval_s=0.2, reconcile_interval_s=reconcile_s
    )
    router = AppThread(
        lambda: create_app(config, FleetDecider("tier_aware", index), index=index), name="router"
    )
    router.start_thread()
    return router


def _wait(until: Callable[[], bool], timeout_s: float = 20, what: str = "") -> float:
    start = time.monotonic()
    while not until():
        assert time.monotonic() - start < timeout_s, f"timed out waiting for {what}"
        time.sleep(0.05)
    return time.monotonic() - start


def _state(server: EngineServer) -> dict:
    return json.loads(get(server.url, "/v1/fleet/state")[1])


def _keys(server: EngineServer) -> list[bytes]:
    ns = _state(server)["namespace"]
    namespace = Namespace(ns["model_fingerprint"], KVLayout(**ns["layout"]), ns["tenant"])
    return block_keys(namespace, PROMPT)


def _agrees(index: PrefixIndex, server: EngineServer, name: str) -> bool:
    digest = _state(server)["kv_digest"]
    theirs = {m.lower(): (d["count"], int(d["xor"], 16)) for m, d in digest.items()}
    return index.digests(name) == theirs


@pytest.mark.slow(
    reason="starts a tiny-model engine server, restarts it and waits for its disk events"
)
def test_a_restarted_replicas_disk_is_routable_before_it_serves(
    router_model_dir: Path, tmp_path: Path
) -> None:
    server = _replica(router_model_dir, tmp_path / "disk").start()
    body = {"prompt": PROMPT, "max_tokens": 1, "temperature": 0}
    assert post(server.url, "/v1/completions", body)[0] == 200
    _wait(lambda: _state(server)["kv_digest"].get("disk", {}).get("count") == 6, what="disk")
    keys = _keys(server)
    index = PrefixIndex()
    # A reconcile period past the test: the restart's own snapshot events must do it.
    router = _router([server.url], index, reconcile_s=600)
    try:
        _wait(lambda: index.holdings(keys, ["r0"])[0].num_blocks == 6, what="first events")
        epoch = index.epoch("r0")
        server.stop()
        server.start()  # the same disk folder; an empty pool and CPU tier
        _wait(lambda: (index.epoch("r0") or 0) > (epoch or 0), what="the new epoch")
        _wait(lambda: index.holdings(keys, ["r0"])[0].media == ("disk",) * 6, what="disk")
    finally:
        router.stop()
        server.stop()


def test_an_index_that_lost_events_agrees_again_within_the_reconcile_period(
    router_model_dir: Path, tmp_path: Path
) -> None:
    server = _replica(router_model_dir, tmp_path / "disk").start()
    index = PrefixIndex()
    router = _router([server.url], index, reconcile_s=0.5)
    try:
        assert post(router.url, "/v1/completions", {"prompt": PROMPT, "max_tokens": 1})[0] == 200
        _wait(lambda: _state(server)["kv_digest"].get("disk", {}).get("count") == 6, what="disk")
        _wait(lambda: _agrees(index, server, "r0"), what="the events")
        epoch = index.epoch("r0")
        assert epoch is not None
        # Events lost: the index forgets the disk's blocks and holds one the pool never had.
        index.resync("r0", epoch, "disk", [])
        index.resync("r0", epoch, "gpu", [b"\x01" * 32])
        assert not _agrees(index, server, "r0")
        _wait(lambda: _agrees(index, server, "r0"), timeout_s=5, what="the reconcile")
        assert metric(router.url, "cachetier_router_index_resyncs") >= 2
        status, raw = get(router.url, "/v1/fleet/index")
        held = json.loads(raw)["replicas"]["r0"]
        assert status == 200 and held["epoch"] == epoch and held["media"]["disk"]["count"] == 6
        # Anyone may ask the index where a prompt's blocks are.
        status, answer = post(router.url, "/v1/fleet/lookup", {"prompt": PROMPT})
        (r0,) = answer["replicas"].values()
        assert status == 200 and answer["num_tokens"] == len(PROMPT)
        assert r0["num_blocks"] == 6 and r0["cached_tokens"] == 96 and r0["up"]
        assert r0["spans"] == [{"medium": "gpu", "blocks": 6}]
        status, answer = post(router.url, "/v1/fleet/lookup", {"prompt": "text, no --model"})
        assert status == 400 and "--model" in answer["error"]["message"]
        assert post(router.url, "/v1/fleet/lookup", [1, 2])[0] == 400
    finally:
        router.stop()
        server.stop()


def test_a_replica_that_is_down_leaves_the_index(router_model_dir: Path, tmp_path: Path) -> None:
    server = _replica(router_model_dir, tmp_path / "disk").start()
    index = PrefixIndex()
    router = _router([server.url], index, reconcile_s=0.3)
    try:
        assert post(router.url, "/v1/completions", {"prompt": PROMPT, "max_tokens": 1})[0] == 200
        _wait(lambda: index.epoch("r0") is not None, what="the events")
        server.stop()
        _wait(lambda: index.epoch("r0") is None, what="the index to forget r0")
    finally:
        router.stop()
        server.stop()


def _lying_replica(blocks: Callable[[], Response]) -> AppThread:
    """A replica that reports a digest it cannot back: its key list is ``blocks()``."""
    app = FastAPI()
    app.get("/healthz")(lambda: {"ok": True})
    state = {
        "kv_events": {"endpoint": "tcp://127.0.0.1:9", "replay_endpoint": None, "epoch": 7},
        "kv_digest": {"disk": {"count": 3, "xor": "00000000000000ff"}},
    }
    app.get("/v1/fleet/state")(lambda: state)
    app.get("/v1/fleet/blocks")(blocks)
    server = AppThread(lambda: app, name="lying replica")
    server.start_thread()
    return server


@pytest.mark.parametrize(
    "blocks",
    [
        lambda: Response(b'{"keys": ["' + b"00" * (20 << 20) + b'"]}'),  # 40 MiB of one key
        lambda: {"medium": "disk", "keys": ["abcd"], "truncated": False},  # 2 bytes, not 32
        lambda: {"keys": ["not hex"]},
        lambda: Response(b"[]"),
    ],
)
def test_a_replica_that_lies_leaves_the_index_clean(blocks: Callable[[], Response]) -> None:
    liar = _lying_replica(blocks)
    index = PrefixIndex()
    router = _router([liar.url], index, reconcile_s=0.2)
    try:
        reconciler = router._server.config.app.state.reconciler  # type: ignore[union-attr]
        _wait(lambda: reconciler.num_errors >= 2, what="two refused rounds")
        assert index.digests("r0") == {} and reconciler.num_resyncs == 0
        assert get(router.url, "/healthz")[0] == 200  # still serving
    finally:
        router.stop()
        liar.stop()
