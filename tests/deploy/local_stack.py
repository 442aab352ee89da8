"""Runs the services of docker-compose.yml as local processes, as the compose file says.

No Docker engine runs here, so each service's own command, environment and healthcheck are
taken from the file and translated the way a container network would resolve them: a service
name and container port (``sidecar:8470``) become ``127.0.0.1:<its port>``, ``0.0.0.0``
becomes ``127.0.0.1``, a named volume's mount point becomes a temporary folder, and the
executables (``python``, ``cachetier``, ``redis-server``) are this machine's. Nothing else is
changed, so a wrong flag, variable or path in the compose file fails here.

No port is reserved ahead: services start in order, each on a port of its own bind (ours on
``--port 0`` with a ports file, Redis on a random port tried again while its bind finds it
taken), and a service's references to the others are translated when it starts. A restarted
service asks for the port it had.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from tests.support import start_on_a_free_port, wait_ports_file

ROOT = Path(__file__).resolve().parents[2]
COMPOSE_FILE = ROOT / "docker-compose.yml"
# The port each service listens on inside its container (images' defaults and our flags).
CONTAINER_PORTS = {
    "redis": 6379,
    "sidecar": 8470,
    "engine": 8000,
    "prometheus": 9090,
    "grafana": 3000,
}
PORT_SLOT = "{port}"  # in a healthcheck of a service with a ports file: its port
# Services that write a ports file (``--port 0 --ports-file``) and the one that logs its bind.
_PORTS_FILE_SERVICES = ("sidecar", "engine")
_REDIS = "redis"
_VARIABLE = re.compile(r"\$\{(?P<name>[A-Za-z_][A-Za-z0-9_]*)(?::-(?P<default>[^}]*))?\}")


def interpolate(value: Any, env: Mapping[str, str]) -> Any:
    """Compose's ``${NAME}`` / ``${NAME:-default}`` substitution, through lists and dicts."""
    if isinstance(value, str):
        return _VARIABLE.sub(lambda m: env.get(m["name"]) or (m["default"] or ""), value)
    if isinstance(value, list):
        return [interpolate(v, env) for v in value]
    if isinstance(value, dict):
        return {k: interpolate(v, env) for k, v in value.items()}
    return value


def load_compose(path: Path = COMPOSE_FILE, env: Mapping[str, str] | None = None) -> dict:
    """The compose file as data, variables substituted from ``env`` (default: none set)."""
    raw = yaml.safe_load(path.read_text(encoding="utf-8"))
    return interpolate(raw, env or {})


@dataclass
class LocalService:
    """One compose service as a local process. With ``ports_file``, it listens on port 0 and
    says where in that file: ``wait_healthy`` reads ``port`` there, and puts it in place of
    ``PORT_SLOT`` in the healthcheck."""

    name: str
    argv: list[str]
    env: dict[str, str]
    healthcheck: list[str] | None
    port: int
    log_path: Path
    process: subprocess.Popen | None = field(default=None, repr=False)
    ports_file: Path | None = None
    # Of a compose stack: every started service's port by name, shared by the stack's services
    # (their argv, environment and healthcheck name the others as ``name:container port``);
    # ``None`` for a service built by hand.
    stack_ports: dict[str, int] | None = None

    def start(self) -> None:
        if self.ports_file is not None:
            self.ports_file.unlink(missing_ok=True)  # a restart's file is a new one
        argv, env = self.argv, self.env
        if self.stack_ports is not None:
            argv = [_resolve(a, self.stack_ports) for a in argv]
            env = {k: _resolve(v, self.stack_ports) for k, v in env.items()}
        if self.stack_ports is not None and self.name == _REDIS and not self.port:
            # Redis cannot say which port a bind to 0 got: its own bind decides, retried.
            self.port, self.process = start_on_a_free_port(
                lambda port: self._popen(_with_port(argv, port), env), self.log_path
            )
            self.stack_ports[self.name] = self.port
            return
        self.process = self._popen(_with_port(argv, self.port), env)

    def _popen(self, argv: list[str], env: dict[str, str]) -> subprocess.Popen:
        log = open(self.log_path, "ab")  # noqa: SIM115 - the child owns it while it runs
        try:
            return subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
        finally:
            log.close()

    def wait_healthy(self, timeout_s: float) -> None:
        """Run the service's own healthcheck until it passes (or the process dies)."""
        deadline = time.monotonic() + timeout_s
        check = self.healthcheck
        if self.ports_file is not None:
            try:
                self.port = wait_ports_file(self.ports_file, self.process, timeout_s)["http"]
            except RuntimeError as exc:
                raise RuntimeError(f"{self.name}: {exc}: {self.log()}") from None
            if self.stack_ports is not None:
                self.stack_ports[self.name] = self.port
        check = check and [a.replace(PORT_SLOT, str(self.port)) for a in check]
        while time.monotonic() < deadline:
            if self.process is not None and self.process.poll() is not None:
                code = self.process.returncode
                raise RuntimeError(f"{self.name} exited with {code}: {self.log()}")
            if (
                check is None
                or subprocess.run(check, env=self.env, capture_output=True, timeout=10).returncode
                == 0
            ):
                return
            time.sleep(0.5)
        raise TimeoutError(f"{self.name} not healthy after {timeout_s} s: {self.log()}")

    def stop(self, timeout_s: float = 60.0) -> int | None:
        """SIGTERM, as ``docker compose stop`` sends, then wait; SIGKILL only past the timeout."""
        if self.process is None or self.process.poll() is not None:
            return None if self.process is None else self.process.returncode
        self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
            return None

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]


def _executable(name: str) -> str:
    if name in ("python", "python3"):
        return sys.executable
    beside = Path(sys.executable).parent / name  # console scripts of this venv
    if beside.exists():
        return str(beside)
    found = shutil.which(name)
    if found is None:
        raise FileNotFoundError(f"{name!r} (a compose command) is not installed here")
    return found


def local_services(
    compose: dict, work_dir: Path, services: list[str], base_env: Mapping[str, str]
) -> dict[str, LocalService]:
    """Translate ``services`` of ``compose`` into ``LocalService`` objects (not started).

    Args:
        compose: the interpolated compose data.
        work_dir: where volumes and logs go.
        services: names of the services to run.
        base_env: the environment every process starts from (a container's is nearly empty;
            ours keeps PATH and HOME so that Python and the venv work).
    """
    ports: dict[str, int] = {}  # filled as the services start
    volume_dirs = {name: work_dir / "volumes" / name for name in compose.get("volumes", {})}

    def translate(text: str, mounts: dict[str, Path]) -> str:
        text = text.replace("0.0.0.0", "127.0.0.1")
        for target, local in mounts.items():
            if text == target or text.startswith(target + "/"):
                text = str(local) + text[len(target) :]
        return text

    out = {}
    for name in services:
        spec = compose["services"][name]
        mounts = {}
        for volume in spec.get("volumes", []):
            source, target = volume.split(":")[:2]
            local = volume_dirs[source] if source in volume_dirs else ROOT / source
            local.mkdir(parents=True, exist_ok=True) if source in volume_dirs else None
            mounts[target] = local
        argv = [translate(str(a), mounts) for a in spec["command"]]
        if name not in (*_PORTS_FILE_SERVICES, _REDIS):
            raise ValueError(f"{name}: no way to learn the port it binds here")
        for i in [i for i, a in enumerate(argv) if a == "--port"]:
            if argv[i + 1] == str(CONTAINER_PORTS[name]):
                # Ours: 0 on a first start (the ports file says which), then the one it had;
                # Redis: the port tried, then the one it had.
                argv[i + 1] = PORT_SLOT
        for i in [i for i, a in enumerate(argv) if a == "--transfer-port"]:
            argv[i + 1] = "0"  # internal to the container network: any port; /v1/limits names it
        ports_file = work_dir / f"{name}.ports.json" if name in _PORTS_FILE_SERVICES else None
        if ports_file is not None:
            argv += ["--ports-file", str(ports_file)]
        argv[0] = _executable(argv[0])
        env = dict(base_env)
        env.update({k: translate(str(v), mounts) for k, v in spec.get("environment", {}).items()})
        check = spec.get("healthcheck", {}).get("test")
        health = None
        if check:
            assert check[0] == "CMD", f"{name}: healthcheck must be an exec-form CMD"
            health = [translate(str(a), mounts) for a in check[1:]]
            health = [PORT_SLOT if a == str(CONTAINER_PORTS[name]) else a for a in health]
            health = [
                a.replace(f"127.0.0.1:{CONTAINER_PORTS[name]}", f"127.0.0.1:{PORT_SLOT}")
                for a in health
            ]
            health[0] = _executable(health[0])
        log = work_dir / f"{name}.log"
        out[name] = LocalService(
            name, argv, env, health, 0, log, ports_file=ports_file, stack_ports=ports
        )
    return out


def _with_port(argv: list[str], port: int) -> list[str]:
    return [str(port) if a == PORT_SLOT else a for a in argv]


def _resolve(text: str, ports: Mapping[str, int]) -> str:
    """``name:container port`` of every started service as ``127.0.0.1:<its port>``."""
    for name, port in ports.items():
        text = text.replace(f"{name}:{CONTAINER_PORTS[name]}", f"127.0.0.1:{port}")
    return text


def base_environment() -> dict[str, str]:
    """PATH, HOME and the model cache of this machine; no CACHETIER_* of the caller's."""
    keep = ("PATH", "HOME", "LANG", "TMPDIR")
    env = {k: os.environ[k] for k in keep if k in os.environ}
    env["PYTHONUNBUFFERED"] = "1"
    return env
