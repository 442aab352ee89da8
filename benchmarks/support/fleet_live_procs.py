"""The live fleet of ``benchmarks.bench_fleet``: one sidecar, engine-server replicas of SmolLM2
with node-local disk tiers, and ``cachetier route`` in front of them, each its own process on
127.0.0.1.

Every server listens on port 0 and writes the port it bound to a ports file
(``tests.support.wait_ports_file``); a replica restarted after a kill listens again on the
port its first process bound, since the router holds its URL. The sidecar's KV events go to
``ipc://`` endpoints in the run's folder (the sidecar reports no port of its events). Children
log to files in the run's folder, not to pipes: a pipe nobody reads stalls a chatty server once
its buffer is full.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from benchmarks.support.children import REPO_ROOT
from benchmarks.support.sidecar import TOKEN
from tests.support import end_process, wait_ports_file

START_TIMEOUT_S = 300.0
"""How long a child may take to listen: three replicas load SmolLM2 on two cores at once."""


@dataclass(frozen=True, slots=True)
class FleetSpec:
    """One fleet's settings.

    Args:
        policy: the router's policy.
        model_dir: the SmolLM2 folder (the router's tokenizer; the replicas load ``smollm2``).
        num_replicas: engine replicas.
        kv_cache_bytes: each replica's engine pool.
        disk_bytes: each replica's node-local disk tier.
        shared_bytes: the sidecar's tier (CPU memory, its only one).
        kv_events_queue: each replica's publisher queue (``--kv-events-queue``).
        reconcile_interval_s: the router's ``--reconcile-interval-s``.
        num_threads: torch threads per replica.
        pin_cores: run replica i on core i alone of this process's cores (``os.sched_setaffinity``),
            so replicas do not take each other's cores; the sidecar and the router stay free.
    """

    policy: str
    model_dir: Path
    num_replicas: int
    kv_cache_bytes: int
    disk_bytes: int
    shared_bytes: int
    kv_events_queue: int
    reconcile_interval_s: float
    num_threads: int = 1
    pin_cores: bool = False


def replica_cores(spec: FleetSpec) -> list[frozenset[int] | None]:
    """Per replica, the one core it is pinned to (``None`` each without ``pin_cores``)."""
    if not spec.pin_cores:
        return [None] * spec.num_replicas
    cores = sorted(os.sched_getaffinity(0))
    if spec.num_replicas > len(cores):
        raise ValueError(
            f"{spec.num_replicas} replicas cannot each have a core of their own: "
            f"this process may run on {len(cores)}"
        )
    return [frozenset({core}) for core in cores[: spec.num_replicas]]


def child_env(**extra: str) -> dict[str, str]:
    """This environment without any ``CACHETIER_*`` variable (a tier or key set outside would
    change what the fleet runs), plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("CACHETIER_")}
    env["PYTHONPATH"] = str(REPO_ROOT)
    env.update(extra)
    return env


class Child:
    """A server in a child process that reports its port through ``--ports-file``.

    Args:
        name: what logs and errors call it.
        argv: its command line, without ``--port`` and ``--ports-file``.
        env: its environment.
        folder: where its ports file and log go.
        cores: the cores it may run on, set again at each spawn; ``None``: this process's.
    """

    def __init__(
        self,
        name: str,
        argv: list[str],
        env: dict[str, str],
        folder: Path,
        cores: frozenset[int] | None = None,
    ) -> None:
        self.name = name
        self.cores = cores
        self.argv = argv
        self.env = env
        self.folder = folder
        self.ports_file = folder / f"{name}.ports.json"
        self.log_path = folder / f"{name}.log"
        self.port = 0  # the first start's; a restart listens there again
        self.proc: subprocess.Popen[bytes] | None = None
        self.spawned_at = 0.0  # time.monotonic() of the last spawn
        self._log: IO[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def spawn(self) -> None:
        """Start the process (on ``port``, 0 the first time); ``wait`` for it to listen."""
        self.ports_file.unlink(missing_ok=True)
        self._log = open(self.log_path, "ab")  # noqa: SIM115 - closed in reap()
        argv = [*self.argv, "--port", str(self.port), "--ports-file", str(self.ports_file)]
        if self.cores is not None:
            # taskset sets the mask, then execs: every thread the server starts inherits it.
            argv = ["taskset", "-c", ",".join(map(str, sorted(self.cores))), *argv]
        self.spawned_at = time.monotonic()
        self.proc = subprocess.Popen(
            argv, cwd=REPO_ROOT, env=self.env, stdout=self._log, stderr=subprocess.STDOUT
        )

    def wait(self) -> int:
        """Wait until it listens; its HTTP port."""
        assert self.proc is not None, "spawn() first"
        try:
            ports = wait_ports_file(self.ports_file, self.proc, timeout_s=START_TIMEOUT_S)
        except RuntimeError as exc:
            raise RuntimeError(f"{self.name} did not start: {exc}\n{self.log_tail()}") from exc
        self.port = int(ports["http"])
        return self.port

    def kill(self) -> None:
        """SIGKILL, as a crash: nothing is flushed."""
        if self.proc is not None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()
            self.reap()

    def stop(self) -> None:
        """SIGTERM (a graceful stop), SIGKILL if it takes too long."""
        if self.proc is not None:
            end_process(self.proc, timeout_s=60)
            self.reap()

    def reap(self) -> None:
        self.proc = None
        if self._log is not None:
            self._log.close()
            self._log = None

    def log_tail(self, num_chars: int = 3000) -> str:
        return log_tail(self.log_path, num_chars)


def log_tail(path: Path, num_chars: int | None = 3000) -> str:
    """The last ``num_chars`` characters of a child's log (``None``: all of it); "" before
    it has one."""
    try:
        text = path.read_text(errors="replace")
    except FileNotFoundError:
        return ""
    return text if num_chars is None else text[-num_chars:]


def _cli(command: str) -> list[str]:
    return [sys.executable, "-m", "cachetier.cli.main", command]


def sidecar(folder: Path, shared_bytes: int) -> Child:
    """``cachetier serve``: one tier, CPU memory, published as KV events on ``ipc://``."""
    data = folder / "sidecar"
    data.mkdir(parents=True, exist_ok=True)
    argv = _cli("serve") + [
        "--data-dir",
        str(data),
        "--cpu-bytes",
        str(shared_bytes),
        "--disk-bytes",
        "0",
        "--transfer-port",
        "0",
        "--kv-events",
        f"ipc://{data}/events",
        "--kv-events-replay",
        f"ipc://{data}/replay",
        "--log-level",
        "warning",
    ]
    return Child("sidecar", argv, child_env(CACHETIER_TENANTS=f"bench:{TOKEN}"), folder)


def replica(
    folder: Path, index: int, spec: FleetSpec, sidecar_url: str, cores: frozenset[int] | None
) -> Child:
    """An engine server of SmolLM2: a small pool, a node-local disk tier and the sidecar below
    it, publishing KV events. No CPU tier (a kill empties it anyway; the disk is what a
    restart keeps) and no restore guard (``benchmarks.guard`` measures what it costs; here a
    hit's TTFT is its load)."""
    disk = folder / f"r{index}-disk"
    disk.mkdir(parents=True, exist_ok=True)
    argv = [sys.executable, "-m", "cachetier.engine.server"] + [
        "--kv-events",
        "--kv-events-queue",
        str(spec.kv_events_queue),
        "--kv-cache-bytes",
        str(spec.kv_cache_bytes),
        "--num-threads",
        str(spec.num_threads),
        "--no-guard",
        "--cpu-bytes",
        "0",
        "--disk-path",
        str(disk),
        "--disk-bytes",
        str(spec.disk_bytes),
        "--no-fsync",
        "--remote-url",
        sidecar_url,
        "--log-level",
        "warning",
    ]
    env = child_env(CACHETIER_REMOTE_TOKEN=TOKEN)
    return Child(f"r{index}", argv, env, folder, cores)


def router(folder: Path, spec: FleetSpec, replica_urls: list[str], shared: Path) -> Child:
    """``cachetier route`` with ``spec``'s policy, following the sidecar's events too."""
    argv = _cli("route") + ["--model", str(spec.model_dir), "--policy", spec.policy]
    for url in replica_urls:
        argv += ["--replica", url]
    argv += [
        "--reconcile-interval-s",
        str(spec.reconcile_interval_s),
        "--shared-events",
        f"ipc://{shared}/events",
        "--shared-events-replay",
        f"ipc://{shared}/replay",
        "--log-level",
        "warning",
    ]
    return Child("router", argv, child_env(), folder)


class LiveFleet:
    """The sidecar, the replicas and the router of ``spec``, in ``folder``; a context manager
    that stops them all.

    Args:
        spec: the fleet.
        folder: its own folder (disks, logs, sockets); one per fleet, so nothing is shared
            with another policy's run.
    """

    def __init__(self, spec: FleetSpec, folder: Path) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        self.spec = spec
        self.folder = folder
        self.sidecar = sidecar(folder, spec.shared_bytes)
        self.replicas: list[Child] = []
        self.router: Child | None = None

    def __enter__(self) -> LiveFleet:
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def router_url(self) -> str:
        assert self.router is not None, "the fleet is not started"
        return self.router.url

    def start(self) -> None:
        """Sidecar, then every replica at once, then the router (it polls them at start)."""
        self.sidecar.spawn()
        self.sidecar.wait()
        spec = self.spec
        cores = replica_cores(spec)
        self.replicas = [
            replica(self.folder, i, spec, self.sidecar.url, cores[i])
            for i in range(spec.num_replicas)
        ]
        for child in self.replicas:
            child.spawn()
        for child in self.replicas:
            child.wait()
        urls = [child.url for child in self.replicas]
        self.router = router(self.folder, spec, urls, self.folder / "sidecar")
        self.router.spawn()
        self.router.wait()

    def close(self) -> None:
        """Stop the router, the replicas, then the sidecar (their writes go to it)."""
        for child in [self.router, *self.replicas, self.sidecar]:
            if child is not None:
                child.stop()
