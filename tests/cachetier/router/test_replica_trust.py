"""Replicas proven, not trusted: over real HTTP, each replica is sent its own key and no other
(a replica that redirects the router elsewhere sends it there keyless), KV events are followed
only at an endpoint on the replica's own host, and ``/v1/fleet/lookup`` tells each tenant of
its own replicas only."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import pytest

from cachetier.kvindex import PrefixIndex
from cachetier.primitives.keys import Namespace, block_keys
from cachetier.router.app import RouteDecision, create_app
from cachetier.router.config import RouterConfig
from cachetier.router.replicas import Replica
from tests.cachetier.router.conftest import in_given_order
from tests.cachetier.router.fakes import LAYOUT, FakeReplica
from tests.engine.server.live import EngineServer, get, post, post_raw, server_config
from tests.support import AppThread

KEYS = {"r0": "replica-key-r0-0001", "r1": "replica-key-r1-0001"}
SHARED = "shared-replica-key-0001"
BODY = {"prompt": [5, 6, 7, 8], "max_tokens": 1, "temperature": 0}


@pytest.fixture(scope="module")
def keyed_replica(router_model_dir: Path) -> Iterator[EngineServer]:
    config = server_config(router_model_dir, max_prompt_tokens=400, api_key=KEYS["r1"])
    server = EngineServer(config).start()
    yield server
    server.stop()


@pytest.fixture
def fakes() -> Iterator[Callable[..., FakeReplica]]:
    started: list[FakeReplica] = []

    def start(**settings: object) -> FakeReplica:
        started.append(FakeReplica(**settings).start())  # type: ignore[arg-type]
        return started[-1]

    yield start
    for fake in started:
        fake.stop()


def by_session(
    tokens: list[int] | None, session: str | None, up: Sequence[Replica]
) -> RouteDecision:
    """The replica the request's session id names, first."""
    return RouteDecision(sorted(up, key=lambda r: r.name != session))


def test_each_replica_is_sent_its_own_key_and_a_redirect_none(
    keyed_replica: EngineServer,
    fakes: Callable[..., FakeReplica],
    make_router: Callable[..., AppThread],
) -> None:
    elsewhere = fakes()  # where the hostile replica sends the router's requests
    hostile = fakes(redirect_to=elsewhere.url)
    router = make_router(
        [hostile.url, keyed_replica.url],
        by_session,
        replica_api_keys=tuple(KEYS.items()),
        replica_api_key=SHARED,
    )
    assert json.loads(get(router.url, "/healthz")[1]) == {"replicas_up": 2}
    status, answer = post(router.url, "/v1/completions", BODY, **{"x-session-id": "r0"})
    assert status == 200 and answer["id"] == "cmpl-fake", answer  # followed to `elsewhere`
    assert post(router.url, "/v1/completions", BODY, **{"x-session-id": "r1"})[0] == 200
    assert hostile.seen and set(hostile.seen) == {f"Bearer {KEYS['r0']}"}
    assert elsewhere.seen == [""], "a redirect off the replica carried a key"
    # Without keys of their own, every replica gets the shared key: the documented fallback.
    shared = make_router([hostile.url, keyed_replica.url], by_session, replica_api_key=KEYS["r1"])
    assert post(shared.url, "/v1/completions", BODY, **{"x-session-id": "r1"})[0] == 200
    assert f"Bearer {KEYS['r1']}" in hostile.seen


@contextmanager
def listening(host: str) -> Iterator[socket.socket]:
    with socket.socket() as sock:
        sock.bind((host, 0))
        sock.listen()
        yield sock


def _index_router(config: RouterConfig, index: PrefixIndex) -> AppThread:
    router = AppThread(lambda: create_app(config, in_given_order, index=index), name="router")
    router.start_thread()
    return router


def _wait(until: Callable[[], bool], what: str, timeout_s: float = 20) -> None:
    deadline = time.monotonic() + timeout_s
    while not until():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def test_kv_events_off_the_replicas_host_are_not_followed(
    fakes: Callable[..., FakeReplica],
) -> None:
    # 127.0.0.2 is this machine too, but not the host the replica's URL names.
    with listening("127.0.0.2") as off_host, listening("127.0.0.1") as on_host:
        events = {"endpoint": f"tcp://127.0.0.2:{off_host.getsockname()[1]}", "epoch": 1}
        fake = fakes(kv_events=events)
        config = RouterConfig((fake.url,), port=0, poll_interval_s=0.05)
        router = _index_router(config, PrefixIndex())
        try:
            _wait(lambda: len(fake.seen) >= 20, "ten polls")
            off_host.settimeout(0.5)
            with pytest.raises(TimeoutError):
                off_host.accept()
            # The same replica naming an endpoint on its own host is followed: what the
            # check above would have seen, had the router connected off the host.
            fake.kv_events = {"endpoint": f"tcp://127.0.0.1:{on_host.getsockname()[1]}"}
            on_host.settimeout(20)
            on_host.accept()[0].close()
        finally:
            router.stop()


def test_lookup_tells_each_tenant_of_its_own_replicas_only(
    fakes: Callable[..., FakeReplica],
) -> None:
    alices, bobs = fakes(tenant="alice"), fakes(tenant="bob")
    index = PrefixIndex()
    tokens = list(range(16))
    index.resync("r0", 1, "gpu", block_keys(Namespace("fake-model", LAYOUT, "alice"), tokens))
    clients = (("alice-key-0001", "alice"), ("bob-key-0001", "bob"))
    config = RouterConfig((alices.url, bobs.url), port=0, client_keys=clients)
    router = _index_router(config, index)
    try:
        ask = {"prompt": tokens}
        assert post(router.url, "/v1/fleet/lookup", ask)[0] == 401
        status, alice = post(
            router.url, "/v1/fleet/lookup", ask, Authorization="Bearer alice-key-0001"
        )
        assert status == 200 and list(alice["replicas"]) == ["r0"]
        assert alice["replicas"]["r0"]["num_blocks"] == 4
        status, bob = post(router.url, "/v1/fleet/lookup", ask, Authorization="Bearer bob-key-0001")
        assert status == 200 and list(bob["replicas"]) == ["r1"], "bob was told of alice's"
        assert bob["replicas"]["r1"]["num_blocks"] == 0
        status, listed = get(router.url, "/v1/fleet/index", Authorization="Bearer bob-key-0001")
        assert status == 200 and "r0" not in json.loads(listed)["replicas"]
    finally:
        router.stop()


def test_a_body_a_replica_would_refuse_is_refused_at_the_router(
    fakes: Callable[..., FakeReplica], make_router: Callable[..., AppThread]
) -> None:
    small = fakes(max_request_bytes=4096)
    router = make_router([small.url])
    body = json.dumps({"prompt": "x" * 8000, "max_tokens": 1}).encode()
    status, answer = post_raw(router.url, "/v1/completions", body)
    assert status == 413 and b"limit" in answer
    assert "/v1/completions" not in small.paths, "forwarded a body the replica refuses"
    assert post(router.url, "/v1/completions", BODY)[0] == 200
    assert "/v1/completions" in small.paths
