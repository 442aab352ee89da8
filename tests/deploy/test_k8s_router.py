"""deploy/k8s's router, read as the kubelet starts it: its command parses with ``cachetier
route``, it names every engine replica of the StatefulSet at the port they serve on, reads
the tokenizer the init container converts, sends and takes the engines' key, and its probe
is a route of the router's app."""

from __future__ import annotations

import secrets
import shlex
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from starlette.routing import Match

from tests.cachetier.kvevents.curve_reads import intruder_messages, listed_stored_keys
from tests.cachetier.kvevents.streams import random_keys
from tests.deploy.k8s_render import (
    KUSTOMIZATIONS,
    argv_of,
    check_variables,
    container_ports,
    environment_of,
    find_object,
    mounted_secret_files,
    pod_spec,
    render,
    volume_at,
    workloads,
)


@pytest.fixture(scope="module")
def base() -> list[dict]:
    return render(KUSTOMIZATIONS["base"])


@pytest.fixture(scope="module")
def tokens(base: list[dict]) -> dict[str, str]:
    return {key: secrets.token_hex(16) for key in find_object(base, "Secret", "tokens")["data"]}


def test_the_router_routes_to_every_engine_replica(base: list[dict], tokens: dict) -> None:
    from cachetier.cli.main import build_parser
    from cachetier.cli.route import REPLICA_KEY_ENV, ROUTER_KEY_ENV, route_config

    pod = pod_spec(base, "engine-router")
    (container,) = pod["containers"]
    env = environment_of(container, base, tokens)
    check_variables(container, {ROUTER_KEY_ENV, REPLICA_KEY_ENV})
    argv = argv_of(container, env)
    assert argv[:2] == ["cachetier", "route"]
    config = route_config(build_parser().parse_args(argv[1:]), env)
    assert config.host == "0.0.0.0" and {"http": config.port} == container_ports(container)
    assert config.api_key == config.replica_api_key == tokens["engine-api-key"]
    engines = workloads(base)["engine"]
    assert engines["kind"] == "StatefulSet"
    name, service = engines["metadata"]["name"], engines["spec"]["serviceName"]
    headless = find_object(base, "Service", service)["spec"]
    assert headless["clusterIP"] == "None"
    (port,) = [p["port"] for p in headless["ports"] if p["name"] == "http"]
    wanted = [f"http://{name}-{i}.{service}:{port}" for i in range(engines["spec"]["replicas"])]
    assert list(config.replicas) == wanted


def test_the_router_reads_the_tokenizer_its_init_container_converts(base: list[dict]) -> None:
    from cachetier.engine.smollm2 import MODEL_CACHE_ENV, SMOLLM2_FOLDER_NAME

    pod = pod_spec(base, "engine-router")
    (init,) = pod["initContainers"]
    (router,) = pod["containers"]
    cache = environment_of(init, base, None)[MODEL_CACHE_ENV]
    assert "smollm2_path()" in shlex.join(argv_of(init, {}))
    model = router["args"][router["args"].index("--model") + 1]
    assert model == f"{cache}/{SMOLLM2_FOLDER_NAME}"
    assert volume_at(pod, init, cache)[0] is volume_at(pod, router, model)[0]
    assert "emptyDir" in volume_at(pod, router, model)[0]


def test_the_routers_probe_is_a_route_of_its_app(base: list[dict]) -> None:
    from cachetier.kvindex import PrefixIndex
    from cachetier.router.app import create_app
    from cachetier.router.config import RouterConfig
    from cachetier.router.decide import FleetDecider

    (container,) = pod_spec(base, "engine-router")["containers"]
    index = PrefixIndex()
    app = create_app(
        RouterConfig(("http://engine-0.engine-pods:8000",), port=0),
        FleetDecider("tier_aware", index),
        index=index,
    )
    probes = [v for k, v in container.items() if k.endswith("Probe")]
    assert probes and all(
        (p.get("httpGet") or p["tcpSocket"])["port"] in container_ports(container) for p in probes
    )
    for probe in (p["httpGet"] for p in probes if "httpGet" in p):
        scope = {"type": "http", "method": "GET", "path": probe["path"], "root_path": ""}
        assert any(r.matches(scope)[0] is Match.FULL for r in app.routes), probe["path"]


def test_only_the_router_reaches_the_engines_kv_events(base: list[dict]) -> None:
    """Events carry prompts' token ids: the NetworkPolicy lets anyone reach the HTTP port and
    only the router's pods the events' two ports (CURVE keeps other readers out besides)."""
    engines = workloads(base)["engine"]
    router = workloads(base)["engine-router"]
    (policy,) = [o for o in base if o["kind"] == "NetworkPolicy"]
    spec = policy["spec"]
    assert spec["podSelector"]["matchLabels"] == engines["spec"]["selector"]["matchLabels"]
    assert spec["policyTypes"] == ["Ingress"]
    anyone, routers = spec["ingress"]
    assert "from" not in anyone and anyone["ports"] == [{"port": "http", "protocol": "TCP"}]
    (source,) = routers["from"]
    assert source["podSelector"]["matchLabels"] == router["spec"]["selector"]["matchLabels"]
    (engine,) = pod_spec(base, "engine")["containers"]
    assert "--kv-events" in engine["args"] and "http" in container_ports(engine)
    events = set(container_ports(engine)) - {"http"}
    assert events == {"kv-events", "kv-replay"}
    assert routers["ports"] == [{"port": name, "protocol": "TCP"} for name in sorted(events)]


def _in_container(files: dict[str, str], root: Path) -> Callable[[str], str]:
    """Write a container's mounted files under ``root``; returns where a path of the
    container is here."""
    for path, text in files.items():
        (root / path.lstrip("/")).parent.mkdir(parents=True, exist_ok=True)
        (root / path.lstrip("/")).write_text(text)
    return lambda path: str(root / path.lstrip("/"))


def _pods(base: list[dict]) -> dict[str, tuple[dict, dict]]:
    return {c: (pod_spec(base, c), pod_spec(base, c)["containers"][0]) for c in _EVENTS_PODS}


_EVENTS_PODS = ("engine", "engine-router")


def _engine_publisher(base: list[dict], tokens: dict, where: Callable[[str], str]) -> Any:
    """The engine's publisher settings as its command gives them (files found by ``where``),
    on port 0 of the same address: a test listens where the OS says."""
    from cachetier.engine.server.__main__ import server_config
    from cachetier.kvevents import PublisherConfig

    (engine,) = pod_spec(base, "engine")["containers"]
    env = environment_of(engine, base, tokens)
    config, _ = server_config(argv_of(engine, env)[3:], env)
    anywhere = {
        name: endpoint.rpartition(":")[0] + ":0"
        for name, endpoint in (
            ("endpoint", config.kv_events_endpoint),
            ("replay_endpoint", config.kv_events_replay_endpoint),
        )
    }
    assert anywhere == {"endpoint": "tcp://0.0.0.0:0", "replay_endpoint": "tcp://0.0.0.0:0"}
    return PublisherConfig(
        "engine-0",
        **anywhere,
        heartbeat_s=0.05,
        curve_secret_key_file=where(config.kv_events_curve_key),
        curve_public_keys_dir=where(config.kv_events_curve_clients),
    )


def _router(base: list[dict], tokens: dict) -> Any:
    from cachetier.cli.main import build_parser
    from cachetier.cli.route import route_config

    (router,) = pod_spec(base, "engine-router")["containers"]
    env = environment_of(router, base, tokens)
    return route_config(build_parser().parse_args(argv_of(router, env)[1:]), env)


def test_the_router_reads_the_engines_kv_events_with_the_keys_the_secret_mounts(
    base: list[dict], tokens: dict, tmp_path: Path
) -> None:
    """Real keys of ``cachetier kv-events-keys`` in the Secret's place, mounted as the pods
    mount them: a publisher as the engine's command sets it up serves the router's subscriber
    as the router's command sets it up, and nobody without keys; neither pod holds the
    other's secret key."""
    from cachetier.cli.kv_events_keys import write_keys
    from cachetier.cli.route import check_curve_files
    from cachetier.kvevents import BlockStored, KVEventPublisher

    write_keys(tmp_path / "made", ["router"])
    secret = find_object(base, "Secret", "kv-events-keys")["data"]
    made = {key: (tmp_path / "made" / key).read_text() for key in secret}
    pods = _pods(base)
    files = {c: mounted_secret_files(base, pod, box, made) for c, (pod, box) in pods.items()}
    assert set(files["engine"].values()) == {made["publisher.key_secret"], made["router.key"]}
    assert set(files["engine-router"].values()) == {
        made["router.key_secret"],
        made["publisher.key"],
    }
    engine_at = _in_container(files["engine"], tmp_path / "engine")
    router_at = _in_container(files["engine-router"], tmp_path / "router")
    router = _router(base, tokens)
    key, server = router_at(router.events_curve_key), router_at(router.events_curve_server_key)
    check_curve_files(replace(router, events_curve_key=key, events_curve_server_key=server))
    stored = {bytes(k) for k in random_keys(3)}
    with KVEventPublisher(_engine_publisher(base, tokens, engine_at), epoch=1) as publisher:
        assert publisher.publish([BlockStored(tuple(stored), None, (), 16, "GPU")])
        where = (publisher.endpoint, publisher.replay_endpoint)
        assert intruder_messages(*where, Path(server), None) == 0
        assert stored <= listed_stored_keys(*where, Path(key), Path(server), stored)


def test_the_placeholder_keys_keep_the_engines_and_the_router_from_starting(
    base: list[dict], tokens: dict, tmp_path: Path
) -> None:
    """As committed, the Secret holds placeholders, as secrets.env does: the engine's publisher
    and the router (``cachetier route`` checks its files before it serves) refuse them."""
    from cachetier.cli.route import check_curve_files
    from cachetier.kvevents import KVEventPublisher

    pods = _pods(base)
    files = {c: mounted_secret_files(base, pod, box) for c, (pod, box) in pods.items()}
    assert all("PLACEHOLDER" in text for f in files.values() for text in f.values())
    engine_at = _in_container(files["engine"], tmp_path / "engine")
    with pytest.raises(ValueError, match="not a ZMQ certificate"):
        KVEventPublisher(_engine_publisher(base, tokens, engine_at))
    router_at = _in_container(files["engine-router"], tmp_path / "router")
    router = _router(base, tokens)
    mounted = replace(
        router,
        events_curve_key=router_at(router.events_curve_key),
        events_curve_server_key=router_at(router.events_curve_server_key),
    )
    with pytest.raises(ValueError, match="not a ZMQ certificate"):
        check_curve_files(mounted)
