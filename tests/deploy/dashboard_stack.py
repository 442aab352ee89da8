"""The dashboard and docs/operations.md's PromQL against a real Prometheus scraping a live
stack.

``run_dashboard_check`` starts what docker-compose.yml runs, as local processes with small
capacities: a redis-server of its own, the sidecar (``python -m cachetier.cli.main serve``: CPU and
disk tiers, that Redis behind them) and the engine server (``python -m cachetier.engine.server``
with a tiny random-weight Llama; a CPU tier in the pod, then the sidecar). Prometheus scrapes both
with the jobs and credentials of ``deploy/prometheus.yml``. A little load follows: chats that share
system prompts (pool hits, then restores from the tiers once the small pool and tiers have
evicted them), a request with a wrong token (an error), and a lookup while Redis is paused (a
tier error). Then every query of the dashboard and of docs/operations.md is evaluated.

Both ``tests/deploy/test_dashboard.py`` and ``benchmarks/ops/dashboard.py`` call it.
"""

from __future__ import annotations

import json
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.deploy.local_stack import PORT_SLOT, LocalService, base_environment
from tests.deploy.promql import (
    PROMQL_DOC,
    Answer,
    Prometheus,
    check_dashboard,
    dashboard_queries,
    doc_queries,
    evaluate_all,
    load_dashboards,
    prometheus_binary,
    scrape_config,
    variable_values,
)
from tests.engine.server.live import add_byte_tokenizer
from tests.models import make_tiny_llama
from tests.support import PrivateRedis

ENGINE_TOKEN = "dashboard-engine-token-01"
OPS_TOKEN = "dashboard-ops-token-00001"
# Small on purpose, so that a few requests evict: a tiny-model block is 8 KiB (2 layers x K,V x
# 16 tokens x 2 heads x 16 dims x 4 bytes); the pool holds 48 of them, two prompts' worth.
POOL_BYTES = 48 * 8192
ENGINE_CPU_BYTES = 24 * 9000
SIDECAR_CPU_BYTES = 40 * 9000
SYSTEMS = [
    "You keep attention key and value blocks for later requests. " * 4,
    "You answer questions about tiered storage of transformer caches. " * 4,
]
QUESTIONS = [
    "Why keep the KV of a prefix?",
    "What does a miss cost?",
    "When is recomputing cheaper?",
]


@dataclass
class DashboardReport:
    """What a run found."""

    dashboard_answers: list[Answer]
    readme_answers: list[Answer]
    structure_problems: list[str]
    load: dict[str, Any] = field(default_factory=dict)

    def failures(self) -> list[str]:
        """One line per query without data, and per structural problem."""
        out = list(self.structure_problems)
        for answer in [*self.dashboard_answers, *self.readme_answers]:
            if not answer.has_data:
                why = answer.error or f"{answer.num_series} series, none a number"
                out.append(f"{answer.query.where}: {answer.expr} -> {why}")
        return out

    def figures(self) -> dict[str, Any]:
        """The benchmark's figures: queries, and those that returned data."""
        return {
            "dashboard_queries": len(self.dashboard_answers),
            "dashboard_queries_with_data": sum(a.has_data for a in self.dashboard_answers),
            "readme_queries": len(self.readme_answers),
            "readme_queries_with_data": sum(a.has_data for a in self.readme_answers),
            "dashboard_structure_problems": len(self.structure_problems),
            **self.load,
        }


def _healthcheck(port: int | str) -> list[str]:
    # The compose services' own healthcheck, against this run's port.
    url = f"http://127.0.0.1:{port}/healthz"
    return [sys.executable, "-c", f"import urllib.request; urllib.request.urlopen({url!r})"]


def _base_env() -> dict[str, str]:
    # Only what Python needs: no CACHETIER_* of the caller's.
    return {**base_environment(), "OMP_NUM_THREADS": "1"}


def sidecar_service(folder: Path, redis_url: str) -> LocalService:
    """The compose sidecar's command with this run's folder, Redis and small capacities."""
    data = folder / "sidecar-data"
    data.mkdir(parents=True, exist_ok=True)
    ports_file = folder / "sidecar-ports.json"
    argv = [sys.executable, "-m", "cachetier.cli.main", "serve", "--host", "127.0.0.1"]
    argv += ["--port", "0", "--ports-file", str(ports_file)]
    argv += ["--transfer-port", "0", "--data-dir", str(data)]
    argv += ["--redis-url", redis_url, "--log-level", "warning"]
    env = {
        **_base_env(),
        "CACHETIER_TENANTS": f"engine:{ENGINE_TOKEN},ops:{OPS_TOKEN}",
        "CACHETIER_ADMIN_TENANTS": "ops",
        "CACHETIER_CPU_BYTES": str(SIDECAR_CPU_BYTES),
        "CACHETIER_DISK_BYTES": str(64 << 20),
        "CACHETIER_LIVE_CURVE": "true",  # the "what more capacity would buy" panel
        "CACHETIER_FSYNC": "false",
    }
    check = _healthcheck(PORT_SLOT)
    log = folder / "sidecar.log"
    return LocalService("sidecar", argv, env, check, 0, log, ports_file=ports_file)


def engine_service(folder: Path, model: Path, sidecar_port: int) -> LocalService:
    """The compose engine's command with the tiny model, a small pool and small CPU tier."""
    ports_file = folder / "engine-ports.json"
    argv = [sys.executable, "-m", "cachetier.engine.server", "--model", str(model)]
    argv += ["--served-model-name", "tiny", "--host", "127.0.0.1", "--port", "0"]
    argv += ["--ports-file", str(ports_file)]
    argv += ["--kv-cache-bytes", str(POOL_BYTES), "--num-threads", "1", "--log-level", "warning"]
    # The load's third round must restore (the restore panels need data): no hit is drawn
    # for the guard's check, which tests/engine/test_guard_engine.py covers.
    argv += ["--no-guard"]
    env = {
        **_base_env(),
        "CACHETIER_CPU_BYTES": str(ENGINE_CPU_BYTES),
        "CACHETIER_LIVE_CURVE": "true",
        "CACHETIER_REMOTE_URL": f"http://127.0.0.1:{sidecar_port}",
        "CACHETIER_REMOTE_TOKEN": ENGINE_TOKEN,
    }
    check = _healthcheck(PORT_SLOT)
    log = folder / "engine.log"
    return LocalService("engine", argv, env, check, 0, log, ports_file=ports_file)


def _request(port: int, path: str, body: dict | None = None, token: str | None = None) -> int:
    """GET (no body) or POST ``body``; returns the status."""
    headers = {"Content-Type": "application/json"}
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data, headers)
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            response.read()
            return response.status
    except urllib.error.HTTPError as exc:
        return exc.code


def drive_load(engine: LocalService, sidecar: LocalService, redis: PrivateRedis) -> dict:
    """Chats sharing system prompts, a refused request, and a lookup while Redis hangs."""

    def chat(system: str, question: str) -> int:
        messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
        body = {"model": "tiny", "messages": messages, "max_tokens": 4, "temperature": 0}
        return _request(engine.port, "/v1/chat/completions", body)

    statuses = []
    # Each system prompt twice in a row (pool hits), the other in between (the pool and the
    # engine's CPU tier evict it), so the third round restores from the tiers.
    for _ in range(3):
        for system in SYSTEMS:
            for question in QUESTIONS[:2]:
                statuses.append(chat(system, question))
    # A sidecar request with a wrong token: the 401 is an error the dashboard shows.
    refused = _request(sidecar.port, "/v1/stats", token="not-a-token-0000000000")
    # A prompt nobody sent: its lookup reaches Redis, which hangs, so the tier counts an error.
    redis.pause()
    try:
        statuses.append(chat("A prompt that no tier holds. " * 6, QUESTIONS[2]))
    finally:
        redis.resume()
    statuses.append(chat(SYSTEMS[0], QUESTIONS[0]))
    return {
        "load_requests": len(statuses),
        "load_requests_ok": sum(s == 200 for s in statuses),
        "load_refused_status": refused,
    }


@dataclass
class LiveStack:
    """A running stack: Prometheus scraping it, and what the load did."""

    prometheus: Prometheus
    load: dict[str, Any]


@contextmanager
def running_stack(folder: Path) -> Iterator[LiveStack]:
    """Start Redis, the sidecar, the engine and Prometheus in ``folder``, drive the load, and
    wait until Prometheus has scraped its end; everything is stopped on leaving.

    Args:
        folder: an empty folder for data, logs and the model (removed by the caller).
    """
    prometheus_binary()  # before anything starts: a missing package fails at once
    model = make_tiny_llama(folder / "tiny-llama", seed=0)
    add_byte_tokenizer(model)
    (folder / "redis").mkdir()
    redis = PrivateRedis(folder / "redis")
    started: list[Any] = []
    try:
        redis.start()
        started.append(redis)
        sidecar = sidecar_service(folder, redis.url)
        sidecar.start()
        started.append(sidecar)
        sidecar.wait_healthy(timeout_s=60)
        engine = engine_service(folder, model, sidecar.port)
        engine.start()
        started.append(engine)
        engine.wait_healthy(timeout_s=180)
        targets = {
            "sidecar:8470": f"127.0.0.1:{sidecar.port}",
            "engine:8000": f"127.0.0.1:{engine.port}",
        }
        (folder / "prometheus").mkdir()
        prometheus = Prometheus(folder / "prometheus", scrape_config(targets, OPS_TOKEN))
        started.append(prometheus)
        prometheus.start()
        prometheus.wait_targets_up()
        load = drive_load(engine, sidecar, redis)
        prometheus.wait_scrapes_after(time.time())
        yield LiveStack(prometheus, load)
    finally:
        for part in reversed(started):
            part.stop()


def check_queries(
    prometheus: Prometheus,
    dashboards: dict[str, dict[str, Any]],
    readme_text: str,
    load: dict[str, Any] | None = None,
) -> DashboardReport:
    """Evaluate every query of ``dashboards`` (their variables resolved through Prometheus)
    and of ``readme_text``, and check the dashboards' structure."""
    problems = [f"{name}: {p}" for name, d in dashboards.items() for p in check_dashboard(d)]
    dashboard_answers = []
    for name, dashboard in dashboards.items():
        try:
            values = variable_values(prometheus, dashboard)
        except ValueError as exc:
            problems.append(f"{name}: {exc}")
            continue
        dashboard_answers += evaluate_all(prometheus, dashboard_queries(dashboard), values)
    queries = doc_queries(readme_text)
    readme_answers = evaluate_all(prometheus, queries, variable_values(prometheus, {}))
    return DashboardReport(dashboard_answers, readme_answers, problems, dict(load or {}))


def run_dashboard_check(folder: Path, readme: Path = PROMQL_DOC) -> DashboardReport:
    """Start the stack and Prometheus in ``folder``, drive load, evaluate every query, stop.

    Args:
        folder: an empty folder for data, logs and the model (removed by the caller).
        readme: the docs page whose PromQL is checked.

    Returns:
        Each query's answer, the dashboards' structural problems, and the load's figures.
    """
    dashboards = load_dashboards()
    if not dashboards:
        raise FileNotFoundError("no dashboard JSON in deploy/grafana/dashboards")
    with running_stack(folder) as stack:
        return check_queries(stack.prometheus, dashboards, readme.read_text(), stack.load)
