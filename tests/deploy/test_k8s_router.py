"""deploy/k8s's router, read as the kubelet starts it: its command parses with ``cachetier
route``, it names every engine replica of the StatefulSet at the port they serve on, reads
the tokenizer the init container converts, sends and takes the engines' key, and its probe
is a route of the router's app."""

from __future__ import annotations

import secrets
import shlex

import pytest
from starlette.routing import Match

from tests.deploy.k8s_render import (
    KUSTOMIZATIONS,
    argv_of,
    check_variables,
    container_ports,
    environment_of,
    find_object,
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
    """Events carry prompts' token ids on ports the engine picks: the NetworkPolicy lets
    anyone reach the HTTP port and only the router's pods the rest."""
    engines = workloads(base)["engine"]
    router = workloads(base)["engine-router"]
    (policy,) = [o for o in base if o["kind"] == "NetworkPolicy"]
    spec = policy["spec"]
    assert spec["podSelector"]["matchLabels"] == engines["spec"]["selector"]["matchLabels"]
    assert spec["policyTypes"] == ["Ingress"]
    anyone, routers = spec["ingress"]
    assert "from" not in anyone and anyone["ports"] == [{"port": "http", "protocol": "TCP"}]
    assert "ports" not in routers
    (source,) = routers["from"]
    assert source["podSelector"]["matchLabels"] == router["spec"]["selector"]["matchLabels"]
    (engine,) = pod_spec(base, "engine")["containers"]
    assert "--kv-events" in engine["args"] and "http" in container_ports(engine)
