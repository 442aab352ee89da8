"""A Redis Cluster of this test session's own: three local masters, no replicas.

``redis-server --cluster-enabled yes`` x3 on ports of their own (``start_on_a_free_port``: each
node's own bind decides, its bus port included) and ``redis-cli --cluster create``;
it keeps nothing on disk. The ``redis_cluster`` fixture (conftest.py) starts one per session.
"""

from __future__ import annotations

import random
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import redis

from tests.support import PRIVATE_PORTS, start_on_a_free_port

NUM_MASTERS = 3
NODE_TIMEOUT_MS = 2000  # how long a silent master takes to be flagged as failed
STARTUP_S = 30.0  # longest wait for the cluster (or one node) to come up


class LocalCluster:
    """Redis Cluster masters on local ports of their own, in a folder of their own.

    Args:
        folder: where the nodes keep their cluster config files and logs.
        num_masters: how many masters (no replicas).
    """

    def __init__(self, folder: Path, num_masters: int = NUM_MASTERS) -> None:
        self.folder = folder
        self.num_masters = num_masters
        self.ports: list[int] = []  # chosen by start()
        self._logs: dict[int, Path] = {}
        self.procs: dict[int, subprocess.Popen[bytes]] = {}

    @property
    def url(self) -> str:
        return "redis+cluster://" + ",".join(f"127.0.0.1:{port}" for port in self.ports)

    def node(self, port: int) -> redis.Redis:
        return redis.Redis(port=port, socket_timeout=2, socket_connect_timeout=2)

    def start(self) -> None:
        for _ in range(self.num_masters):
            self.ports.append(self.start_node())
        subprocess.run(
            ["redis-cli", "--cluster", "create"]
            + [f"127.0.0.1:{port}" for port in self.ports]
            + ["--cluster-replicas", "0", "--cluster-yes"],
            check=True,
            capture_output=True,
            timeout=STARTUP_S,
        )
        self.wait_healthy()

    def start_node(self, port: int | None = None) -> int:
        """Start a new node on a port of its own, or a stopped one again on its ``port``;
        returns the port."""
        assert port is None or port not in self.procs, f"node {port} is already running"
        log = self._logs[port] if port else self.folder / f"redis-node{len(self._logs)}.log"
        # Its bus port is port + 10000: a node exits when either is taken, and another try
        # moves both.
        pick = (lambda: port) if port else (lambda: random.choice(PRIVATE_PORTS))
        port, proc = start_on_a_free_port(
            lambda p: self._popen(p, log), log, ports=pick, timeout_s=STARTUP_S
        )
        self.procs[port], self._logs[port] = proc, log
        self._wait(lambda: self._answers(port), f"node {port} to answer")
        return port

    def _popen(self, port: int, log: Path) -> subprocess.Popen[bytes]:
        return subprocess.Popen(
            ["redis-server", "--port", str(port), "--bind", "127.0.0.1"]
            + ["--cluster-enabled", "yes", "--cluster-port", str(port + 10000)]
            + ["--cluster-config-file", f"nodes-{port}.conf"]
            + ["--cluster-node-timeout", str(NODE_TIMEOUT_MS)]
            # Keep serving the other masters' slots when one is lost (the default refuses all).
            + ["--cluster-require-full-coverage", "no"]
            + ["--save", "", "--appendonly", "no", "--dir", str(self.folder)]
            + ["--logfile", str(log)],
        )

    def stop_node(self, port: int, sig: signal.Signals = signal.SIGKILL) -> None:
        proc = self.procs.pop(port)
        proc.send_signal(sig)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    def stop_all(self) -> None:
        for port in list(self.procs):
            self.stop_node(port)

    def wait_healthy(self) -> None:
        """Until every node sees every master up and all slots served."""
        self._wait(lambda: all(self._healthy(port) for port in self.ports), "a healthy cluster")

    def wait_flagged_failed(self, lost: int) -> None:
        """Until the running nodes agree that ``lost`` has failed (``fail``, not ``fail?``)."""

        def flagged() -> bool:
            return all(
                "fail" in self._nodes(port)[f"127.0.0.1:{lost}"]["flags"].split(",")
                for port in self.procs
            )

        self._wait(flagged, f"node {lost} to be flagged as failed")

    def _answers(self, port: int) -> bool:
        client = self.node(port)
        try:
            return bool(client.ping())
        except redis.exceptions.ConnectionError:
            return False
        finally:
            client.close()

    def _nodes(self, port: int) -> dict[str, dict]:
        """CLUSTER NODES as ``port`` sees them, by ``host:port``."""
        client = self.node(port)
        try:
            return client.execute_command("CLUSTER NODES")
        finally:
            client.close()

    def _healthy(self, port: int) -> bool:
        client = self.node(port)
        try:
            info = client.execute_command("CLUSTER INFO")
        finally:
            client.close()
        return (
            info["cluster_state"] == "ok"
            and info["cluster_known_nodes"] == str(len(self.ports))
            and info["cluster_slots_ok"] == "16384"
            and not any("fail" in node["flags"] for node in self._nodes(port).values())
        )

    def _wait(self, done: Callable[[], bool], what: str) -> None:
        deadline = time.monotonic() + STARTUP_S
        while not done():
            dead = [port for port, proc in self.procs.items() if proc.poll() is not None]
            if dead or time.monotonic() > deadline:
                raise RuntimeError(
                    f"gave up waiting for {what} (exited: {dead}); see {self.folder}"
                )
            time.sleep(0.05)
