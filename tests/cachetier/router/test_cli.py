"""``cachetier route`` as a user runs it: a child process on port 0 that reports its port,
routes a request to a real engine server with the keys from the environment (never a flag, and
never printed), and stops cleanly on SIGTERM; a bad configuration exits 2."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from tests.engine.server.live import EngineServer, post
from tests.support import end_process, spawn_cli, wait_ports_file

ROUTER_KEY = "router-secret-key-0001"


def _route(args: list[str], env: dict[str, str]) -> subprocess.Popen[str]:
    return spawn_cli("route", args, env)


@pytest.mark.slow(reason="starts the router as a child process before a tiny-model engine server")
def test_the_router_command_routes_and_keeps_its_key_to_itself(
    replica: EngineServer, router_model_dir: Path, tmp_path: Path
) -> None:
    ports = tmp_path / "ports.json"
    env = {**os.environ, "CACHETIER_ROUTER_API_KEY": ROUTER_KEY}
    args = ["--replica", replica.url, "--model", str(router_model_dir), "--port", "0"]
    proc = _route([*args, "--ports-file", str(ports)], env)
    try:
        url = f"http://127.0.0.1:{wait_ports_file(ports, proc)['http']}"
        body = {"prompt": "hello", "max_tokens": 2, "temperature": 0}
        assert post(url, "/v1/completions", body)[0] == 401
        status, answer = post(url, "/v1/completions", body, Authorization=f"Bearer {ROUTER_KEY}")
        assert status == 200 and answer["choices"][0]["text"] is not None
    finally:
        out, err = end_process(proc)
    assert proc.returncode == 0, err[-2000:]
    assert ROUTER_KEY not in out + err


def test_a_bad_configuration_exits_2() -> None:
    proc = _route(["--replica", "ftp://nowhere"], dict(os.environ))
    proc.wait(timeout=60)
    _, err = end_process(proc)
    assert proc.returncode == 2 and "http://" in err
