"""Tier-aware routing end to end: two real engine servers publishing their pools' KV events,
the router following them into its prefix index; a prompt a replica computed is sent back to
that replica, until the bound on what each replica was routed lately sends one elsewhere."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from cachetier.kvindex import PrefixIndex
from cachetier.primitives.keys import block_keys
from cachetier.router.app import create_app
from cachetier.router.config import RouterConfig
from cachetier.router.decide import FleetDecider
from tests.engine.server.live import EngineServer, metric, post, server_config
from tests.support import AppThread

PROMPT = [(i * 29 + 7) % 250 for i in range(16 * 20)]


@pytest.fixture(scope="module")
def publishing(router_model_dir: Path) -> Iterator[list[EngineServer]]:
    servers = [
        EngineServer(server_config(router_model_dir, max_prompt_tokens=400, kv_events=True))
        for _ in range(2)
    ]
    for server in servers:
        server.start()
    yield servers
    for server in servers:
        server.stop()


def _router(urls: list[str], index: PrefixIndex) -> AppThread:
    config = RouterConfig(tuple(urls), port=0, poll_interval_s=0.2)
    decide = FleetDecider("tier_aware", index)
    router = AppThread(lambda: create_app(config, decide, index=index), name="router")
    router.start_thread()
    return router


def _wait(until: Callable[[], bool], timeout_s: float = 15) -> None:
    deadline = time.monotonic() + timeout_s
    while not until():
        assert time.monotonic() < deadline, "the router's index did not catch up"
        time.sleep(0.05)


def test_a_prompt_goes_back_to_the_replica_that_computed_it(
    publishing: list[EngineServer],
) -> None:
    index = PrefixIndex()
    router = _router([s.url for s in publishing], index)
    try:
        body = {"prompt": PROMPT, "max_tokens": 1, "temperature": 0}
        assert post(router.url, "/v1/completions", body)[0] == 200
        first = next(
            name
            for name in ("r0", "r1")
            if metric(router.url, "cachetier_router_requests_total", replica=name) == 1
        )
        _wait(lambda: _holdings(index, router, first)[0].num_blocks == 20)
        (held,) = _holdings(index, router, first)
        assert held.media == ("gpu",) * 20  # every full block, in that replica's pool
        for _ in range(2):
            assert post(router.url, "/v1/completions", body)[0] == 200
        assert metric(router.url, "cachetier_router_requests_total", replica=first) == 3
        # A fourth would put 3 of 4 requests on one of two replicas, past 1.3 x the mean + 1:
        # the other replica takes it although it must compute the prompt.
        assert post(router.url, "/v1/completions", body)[0] == 200
        assert metric(router.url, "cachetier_router_requests_total", replica=first) == 3
    finally:
        router.stop()


def _holdings(index: PrefixIndex, router: AppThread, replica: str) -> list:
    namespace = next(iter(_namespaces(router)))
    return index.holdings(block_keys(namespace, PROMPT), [replica])


def _namespaces(router: AppThread) -> list:
    app = router._server.config.app  # type: ignore[union-attr]
    return [r.namespace for r in app.state.router.replicas.replicas if r.namespace]
