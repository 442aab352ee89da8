"""Runs the services of docker-compose.yml as local processes, as the compose file says.

No Docker engine runs here, so each service's own command, environment and healthcheck are
taken from the file and translated the way a container network would resolve them: a service
name and container port (``sidecar:8470``) become ``127.0.0.1:<free port>``, ``0.0.0.0``
becomes ``127.0.0.1``, a named volume's mount point becomes a temporary folder, and the
executables (``python``, ``cachetier``, ``redis-server``) are this machine's. Nothing else is
changed, so a wrong flag, variable or path in the compose file fails here.
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

from tests.support import free_port, wait_ports_file

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

    def start(self) -> None:
        if self.ports_file is not None:
            self.ports_file.unlink(missing_ok=True)  # a restart's file is a new one
        log = open(self.log_path, "ab")  # noqa: SIM115 - the child owns it while it runs
        self.process = subprocess.Popen(
            self.argv, env=self.env, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT
        )
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
    ports = {name: free_port() for name in CONTAINER_PORTS}
    volume_dirs = {name: work_dir / "volumes" / name for name in compose.get("volumes", {})}

    def translate(text: str, mounts: dict[str, Path]) -> str:
        for name, port in CONTAINER_PORTS.items():
            text = text.replace(f"{name}:{port}", f"127.0.0.1:{ports[name]}")
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
        port_flag = [i for i, a in enumerate(argv) if a == "--port"]
        for i in port_flag:
            if argv[i + 1] == str(CONTAINER_PORTS[name]):
                argv[i + 1] = str(ports[name])
        for i in [i for i, a in enumerate(argv) if a == "--transfer-port"]:
            argv[i + 1] = "0"  # internal to the container network: any port; /v1/limits names it
        argv[0] = _executable(argv[0])
        env = dict(base_env)
        env.update({k: translate(str(v), mounts) for k, v in spec.get("environment", {}).items()})
        check = spec.get("healthcheck", {}).get("test")
        health = None
        if check:
            assert check[0] == "CMD", f"{name}: healthcheck must be an exec-form CMD"
            health = [translate(str(a), mounts) for a in check[1:]]
            health = [str(ports[name]) if a == str(CONTAINER_PORTS[name]) else a for a in health]
            health = [
                a.replace(f"127.0.0.1:{CONTAINER_PORTS[name]}", f"127.0.0.1:{ports[name]}")
                for a in health
            ]
            health[0] = _executable(health[0])
        out[name] = LocalService(name, argv, env, health, ports[name], work_dir / f"{name}.log")
    return out


def base_environment() -> dict[str, str]:
    """PATH, HOME and the model cache of this machine; no CACHETIER_* of the caller's."""
    keep = ("PATH", "HOME", "LANG", "TMPDIR")
    env = {k: os.environ[k] for k in keep if k in os.environ}
    env["PYTHONUNBUFFERED"] = "1"
    return env
