"""deploy/k8s, with no cluster: the kustomizations render (the subset of kustomize they use,
checked against ``kubectl kustomize`` where kubectl is installed), every object is valid against
the Kubernetes API schemas (kubernetes-validate's, offline), and each of our containers, read as
the kubelet starts it, parses with the real CLI and probes and scrapes routes its app serves.
"""

from __future__ import annotations

import ast
import importlib
import json
import re
import secrets
import shutil
import subprocess
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from tests.deploy.k8s_render import (
    K8S_VERSIONS,
    KUSTOMIZATIONS,
    argv_of,
    check_served,
    check_variables,
    container_ports,
    containers_of,
    environment_of,
    file_at,
    find_object,
    identity,
    memory_of,
    pod_spec,
    quantity_bytes,
    render,
    scrape_jobs,
    volume_at,
    workloads,
)
from tests.deploy.local_stack import ROOT, load_compose


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[dict]]:
    return {name: render(folder) for name, folder in KUSTOMIZATIONS.items()}


@pytest.fixture(scope="module")
def base(rendered: dict[str, list[dict]]) -> list[dict]:
    return rendered["base"]


@pytest.fixture(scope="module")
def tokens(base: list[dict]) -> dict[str, str]:
    return {key: secrets.token_hex(16) for key in find_object(base, "Secret", "tokens")["data"]}


def test_the_renders_are_what_kubectl_kustomize_makes(rendered: dict[str, list[dict]]) -> None:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed: the renders are this test's kustomize alone")
    for name, folder in KUSTOMIZATIONS.items():
        argv = [kubectl, "kustomize", "--load-restrictor", "LoadRestrictionsNone", str(folder)]
        done = subprocess.run(argv, capture_output=True, text=True, timeout=120, check=True)
        theirs = sorted(yaml.safe_load_all(done.stdout), key=identity)
        assert theirs == sorted(rendered[name], key=identity), name


def test_every_object_is_valid_against_the_kubernetes_api(rendered: dict[str, list[dict]]) -> None:
    for objects in rendered.values():
        assert len({identity(o) for o in objects}) == len(objects), "two objects share a name"
        for obj, version in ((o, v) for o in objects for v in K8S_VERSIONS):
            kubernetes_validate.validate(obj, version, strict=True)
        # Each Service sends to the named ports of one workload's pods.
        pods = [w["spec"]["template"] for w in workloads(objects).values()]
        for spec in (o["spec"] for o in objects if o["kind"] == "Service"):
            (pod,) = [
                p for p in pods if spec["selector"].items() <= p["metadata"]["labels"].items()
            ]
            ports = {q["name"] for c in pod["spec"]["containers"] for q in c["ports"]}
            assert {q["targetPort"] for q in spec["ports"]} <= ports, spec["selector"]
    # The check can fail: a misspelt field is refused by the same schemas.
    broken = json.loads(json.dumps(workloads(rendered["base"])["sidecar"]))
    probe = broken["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["httpGet"]
    probe["paht"] = probe.pop("path")
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, K8S_VERSIONS[0], strict=True)


def test_the_images_are_those_compose_runs(rendered: dict[str, list[dict]]) -> None:
    services = load_compose()["services"]
    stages = re.findall(r"^FROM \S+ AS (\S+)", (ROOT / "Dockerfile").read_text(), flags=re.M)
    for objects in rendered.values():
        for component, workload in workloads(objects).items():
            service = services[component.split("-")[0]]
            assert "build" not in service or service["build"]["target"] in stages, component
            images = {c["image"] for c in containers_of(workload["spec"]["template"]["spec"])}
            assert images == {service["image"]}, component


def test_the_sidecar_runs_as_cachetier_serve_reads_it(base: list[dict], tokens: dict) -> None:
    from cachetier.cli.main import build_parser, run_serve
    from cachetier.server.app import create_app
    from cachetier.server.config import ServerConfig, load_config
    from cachetier.util.settings import flag_values, flat_settings

    pod = pod_spec(base, "sidecar")
    (container,) = pod["containers"]
    env = environment_of(container, base, tokens)
    argv = argv_of(container, env)
    args = build_parser().parse_args(argv[1:])
    assert argv[0] == "cachetier" and args.run is run_serve
    check_variables(container, {s.env for s in flat_settings(ServerConfig).values()})
    config = load_config(args.config, env=env, **flag_values(ServerConfig, args))
    assert config.host == "0.0.0.0"
    assert {"http": config.port, "transfer": config.transfer_port} == container_ports(container)
    check_served(create_app(config), container, base, "cachetier-sidecar")
    # Engines dial the transfer port /v1/limits names at the Service's address: the Service
    # has each port of the container under its number, and only this node's sidecar behind it.
    spec = find_object(base, "Service", "sidecar")["spec"]
    assert spec["internalTrafficPolicy"] == "Local"
    assert {p["targetPort"]: p["port"] for p in spec["ports"]} == container_ports(container)
    # The disk tier and the pins in the node's folder, which outlives the pod.
    assert volume_at(pod, container, config.data_dir)[0]["hostPath"]["type"] == "DirectoryOrCreate"
    # Tenant engine's token is the engines' one; the admin tenant's is Prometheus's.
    assert config.tenants == {"engine": (tokens["engine-token"],), "ops": (tokens["ops-token"],)}
    assert config.admin_tenants == ("ops",)
    (request, limit), store = memory_of(container), config.store
    assert request >= store.cpu_bytes
    assert limit >= store.cpu_bytes + config.max_inflight_bytes + store.write_queue_bytes
    # As committed, the Secret holds placeholders, which keep the sidecar from starting.
    placeholders = environment_of(container, base, None)
    assert {v for k, v in placeholders.items() if k.endswith("_TOKEN")} == {"CHANGE-ME"}
    with pytest.raises(ValueError, match="at least 16"):
        load_config(None, env=placeholders)


def test_the_engine_runs_as_its_server_reads_it(base: list[dict], tokens: dict) -> None:
    from cachetier.engine.server.__main__ import API_KEY_ENV, server_config
    from cachetier.engine.server.app import create_app
    from cachetier.engine.smollm2 import MODEL_CACHE_ENV
    from cachetier.store.config import StoreConfig
    from cachetier.util.settings import flat_settings

    pod = pod_spec(base, "engine")
    (container,) = pod["containers"]
    env = environment_of(container, base, tokens)
    argv = argv_of(container, env)
    assert argv[:3] == ["python", "-m", "cachetier.engine.server"]
    # Its settings, and the two variables of the engine that are none.
    reads = {s.env for s in flat_settings(StoreConfig).values()} | {API_KEY_ENV, MODEL_CACHE_ENV}
    check_variables(container, reads)
    config, _ = server_config(argv[3:], env)
    # HTTP, and the KV events on the pod's fixed ports (the router dials them at the pod's name).
    events = {"kv-events": config.kv_events_endpoint, "kv-replay": config.kv_events_replay_endpoint}
    ports = {
        name: int(endpoint.removeprefix("tcp://0.0.0.0:")) for name, endpoint in events.items()
    }
    assert config.host == "0.0.0.0" and {"http": config.port, **ports} == container_ports(container)
    assert config.kv_events and all(e.startswith("tcp://0.0.0.0:") for e in events.values())
    check_served(create_app(config), container, base, "cachetier-engine")
    assert env[API_KEY_ENV] == tokens["engine-api-key"]
    # The sidecar of the pod's node, through the node-local Service, as tenant engine.
    sidecar = {
        p["name"]: p["port"] for p in find_object(base, "Service", "sidecar")["spec"]["ports"]
    }
    assert config.store.remote_url == f"http://sidecar:{sidecar['http']}"
    assert config.store.remote_token == tokens["engine-token"]
    for path in (env[MODEL_CACHE_ENV], str(Path(config.engine_args["event_log"]).parent)):
        assert "emptyDir" in volume_at(pod, container, path)[0], path
    request, limit = memory_of(container)
    assert request >= config.store.cpu_bytes + config.engine_args["kv_cache_bytes"]
    assert limit >= request + config.store.write_queue_bytes


def test_vllm_runs_as_vllm_serve_reads_it(base: list[dict], tokens: dict) -> None:
    pytest.importorskip("vllm")
    import vllm.envs
    from vllm.entrypoints.cli.serve import ServeSubcommand
    from vllm.entrypoints.launchers.app import build_app
    from vllm.tasks import FALLBACK_SUPPORTED_TASKS
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from cachetier.connectors.vllm.launch import kv_transfer_config, vllm_cpu_env
    from cachetier.engine.smollm2 import MODEL_CACHE_ENV, SMOLLM2_FOLDER_NAME

    pod = pod_spec(base, "engine-vllm")
    (init,), (container,) = pod["initContainers"], pod["containers"]
    env = environment_of(container, base, tokens)
    argv = argv_of(container, env)
    parser = FlexibleArgumentParser(prog="vllm")
    serve = ServeSubcommand()
    serve.subparser_init(parser.add_subparsers(dest="subparser"))
    args = parser.parse_args(argv[1:])
    serve.validate(args)
    assert argv[0] == "vllm" and args.subparser == "serve" and args.host == "0.0.0.0"
    assert {"http": args.port} == container_ports(container)
    check_served(build_app(args, FALLBACK_SUPPORTED_TASKS), container, base, "vllm")
    # The connector's config is the one launch.py spells, with docs/engines.md's keys.
    given = json.loads(argv[argv.index("--kv-transfer-config") + 1])
    assert given == kv_transfer_config(given["kv_connector_extra_config"])
    docs = (ROOT / "docs" / "engines.md").read_text()
    documented = json.loads(re.search(r"--kv-transfer-config '(\{.*\})'", docs)[1])
    assert given.keys() == documented.keys() and args.kv_transfer_config.kv_connector
    assert all(given[k] == v for k, v in documented.items() if k != "kv_connector_extra_config")
    extra = given["kv_connector_extra_config"]
    ours = environment_of(pod_spec(base, "engine")["containers"][0], base, tokens)
    assert extra["remote_url"] == ours["CACHETIER_REMOTE_URL"] and "remote_token" not in extra
    assert env["CACHETIER_REMOTE_TOKEN"] == ours["CACHETIER_REMOTE_TOKEN"]
    # The model folder the init container converts, on the volume both mount.
    init_env = environment_of(init, base, tokens)
    assert args.model_tag == f"{init_env[MODEL_CACHE_ENV]}/{SMOLLM2_FOLDER_NAME}"
    assert volume_at(pod, init, args.model_tag) == volume_at(pod, container, args.model_tag)
    check_variables(init, {MODEL_CACHE_ENV})
    python, flag, code = argv_of(init, init_env)
    for node in (n for n in ast.walk(ast.parse(code)) if isinstance(n, ast.ImportFrom)):
        assert all(hasattr(importlib.import_module(node.module), a.name) for a in node.names)
    # vLLM's variables, those launch.py sets for vLLM-CPU, and the connector's token.
    known = {*vllm.envs.environment_variables, *vllm_cpu_env({}), "CACHETIER_REMOTE_TOKEN"}
    check_variables(container, known)
    assert env["VLLM_API_KEY"] == tokens["engine-api-key"] and (python, flag) == ("python", "-c")
    assert (
        memory_of(container)[0] >= (int(env["VLLM_CPU_KVCACHE_SPACE"]) << 30) + extra["cpu_bytes"]
    )


def test_prometheus_scrapes_what_deploy_prometheus_yml_does(base: list[dict], tokens: dict) -> None:
    from tests.deploy.promql import PROMETHEUS_FILE

    compose, jobs = yaml.safe_load(PROMETHEUS_FILE.read_text()), scrape_jobs(base)
    assert jobs.pop("") == compose["global"]
    # compose's jobs by the same path and authorization, at the same component's port; vLLM's.
    targets = {j["job_name"]: j["static_configs"][0]["targets"] for j in compose["scrape_configs"]}
    for job in compose["scrape_configs"]:
        ours = jobs[job["job_name"]]
        assert ours["metrics_path"] == job["metrics_path"]
        assert ours.get("authorization", {}).get("type") == job.get("authorization", {}).get("type")
    targets["vllm"] = ["engine-vllm:8000"]
    assert {name: _scraped(job, base) for name, job in jobs.items()} == targets
    # The sidecar's /metrics answer its admin tenant, whose token the Secret gives both.
    credentials = jobs["cachetier-sidecar"]["authorization"]["credentials_file"]
    assert file_at(base, pod_spec(base, "prometheus"), credentials, tokens) == tokens["ops-token"]
    binding = find_object(base, "RoleBinding", "prometheus")
    assert binding["subjects"][0]["name"] == pod_spec(base, "prometheus")["serviceAccountName"]
    (rule,) = find_object(base, "Role", binding["roleRef"]["name"])["rules"]
    assert rule["resources"] == ["pods"] and {"list", "watch"} <= set(rule["verbs"])


def _scraped(job: dict, objects: list[dict]) -> list[str]:
    """``component:port`` of each container port the job's keep and drop rules keep, from the
    labels Prometheus's pod discovery gives it."""
    rules = [r for r in job["relabel_configs"] if r.get("action") in ("keep", "drop")]
    kept = []
    for component, workload in workloads(objects).items():
        template, port_label = workload["spec"]["template"], "__meta_kubernetes_pod_container_port"
        labels = template["metadata"]["labels"].items()
        meta = {"__meta_kubernetes_pod_label_" + re.sub(r"\W", "_", k): v for k, v in labels}
        for port in [p for c in template["spec"]["containers"] for p in c.get("ports", [])]:
            meta[f"{port_label}_name"] = port["name"]
            meta[f"{port_label}_number"] = str(port["containerPort"])
            for rule in rules:
                value = ";".join(meta.get(name, "") for name in rule["source_labels"])
                if bool(re.fullmatch(rule["regex"], value)) != (rule["action"] == "keep"):
                    break
            else:
                kept.append(f"{component}:{port['containerPort']}")
    return kept


def test_grafana_loads_the_files_compose_mounts(base: list[dict]) -> None:
    service, expected = load_compose()["services"]["grafana"], {}
    for source, target in (v.split(":")[:2] for v in service["volumes"] if v.startswith("./")):
        files = [f for f in (ROOT / source).rglob("*") if f.is_file()]
        expected |= {f"{target}/{f.relative_to(ROOT / source)}": f.read_text() for f in files}
    # Every dashboard of deploy/grafana/dashboards, byte for byte, and the provisioning files.
    pod = pod_spec(base, "grafana")
    assert {path: file_at(base, pod, path) for path in expected} == expected
    assert {e["name"] for e in pod["containers"][0]["env"]} == set(service["environment"])


def test_redis_is_one_persisted_node_or_a_cluster(rendered: dict[str, list[dict]]) -> None:
    from cachetier.store.config import StoreConfig
    from cachetier.tiers.redis.cluster import parse_cluster_url

    compose = load_compose()["services"]["redis"]
    for name, objects in rendered.items():
        url = find_object(objects, "ConfigMap", "redis-url")["data"]["CACHETIER_REDIS_URL"]
        StoreConfig(redis_url=url)  # one the store takes
        (workload,) = [w for c, w in workloads(objects).items() if c in ("redis", "redis-cluster")]
        (container,) = workload["spec"]["template"]["spec"]["containers"]
        # Persisted as compose persists it, and evicting before its memory limit is reached.
        assert container["args"][: len(compose["command"])] == compose["command"]
        assert container["readinessProbe"]["exec"]["command"] == compose["healthcheck"]["test"][1:]
        maxmemory = container["args"][container["args"].index("--maxmemory") + 1]
        assert quantity_bytes(maxmemory) < memory_of(container)[1]
        service, port = workload["spec"]["serviceName"], container_ports(container)["redis"]
        assert find_object(objects, "Service", service)["spec"]["clusterIP"] == "None"
        pods = [f"{workload['metadata']['name']}-{i}" for i in range(workload["spec"]["replicas"])]
        nodes = [f"{pod}.{service}:{port}" for pod in pods]
        if name == "base":
            assert url == f"redis://{service}:{port}/0" and len(nodes) == 1
            continue
        assert [f"{host}:{p}" for host, p in parse_cluster_url(url).nodes] == nodes
        script = pod_spec(objects, "redis-cluster-create")["containers"][0]["args"][-1]
        assert all(node in script for node in nodes)
