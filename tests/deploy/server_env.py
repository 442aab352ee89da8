"""The sidecar's install shape: a fresh venv holding only ``cachetier[server]``, built from this
checkout's wheel by ``scripts/setup_server.sh`` (the script the sidecar image runs).

A support module: ``tests/deploy/test_server_install.py`` checks that environment and
``benchmarks/ops/install.py`` measures it, through the same functions.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from tests.server.live import wait_healthy
from tests.support import end_process, wait_ports_file

ROOT = Path(__file__).resolve().parents[2]
SETUP_SCRIPT = ROOT / "scripts" / "setup_server.sh"
# Run by the venv's own python: it imports the installed cachetier, never this checkout.
CHILD = Path(__file__).with_name("server_env_child.py")
# What the sidecar must not carry (the engine's stack), and what `cachetier report` needs.
HEAVY_MODULES = ("torch", "transformers", "vllm", "triton")
REPORT_MODULES = ("matplotlib", "tqdm")
MIB = 1 << 20


@dataclass(frozen=True)
class ServerEnv:
    """A venv made by ``scripts/setup_server.sh``."""

    venv: Path

    @property
    def python(self) -> Path:
        return self.venv / "bin" / "python"

    @property
    def cachetier(self) -> Path:
        return self.venv / "bin" / "cachetier"

    def run(
        self, argv: list[str | os.PathLike[str]], *, env: Mapping[str, str] | None = None
    ) -> subprocess.CompletedProcess[str]:
        """Run a command of the venv from the venv's folder, so that nothing of the checkout
        (a ``python -c`` puts its working folder first on ``sys.path``) can stand in for the
        installed package."""
        return subprocess.run(
            [str(a) for a in argv],
            cwd=self.venv,
            env=venv_environment(env),
            capture_output=True,
            text=True,
            timeout=600,
            check=False,
        )

    def probe(self, settings: Mapping[str, str] | None = None) -> dict:
        """Run ``server_env_child.py`` in the venv: which modules exist there, whether every
        module of the installed cachetier imports, and a put and get through each tier that
        ``settings`` configures (see the child's docstring).

        Returns:
            The child's JSON answer.
        """
        done = self.run([self.python, CHILD, json.dumps(dict(settings or {}))])
        if done.returncode != 0:
            raise RuntimeError(f"the server env's probe failed:\n{done.stderr[-4000:]}")
        return json.loads(done.stdout.strip().splitlines()[-1])

    def size_mib(self) -> float:
        return disk_usage_mib(self.venv)


def venv_environment(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """This process's environment without what points into another environment."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(extra or {})
    return env


def make_server_env(venv: Path) -> ServerEnv:
    """Build the wheel of this checkout and install it with only the ``server`` extra into a
    fresh venv at ``venv``, through ``scripts/setup_server.sh``.

    Args:
        venv: the venv's folder (made; it must not hold another venv).

    Returns:
        The environment.
    """
    done = subprocess.run(
        ["bash", str(SETUP_SCRIPT), str(venv), str(ROOT)],
        env=venv_environment({"PYTHON": sys.executable}),
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(f"scripts/setup_server.sh failed:\n{done.stderr[-4000:]}")
    return ServerEnv(venv)


def copied_parts() -> list[str]:
    """What ``scripts/setup_server.sh`` copies of a checkout to build the wheel from."""
    for line in SETUP_SCRIPT.read_text().splitlines():
        if line.startswith("for part in "):
            return line.removeprefix("for part in ").removesuffix("; do").split()
    raise ValueError(f"{SETUP_SCRIPT} has no `for part in ...; do` line")


def disk_usage_mib(path: Path) -> float:
    """Disk space under ``path`` in MiB, as ``du`` counts it: allocated blocks, each hard-linked
    file once, symbolic links inside not followed (``path`` itself may be one)."""
    seen: set[tuple[int, int]] = set()
    total = 0
    for folder, dirs, files in os.walk(path.resolve()):
        for name in (".", *dirs, *files):
            st = os.lstat(os.path.join(folder, name))
            if (st.st_dev, st.st_ino) not in seen:
                seen.add((st.st_dev, st.st_ino))
                total += st.st_blocks * 512
    return total / MIB


@dataclass
class Served:
    """A running ``cachetier serve``: its URL, and once stopped its exit status and stderr."""

    url: str
    returncode: int | None = None
    stderr: str = ""


@contextmanager
def serving(
    env: ServerEnv,
    data_dir: Path,
    tenants: Mapping[str, str],
    admin: str,
    redis_url: str | None = None,
    redis_prefix: str | None = None,
) -> Iterator[Served]:
    """``cachetier serve`` of the venv on a free port of 127.0.0.1, stopped with SIGTERM (its
    tiers flush) on exit.

    Args:
        env: the venv.
        data_dir: the disk tier's folder.
        tenants: tenant -> token.
        admin: the admin tenant.
        redis_url: a Redis behind the server, or ``None``.
        redis_prefix: the server's Redis key prefix (a test's own).
    """
    ports_file = data_dir.with_name(f"{data_dir.name}-ports.json")
    argv = [str(env.cachetier), "serve", "--port", "0", "--ports-file", str(ports_file)]
    argv += ["--data-dir", str(data_dir)]
    if redis_url:
        argv += ["--redis-url", redis_url]
    settings = {
        "CACHETIER_TENANTS": ",".join(f"{name}:{token}" for name, token in tenants.items()),
        "CACHETIER_ADMIN_TENANTS": admin,
        "CACHETIER_FSYNC": "false",
    }
    if redis_prefix:
        settings["CACHETIER_REDIS_KEY_PREFIX"] = redis_prefix
    proc = subprocess.Popen(
        argv,
        cwd=env.venv,
        env=venv_environment(settings),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        served = Served(f"http://127.0.0.1:{wait_ports_file(ports_file, proc)['http']}")
        wait_healthy(served.url, timeout_s=60, proc=proc)
    except RuntimeError as exc:
        raise RuntimeError(f"{exc}:\n{end_process(proc)[1][-4000:]}") from None
    try:
        yield served
    finally:
        served.stderr = end_process(proc)[1]
        served.returncode = proc.returncode
