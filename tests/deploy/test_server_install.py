"""``pip install cachetier[server]``, the sidecar's install shape (issue 19): the wheel of this
checkout in a fresh venv with only that extra (``scripts/setup_server.sh``, what the sidecar
image runs). No torch, transformers or vLLM there, and the sidecar, every tier and
``cachetier report`` work from it.

The venv is built once per module through pip and its mirror (pip's cache kept: seconds when
warm). Everything in it runs from the venv's own folder, so the checkout cannot stand in for the
installed package.
"""

from __future__ import annotations

import json
import signal
import sys
from pathlib import Path

import pytest
import redis

from cachetier.primitives.keys import Namespace
from cachetier.tiers.remote import RemoteTier, RemoteTierConfig
from cachetier.util.sidecar_http import TOKEN_ENV
from tests.cachetier.report import tiny
from tests.deploy.server_env import (
    HEAVY_MODULES,
    REPORT_MODULES,
    ROOT,
    ServerEnv,
    copied_parts,
    make_server_env,
    serving,
)
from tests.server.live import TOKENS
from tests.support import make_blocks, write_engine_event_log

if sys.version_info >= (3, 11):
    import tomllib
else:  # the server extra brings tomli there
    import tomli as tomllib

# torch's CPU wheel alone installs to more than this; the server env measured 265 MiB here.
MAX_SERVER_ENV_MIB = 400
INTACT = {"stored": 3, "found": 3, "intact": 3}


@pytest.fixture(scope="module")
def server_env(tmp_path_factory: pytest.TempPathFactory) -> ServerEnv:
    return make_server_env(tmp_path_factory.mktemp("server-env") / "venv")


def test_the_wheel_is_built_from_every_package_of_pyproject() -> None:
    # The script copies a checkout's parts to build the wheel from: a package added to
    # pyproject.toml and not to the script would be missing from the sidecar's wheel.
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    folders = set(project["tool"]["setuptools"]["package-dir"].values())
    files = {"pyproject.toml", project["project"]["readme"], *project["project"]["license-files"]}
    assert set(copied_parts()) == folders | files


@pytest.mark.slow(reason="builds the wheel into a fresh server venv with pip and checks it")
def test_the_server_extra_brings_no_engine_stack(server_env: ServerEnv) -> None:
    probe = server_env.probe()
    present = probe["modules"]
    assert not [m for m in HEAVY_MODULES if present[m]], present
    assert all(present[m] for m in (*REPORT_MODULES, "fastapi", "uvicorn")), present
    # The venv's own copy, every module of it importable without torch.
    assert Path(probe["cachetier_file"]).resolve().is_relative_to(server_env.venv.resolve())
    assert probe["import_failures"] == []
    check = server_env.run([server_env.python, "-m", "pip", "check"])
    assert check.returncode == 0, check.stdout + check.stderr
    assert 0 < server_env.size_mib() < MAX_SERVER_ENV_MIB


@pytest.mark.slow(reason="builds the wheel into a fresh server venv and runs every tier from it")
def test_every_tier_works_in_the_server_env(
    server_env: ServerEnv, tmp_path: Path, redis_url: str, redis_prefix: str
) -> None:
    settings = {"data_dir": str(tmp_path), "redis_url": redis_url, "redis_prefix": redis_prefix}
    tiers = server_env.probe(settings)["tiers"]
    assert tiers == {"cpu": INTACT, "disk": INTACT, "redis": INTACT}
    assert any((tmp_path / "disk").rglob("*")), "the disk tier wrote nothing"
    client = redis.Redis.from_url(redis_url)
    try:
        assert len(list(client.scan_iter(match=f"{redis_prefix}:*"))) == 3
    finally:
        client.close()


@pytest.mark.slow(reason="builds the wheel into a fresh server venv and runs the sidecar from it")
def test_the_sidecar_serves_from_the_server_env(
    server_env: ServerEnv,
    tmp_path: Path,
    redis_url: str,
    redis_prefix: str,
    namespace: Namespace,
) -> None:
    blocks = make_blocks(namespace, 6)
    keys = [b.key for b in blocks]
    html, out = tmp_path / "report" / "stats.html", tmp_path / "report" / "stats.json"
    with serving(server_env, tmp_path / "data", TOKENS, "ops", redis_url, redis_prefix) as served:
        # This checkout's client, in the tests' full environment, against the lean sidecar.
        config = RemoteTierConfig(url=served.url, token=TOKENS["alice"])
        with RemoteTier(config) as tier:
            assert tier.put_many(namespace.id, blocks) == 6
            assert tier.get_many(namespace.id, keys) == blocks
        # The server env's own client against it.
        settings = {"remote_url": served.url, "remote_token": TOKENS["bob"]}
        assert server_env.probe(settings)["tiers"]["remote"] == INTACT
        # `cachetier report` of the live server's counters, from the server env.
        argv = [server_env.cachetier, "report", "--stats", served.url, "--out", html]
        report = server_env.run(
            [*argv, "--json-out", out, "--quiet"], env={TOKEN_ENV: TOKENS["ops"]}
        )
        assert report.returncode == 0, report.stderr
    # uvicorn shuts down on SIGTERM, then re-raises it: the status may say SIGTERM.
    assert served.returncode in (0, -signal.SIGTERM), served.stderr
    assert "store flushed and closed" in served.stderr
    assert TOKENS["alice"] not in served.stderr and TOKENS["ops"] not in served.stderr

    rows = json.loads(out.read_text())["figures"]["tier_counters"]["rows"]
    by_name = {(r[0], r[1]) for r in rows}
    assert {("tier", "cpu"), ("tier", "disk"), ("tier", "redis")} <= by_name, by_name
    assert '<section id="tier_counters">' in html.read_text()
    # Written through to Redis (flushed by the SIGTERM at the latest): alice's 6, bob's 3.
    client = redis.Redis.from_url(redis_url)
    try:
        assert len(list(client.scan_iter(match=f"{redis_prefix}:*"))) >= 9
    finally:
        client.close()


@pytest.mark.slow(reason="builds the wheel into a fresh server venv and runs the report from it")
def test_the_report_works_in_the_server_env(server_env: ServerEnv, tmp_path: Path) -> None:
    log_path = tmp_path / "events.jsonl"
    write_engine_event_log(log_path, {"cpu": 160, "redis": 320})
    stats = tmp_path / "stats.json"
    snapshot = {"hits": 30, "misses": 10, "puts": 5, "hit_rate": 0.75, "used_bytes": 1024}
    stats.write_text(json.dumps({"tiers": {"cpu": snapshot}, "tenants": {}}))
    trace = tiny.write_tiny_trace(tmp_path / "tiny.jsonl")
    replay = ["--cpu-blocks", "3", "--disk-blocks", "100", "--capacities", "1,2", "--jobs", "1"]
    for name, inputs in {
        "events": ["--events", log_path, "--stats", stats],
        "trace": ["--trace", trace, *replay],
    }.items():
        html, doc_path, png = (tmp_path / name / f"report.{x}" for x in ("html", "json", "png"))
        outputs = ["--out", html, "--json-out", doc_path, "--png-out", png, "--quiet"]
        done = server_env.run([server_env.cachetier, "report", *inputs, *outputs])
        assert done.returncode == 0, done.stderr
        doc = json.loads(doc_path.read_text())
        page = html.read_text()
        for figure in ("hit_rate_over_time", "per_tier", "per_tenant"):
            assert figure in doc["figures"] and f'<section id="{figure}">' in page
        assert png.read_bytes().startswith(b"\x89PNG\r\n\x1a\n")
        assert "wrote" in done.stdout
    events = json.loads((tmp_path / "events" / "report.json").read_text())
    assert events["headline"]["num_lookups"] == 40
    assert events["headline"]["hit_tokens_by_source"] == {"cpu": 20 * 160, "redis": 20 * 320}
    assert "tier_counters" in events["figures"]
    traced = json.loads((tmp_path / "trace" / "report.json").read_text())
    assert traced["figures"]["capacity_curve"]["capacities"] == [1, 2, 3, 100]
