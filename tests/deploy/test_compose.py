"""docker-compose.yml: valid against the compose spec, and its stack comes up and serves.

No Docker engine runs here: the stack test starts each service's own command locally
(``tests/deploy/local_stack.py``), restarts the engine, and shows that the restarted engine
answers the same request with cached tokens that came back from the sidecar.
"""

from __future__ import annotations

import json
import re
import shutil
import urllib.request
from importlib.resources import files
from pathlib import Path

import jsonschema
import pytest
import redis
import yaml
from prometheus_client.parser import text_string_to_metric_families

from tests.deploy.local_stack import (
    COMPOSE_FILE,
    CONTAINER_PORTS,
    ROOT,
    base_environment,
    load_compose,
    local_services,
)
from tests.deploy.server_env import SETUP_SCRIPT, copied_parts

# check-jsonschema vendors the compose spec's schema, with the spec's license beside it.
SCHEMA = Path(str(files("check_jsonschema.builtin_schemas.vendor") / "compose-spec.json"))
PROMETHEUS_FILE = ROOT / "deploy" / "prometheus.yml"
# The install each cachetier service's image runs: the lean sidecar, the full engine.
INSTALLS = {"sidecar": "bash scripts/setup_server.sh", "engine": "make setup"}


@pytest.fixture(scope="module")
def compose() -> dict:
    return load_compose()


def test_compose_file_is_valid_against_the_compose_spec() -> None:
    if not SCHEMA.is_file():
        pytest.fail(f"the compose-spec schema is missing at {SCHEMA}")
    schema = json.loads(SCHEMA.read_text())
    raw = yaml.safe_load(COMPOSE_FILE.read_text())  # validated before interpolation, as compose
    _validator(schema).validate(raw)


def test_a_broken_compose_file_fails_the_schema() -> None:
    # The check above can fail: a misspelt key is refused by the same schema.
    schema = json.loads(SCHEMA.read_text())
    raw = yaml.safe_load(COMPOSE_FILE.read_text())
    raw["services"]["redis"]["helthcheck"] = raw["services"]["redis"].pop("healthcheck")
    with pytest.raises(jsonschema.ValidationError):
        _validator(schema).validate(raw)


def _validator(schema: dict) -> jsonschema.protocols.Validator:
    # The draft the schema names in "$schema" (2020-12 in today's spec), checked itself first.
    cls = jsonschema.validators.validator_for(schema)
    cls.check_schema(schema)
    return cls(schema)


def test_every_service_has_a_healthcheck_and_declared_volumes(compose: dict) -> None:
    services = compose["services"]
    assert set(services) == set(CONTAINER_PORTS)
    for name, spec in services.items():
        assert spec.get("healthcheck", {}).get("test"), f"{name} has no healthcheck"
        for volume in spec.get("volumes", []):
            source = volume.split(":")[0]
            assert source.startswith("./") or source in compose["volumes"], (name, source)
    # Redis persists to its volume; the engine keeps the converted model on one.
    assert "--appendonly" in services["redis"]["command"]
    assert any(v.startswith("redis-data:") for v in services["redis"]["volumes"])
    assert any(v.startswith("model-cache:") for v in services["engine"]["volumes"])
    assert services["engine"]["environment"]["CACHETIER_REMOTE_URL"] == "http://sidecar:8470"


def test_each_cachetier_service_builds_its_own_image(compose: dict) -> None:
    stages = _dockerfile_stages()
    images = {}
    for name, install in INSTALLS.items():
        build = compose["services"][name]["build"]
        assert build["context"] == "." and build["dockerfile"] == "Dockerfile", name
        steps = _stage_with_sources(stages, build["target"])
        assert any(s.startswith("RUN ") and install in s for s in steps), (name, steps)
        images[name] = compose["services"][name]["image"]
    assert len(set(images.values())) == len(images), images
    assert "scripts/setup.sh" in (ROOT / "Makefile").read_text()
    # `docker build .` with no target still builds the full image.
    assert list(stages)[-1] == compose["services"]["engine"]["build"]["target"]


def test_the_sidecar_image_installs_only_the_server_extra(compose: dict) -> None:
    # Without a Docker engine here, the image's install is checked by running the same script:
    # tests/deploy/test_server_install.py runs scripts/setup_server.sh and serves from its venv.
    target = compose["services"]["sidecar"]["build"]["target"]
    steps = _stage_with_sources(_dockerfile_stages(), target)
    text = "\n".join(steps)
    assert SETUP_SCRIPT.relative_to(ROOT).as_posix() in text
    for heavy in ("make setup", "scripts/setup.sh", "torch", "PIP_EXTRA_INDEX_URL"):
        assert heavy not in text, heavy
    # It copies what the script builds the wheel from.
    copied = {source for s in steps if s.startswith("COPY ") for source in s.split()[1:-1]} - {
        f"--from={name}" for name in _dockerfile_stages()
    }
    assert set(copied_parts()) <= copied, copied


def _dockerfile_stages() -> dict[str, list[str]]:
    """The Dockerfile's instructions by stage name (``FROM ... AS name``), continuation lines
    joined and comments dropped."""
    stages: dict[str, list[str]] = {}
    current: list[str] = []
    text = re.sub(r"\\\n\s*", " ", (ROOT / "Dockerfile").read_text())
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        match = re.fullmatch(r"FROM\s+\S+\s+AS\s+(\S+)", line, flags=re.IGNORECASE)
        if match:
            current = stages.setdefault(match[1], [])
        current.append(line)
    return stages


def _stage_with_sources(stages: dict[str, list[str]], name: str) -> list[str]:
    """A stage's instructions, after those of the stages it copies from (``COPY --from``)."""
    steps: list[str] = []
    for step in stages[name]:
        source = re.match(r"COPY\s+--from=(\S+)", step)
        if source:
            steps += _stage_with_sources(stages, source[1])
    return steps + stages[name]


def test_prometheus_scrapes_the_sidecar_and_the_engine(compose: dict) -> None:
    config = yaml.safe_load(PROMETHEUS_FILE.read_text())
    targets = {
        t for job in config["scrape_configs"] for s in job["static_configs"] for t in s["targets"]
    }
    assert targets == {"sidecar:8470", "engine:8000"}
    mounts = compose["services"]["prometheus"]["volumes"]
    assert "./deploy/prometheus.yml:/etc/prometheus/prometheus.yml:ro" in mounts


def _post(url: str, body: dict) -> dict:
    request = urllib.request.Request(
        url, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=600) as response:
        return json.loads(response.read())


def _scrape(url: str, token: str | None) -> set[str]:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    request = urllib.request.Request(url, headers=headers)
    with urllib.request.urlopen(request, timeout=30) as response:
        text = response.read().decode()
    return {family.name for family in text_string_to_metric_families(text)}


@pytest.mark.slow(reason="starts Redis, the sidecar and a SmolLM2 engine, then restarts the engine")
@pytest.mark.model
def test_the_stack_serves_cached_tokens_after_an_engine_restart(
    compose: dict, smollm2_dir: Path, tmp_path: Path
) -> None:
    services = local_services(compose, tmp_path, ["redis", "sidecar", "engine"], base_environment())
    # The model-cache volume as it is after the engine's first start: the converted model.
    models = Path(services["engine"].env["CACHETIER_MODEL_CACHE"])
    models.mkdir(parents=True, exist_ok=True)
    (models / smollm2_dir.name).symlink_to(smollm2_dir, target_is_directory=True)
    engine = services["engine"]
    question = {
        "model": "smollm2",
        "messages": [
            {"role": "system", "content": "You answer questions about caching. " * 12},
            {"role": "user", "content": "Why keep attention KV after a request ends?"},
        ],
        "max_tokens": 8,
        "temperature": 0,
    }
    try:
        for name in ("redis", "sidecar", "engine"):
            services[name].start()
            services[name].wait_healthy(timeout_s=300 if name == "engine" else 60)
        # Known once it started: its own bind chose it (a restart asks for it again).
        url = f"http://127.0.0.1:{engine.port}/v1/chat/completions"
        cold = _post(url, question)
        assert engine.stop() == 0, engine.log()  # SIGTERM: flushes its tiers to the sidecar
        engine.start()
        engine.wait_healthy(timeout_s=300)
        # The restore guard (on by default) computes the restarted engine's first hit and
        # compares it with the sidecar's records: another user's question on the same system
        # prompt takes that turn, and the question after it is restored.
        probe = {**question, "messages": [question["messages"][0], _ask("What is a KV block?")]}
        assert _post(url, probe)["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        warm = _post(url, question)

        prompt_tokens = cold["usage"]["prompt_tokens"]
        cached = warm["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cold["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        # Every full block of the prompt came back; only the partial last block is recomputed.
        assert cached >= prompt_tokens - 16 and cached > 0
        by_source = warm["cachetier"]["cached_tokens_by_source"]
        assert set(by_source) <= {"pool", "remote"} and by_source["remote"] > 0
        assert sum(by_source.values()) == cached
        assert warm["choices"][0]["message"] == cold["choices"][0]["message"]

        # The sidecar wrote the blocks through to Redis, whose append-only file is on its volume.
        client = redis.Redis(port=services["redis"].port)
        assert client.dbsize() > 0
        client.close()
        assert any((tmp_path / "volumes" / "redis-data").iterdir())

        # What Prometheus scrapes, with the credentials of deploy/prometheus.yml.
        config = yaml.safe_load(PROMETHEUS_FILE.read_text())
        for job in config["scrape_configs"]:
            (target,) = job["static_configs"][0]["targets"]
            service = target.split(":")[0]
            token = job.get("authorization", {}).get("credentials")
            port = services[service].port
            names = _scrape(f"http://127.0.0.1:{port}{job['metrics_path']}", token)
            assert names, f"{service} exposes no metrics"
    finally:
        for service in reversed(list(services.values())):
            service.stop()
        shutil.rmtree(tmp_path / "volumes", ignore_errors=True)


def _ask(text: str) -> dict[str, str]:
    return {"role": "user", "content": text}
