"""``cachetier serve`` in a child process, on 127.0.0.1, for the benchmarks that time the
sidecar (``benchmarks.server``, ``benchmarks.put_cpu``, ``benchmarks.peers``)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from benchmarks.support.children import REPO_ROOT, free_port
from tests.server.live import wait_healthy

TOKEN = "bench-token-0123456789abcdef"


class Server:
    """``cachetier serve`` in a child process, one tenant (``TOKEN``), CPU and disk tiers.

    Args:
        data_dir: the disk tier's folder.
        fsync: whether the server fsyncs each record before it answers a put.
    """

    def __init__(self, data_dir: str, fsync: bool) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.env = {
            **os.environ,
            "PYTHONPATH": str(REPO_ROOT),
            "CACHETIER_TENANTS": f"bench:{TOKEN}",
            "CACHETIER_CPU_BYTES": str(4 << 30),
            "CACHETIER_FSYNC": "1" if fsync else "0",
            # Block gets and puts go over the transfer port (the remote tier finds it).
            "CACHETIER_TRANSFER_PORT": str(free_port()),
            "CACHETIER_LOG_LEVEL": "warning",
        }
        self.data_dir = data_dir
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        cmd = [sys.executable, "-m", "cachetier.cli.main", "serve", "--port", str(self.port)]
        self.proc = subprocess.Popen(
            [*cmd, "--data-dir", self.data_dir], env=self.env, stderr=subprocess.DEVNULL
        )
        wait_healthy(self.url, proc=self.proc)

    def peak_rss_mib(self) -> float:
        assert self.proc is not None, "the server is not running"
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
        return float("nan")

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(timeout=120)
            self.proc = None
