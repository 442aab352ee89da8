"""Sidecar faults: the server restarts under a client's load. The client sees misses while it
is gone, never an exception or a wrong block, and recovers by itself: blocks stored before the
restart are read back from the server's disk tier once it answers again."""

from __future__ import annotations

import threading
import time
from pathlib import Path

from cachetier.primitives.keys import Namespace
from cachetier.tiers.remote import RemoteTier, RemoteTierConfig
from tests.server.live import TOKENS, ThreadServer, test_config
from tests.support import SMALL_LAYOUT, make_blocks

RESTARTS = 3


def test_the_client_rides_out_server_restarts(tmp_path: Path, fault_figures) -> None:
    namespace = Namespace("sidecar-restart-model", SMALL_LAYOUT)
    server = ThreadServer(test_config(tmp_path / "server")).start()
    client = RemoteTier(RemoteTierConfig(url=server.url, token=TOKENS["alice"], timeout_s=2.0))
    stored: list = []  # blocks the server acknowledged
    failed = wrong = missed = 0
    stop = threading.Event()

    def load() -> None:
        nonlocal failed, wrong, missed
        seed = 0
        while not stop.is_set():
            seed += 1
            blocks = make_blocks(namespace, 2, seed=seed)
            try:
                if client.put_many(namespace.id, blocks) == 2:
                    stored.extend(blocks)
                got = client.get_many(namespace.id, [b.key for b in blocks])
            except Exception:  # noqa: BLE001 - the client must turn every failure into a miss
                failed += 1
                continue
            missed += sum(g is None for g in got)
            wrong += sum(
                1 for g, b in zip(got, blocks) if g is not None and bytes(g.data) != bytes(b.data)
            )

    worker = threading.Thread(target=load)
    worker.start()
    try:
        for _ in range(RESTARTS):
            time.sleep(0.5)
            server.stop()
            time.sleep(0.5)  # the load goes on against a closed port
            server.start()
        time.sleep(0.5)
    finally:
        stop.set()
        worker.join(30)
    try:
        assert stored, "nothing was acknowledged"
        # Recovered: every acknowledged block, including those from before each restart, is back.
        got = client.get_many(namespace.id, [b.key for b in stored])
        lost = sum(g is None for g in got)
        wrong += sum(
            1 for g, b in zip(got, stored) if g is not None and bytes(g.data) != bytes(b.data)
        )
        assert client.stats()["errors"] > 0, "the downtime must show as counted errors"
    finally:
        client.close()
        server.stop()
    fault_figures.add("sidecar_restarts", RESTARTS)
    fault_figures.add("acknowledged_lost", lost)
    fault_figures.add("corrupt_served", wrong)
    fault_figures.add("sidecar_restart_requests_failed", failed)
    assert (failed, wrong, lost) == (0, 0, 0)
    assert missed > 0, "the load never met the server down: the test did not test a restart"
