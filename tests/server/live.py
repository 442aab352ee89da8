"""Real cachetier servers on 127.0.0.1 for tests: in a thread (fast to start and restart) or
as a ``cachetier serve`` subprocess (the CLI, its config loading and its signal handling)."""

from __future__ import annotations

import http.client
import json
import os
import signal
import subprocess
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import uvicorn

from cachetier.cli.main import serve_ports
from cachetier.server.app import create_app
from cachetier.server.config import ServerConfig
from cachetier.server.httpserver import http_server
from tests.support import AppThread, end_process, spawn_serve, wait_ports_file

ROOT = Path(__file__).resolve().parents[2]
TOKENS = {
    "alice": "alice-token-0123456789",
    "bob": "bob-token-0123456789ab",
    "ops": "ops-token-0123456789abc",
}


def test_config(data_dir: Path, **overrides: Any) -> ServerConfig:
    """Tenants alice, bob (and ops, an admin) with the tokens of ``TOKENS``; small limits."""
    values: dict[str, Any] = dict(
        host="127.0.0.1",
        port=0,  # the OS picks; ThreadServer.port says which
        data_dir=str(data_dir),
        cpu_bytes=64 << 20,
        disk_bytes=256 << 20,
        fsync=False,
        tenants={name: [token] for name, token in TOKENS.items()},
        admin_tenants=("ops",),
        max_block_bytes=1 << 20,
        max_batch_bytes=4 << 20,
        max_batch_blocks=64,
        max_keys=256,
        log_level="warning",
    )
    values.update(overrides)
    return ServerConfig.from_flat(values)


test_config.__test__ = False  # type: ignore[attr-defined]  # a helper, not a test


class ThreadServer(AppThread):
    """The sidecar (``create_app(config)``) in a thread of this process; restartable on the same
    port and data folder."""

    def __init__(self, config: ServerConfig) -> None:
        super().__init__(lambda: create_app(config), config.port, log_level=config.log_level)
        self.config = config

    def make_server(self) -> uvicorn.Server:
        # The server the CLI runs, with its connection guard: what the tests attack.
        return http_server(create_app(self.config), self.config)

    def start(self) -> ThreadServer:
        self.start_thread()
        # A restart (and ``with_config``) listens where this start did: pin what port 0 became.
        ports = serve_ports(self._server)
        pinned = {"transfer_port": ports["transfer"]} if ports["transfer"] is not None else {}
        self.config = replace(self.config, port=self.port, **pinned)
        wait_healthy(self.url)
        return self

    def restart(self) -> None:
        self.stop()
        self.start()

    def with_config(self, **changes: Any) -> ThreadServer:
        """A stopped server like this one with some settings changed (same port unless given)."""
        return ThreadServer(replace(self.config, **changes))


class ProcessServer:
    """``python -m cachetier.cli.main serve`` in a child process, stopped with SIGTERM; on ``port``,
    by default 0: the port the server reports in its ports file, which a restart keeps."""

    def __init__(self, args: list[str], env: dict[str, str], port: int = 0) -> None:
        self.args = args
        self.env = env
        self.port = port
        self.proc: subprocess.Popen[str] | None = None
        self.stderr = ""

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> ProcessServer:
        env = {**os.environ, "PYTHONPATH": str(ROOT), **self.env}
        with tempfile.TemporaryDirectory(prefix="cachetier-ports-") as folder:
            ports_file = Path(folder) / "ports.json"
            args = ["--port", str(self.port), "--ports-file", str(ports_file), *self.args]
            self.proc = spawn_serve(args, env)
            try:
                self.port = wait_ports_file(ports_file, self.proc)["http"]
                wait_healthy(self.url, proc=self.proc)
            except RuntimeError:
                self.stop()
                raise RuntimeError(f"cachetier serve did not start:\n{self.stderr}") from None
        return self

    def stop(self, sig: int = signal.SIGTERM) -> int:
        assert self.proc is not None, "not started"
        self.stderr += end_process(self.proc, sig)[1]
        return self.proc.returncode


def wait_healthy(url: str, timeout_s: float = 30, proc: subprocess.Popen | None = None) -> None:
    """Wait until ``GET /healthz`` answers 200."""
    host, port = url.removeprefix("http://").split(":")
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError("the server process exited")
        try:
            conn = http.client.HTTPConnection(host, int(port), timeout=2)
            conn.request("GET", "/healthz")
            if conn.getresponse().status == 200:
                conn.close()
                return
        except OSError:
            pass
        time.sleep(0.02)
    raise RuntimeError(f"{url}/healthz did not answer within {timeout_s} s")


def call(
    url: str,
    method: str,
    path: str,
    body: bytes | None = None,
    *,
    token: str | None = None,
    content_type: str | None = None,
    headers: dict[str, str] | None = None,
) -> tuple[int, dict[str, str], bytes]:
    """One raw HTTP request; returns (status, lower-case headers, body)."""
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    sent = dict(headers or {})
    if token is not None:
        sent["Authorization"] = f"Bearer {token}"
    if content_type is not None:
        sent["Content-Type"] = content_type
    try:
        conn.request(method, path, body=body, headers=sent)
        resp = conn.getresponse()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
    finally:
        conn.close()


def call_json(url: str, method: str, path: str, payload: Any = None, **kw: Any) -> tuple[int, Any]:
    """A request with a JSON body (if any); returns (status, decoded JSON answer or None)."""
    body = None if payload is None else json.dumps(payload).encode()
    ctype = None if payload is None else "application/json"
    status, _, data = call(url, method, path, body, content_type=ctype, **kw)
    return status, json.loads(data) if data else None


def serve_env(**settings: object) -> dict[str, str]:
    """The environment of a ``cachetier serve`` child of a test: this one's, the three tenants
    of ``TOKENS`` (``ops`` the admin), 64 MiB of CPU tier, 256 MiB of disk without fsync, and
    ``settings`` as ``CACHETIER_<FIELD>`` variables."""
    return {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "CACHETIER_TENANTS": ",".join(f"{name}:{token}" for name, token in TOKENS.items()),
        "CACHETIER_ADMIN_TENANTS": "ops",
        "CACHETIER_CPU_BYTES": str(64 << 20),
        "CACHETIER_DISK_BYTES": str(256 << 20),
        "CACHETIER_FSYNC": "false",
        **{f"CACHETIER_{name.upper()}": str(value) for name, value in settings.items()},
    }
