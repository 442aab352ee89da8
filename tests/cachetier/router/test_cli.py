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


def test_the_curve_flags_reach_the_router_config(tmp_path: Path) -> None:
    from cachetier.cli.kv_events_keys import write_keys
    from cachetier.cli.main import build_parser
    from cachetier.cli.route import check_curve_files, route_config

    write_keys(tmp_path, ["router"])
    key, server = str(tmp_path / "router.key_secret"), str(tmp_path / "publisher.key")
    argv = ["route", "--replica", "http://127.0.0.1:1", "--events-curve-key", key]
    config = route_config(build_parser().parse_args([*argv, "--events-curve-server-key", server]))
    assert (config.events_curve_key, config.events_curve_server_key) == (key, server)
    check_curve_files(config)  # real certificates load
    with pytest.raises(ValueError, match="go together"):
        route_config(build_parser().parse_args(argv))
    # The publisher's public certificate is no secret key for the router.
    swapped = route_config(
        build_parser().parse_args(
            [*argv[:3], "--events-curve-key", server, "--events-curve-server-key", server]
        )
    )
    with pytest.raises(ValueError, match="no secret key"):
        check_curve_files(swapped)


def test_placeholder_curve_files_keep_the_router_from_starting(tmp_path: Path) -> None:
    placeholder = tmp_path / "router.key_secret"
    placeholder.write_text("CHANGE-ME\n")
    args = ["--replica", "http://127.0.0.1:1", "--events-curve-key", str(placeholder)]
    proc = _route(
        [*args, "--events-curve-server-key", str(placeholder), "--port", "0"], dict(os.environ)
    )
    proc.wait(timeout=60)
    _, err = end_process(proc)
    assert proc.returncode == 2 and "not a ZMQ certificate" in err, err[-2000:]
