"""Issue 51, item 3: no tenant starves another. Each tenant has a guaranteed share of the
transfer port's connections, the upload bytes in flight and the request rate; past it, it is
answered 429 (``Retry-After``) or ``BUSY``, never another tenant; and a client answered busy
backs off without opening its breaker. Real servers, real sockets.

Issue 65, item 7: at default settings too, where no request rate refuses the flood: the
server's work is scheduled per tenant (``server.scheduling``), so the flooding tenant waits
behind its own requests.

Figures: ``tenant_slot_starvation`` (gets and puts of a fresh client of one tenant that failed
while another held every transfer connection it could; any one also fails its test) and
``noisy_tenant_victim_p99_ratio`` (a tenant's p99 latency while another floods requests from
24 HTTP connections and a transfer connection, over its p99 alone, against a ``cachetier
serve`` process of its own at default settings; recorded, not asserted: it is a timing on a
shared machine; ``benchmarks/faults.py`` checks it).
"""

from __future__ import annotations

import http.client
import json
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from cachetier.primitives.keys import Namespace
from cachetier.protocol.transfer_frames import REPLY, Op, Status, hello, request
from cachetier.tiers.remote import RemoteTier, RemoteTierConfig
from tests.faults.flood_server import FloodServer
from tests.server.live import TOKENS, ThreadServer, call, test_config
from tests.support import SMALL_LAYOUT, make_blocks

NS = Namespace("fairness-model", SMALL_LAYOUT)
SLOTS = 6  # transfer connections of the test server: a guaranteed 2 for each of 3 tenants
FLOOD_S = 3.0  # how long a flood lasts
VICTIM_REQUESTS = 60  # the victim's requests, alone and during the flood
ROUNDS, ROUND_REQUESTS = 8, 40  # at default settings: turns of bob alone and during the flood


def transfer_port(server: ThreadServer) -> int:
    status, _, body = call(server.url, "GET", "/v1/limits")
    assert status == 200
    port = json.loads(body)["transfer_port"]
    assert isinstance(port, int)
    return port


def http_port(server: ThreadServer | FloodServer) -> int:
    return int(server.url.rsplit(":", 1)[1])


def open_transfer(port: int, tenant: str) -> tuple[socket.socket, int]:
    """A transfer connection that said hello as ``tenant``: the socket and the reply status."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=5)
    try:
        sock.sendall(hello(TOKENS[tenant], None))
        head = b""
        while len(head) < REPLY.size:
            chunk = sock.recv(REPLY.size - len(head))
            if not chunk:
                return sock, -1  # closed without a reply
            head += chunk
    except OSError:
        return sock, -1
    return sock, REPLY.unpack(head)[0]


def tier(server: ThreadServer, tenant: str, **options: object) -> RemoteTier:
    return RemoteTier(RemoteTierConfig(url=server.url, token=TOKENS[tenant], **options))  # type: ignore[arg-type]


@pytest.fixture
def slot_server(tmp_path: Path) -> Iterator[ThreadServer]:
    config = test_config(tmp_path / "srv", transfer_port=0, transfer_connections=SLOTS)
    server = ThreadServer(config).start()
    yield server
    server.stop()


def test_a_tenant_holding_every_slot_leaves_another_its_share(
    slot_server: ThreadServer, fault_figures
) -> None:
    port = transfer_port(slot_server)
    held: list[socket.socket] = []
    failed = 0
    try:
        # Alice opens every connection the port gives her, for real, and keeps them.
        for _ in range(SLOTS):
            sock, status = open_transfer(port, "alice")
            held.append(sock)
            assert status == Status.OK, "alice was refused with slots free"
        sock, status = open_transfer(port, "alice")
        held.append(sock)
        assert status == Status.BUSY, "past every slot, alice must be answered BUSY"
        # Bob's fresh clients: over the transfer port (taking back his share) and HTTP.
        for seed, options in ((1, {}), (2, {"transfer": False})):
            client = tier(slot_server, "bob", **options)
            try:
                blocks = make_blocks(NS, 4, seed=seed)
                stored = client.put_many(NS.id, blocks)
                got = client.get_many(NS.id, [b.key for b in blocks])
                hits = sum(
                    g is not None and bytes(g.data) == bytes(b.data) for g, b in zip(got, blocks)
                )
                failed += (len(blocks) - stored) + (len(blocks) - hits)
                stats = client.stats()
                assert stats["breaker"]["num_opens"] == 0
                assert (stats["transfer"] is None) == bool(options) and stats["fallbacks"] == 0
                if not options:  # bob holds a slot now: alice, past her share, is still BUSY
                    sock, status = open_transfer(port, "alice")
                    held.append(sock)
                    assert status == Status.BUSY
            finally:
                client.close()
    finally:
        for sock in held:
            sock.close()
        fault_figures.add("tenant_slot_starvation", failed)
    assert failed == 0


class Flood:
    """Alice sends requests as fast as she can, over HTTP and the transfer port, for a while;
    counts what she is answered."""

    def __init__(self, server: ThreadServer | FloodServer, port: int) -> None:
        self.server = server
        self.port = port
        self.stop = threading.Event()
        self.answers: dict[str, int] = {}
        self._lock = threading.Lock()
        self._threads = [
            threading.Thread(target=self._http),
            threading.Thread(target=self._transfer),
        ]

    def _count(self, what: str) -> None:
        with self._lock:
            self.answers[what] = self.answers.get(what, 0) + 1

    def _http(self) -> None:
        body = json.dumps({"keys": ["00" * 32]}).encode()
        headers = {"Authorization": f"Bearer {TOKENS['alice']}", "Content-Type": "application/json"}
        conn = http.client.HTTPConnection("127.0.0.1", http_port(self.server), timeout=10)
        while not self.stop.is_set():
            try:
                conn.request("POST", f"/v1/namespaces/{NS.id}/lookup", body=body, headers=headers)
                resp = conn.getresponse()
                resp.read()
                self._count(f"http_{resp.status}")
                if resp.status == 429:
                    assert resp.getheader("Retry-After"), "a 429 says when to retry"
            except OSError:
                self._count("http_error")
                conn.close()
                conn = http.client.HTTPConnection("127.0.0.1", http_port(self.server), timeout=10)
        conn.close()

    def _transfer(self) -> None:
        sock, status = open_transfer(self.port, "alice")
        try:
            assert status == Status.OK
            while not self.stop.is_set():
                sock.sendall(request(Op.GET, NS.id, 1) + b"\0" * 32)
                status, value = REPLY.unpack(_read(sock, REPLY.size))
                if status == Status.OK:
                    _read(sock, 8 * value)  # lengths; every length is 0 (a miss)
                else:
                    _read(sock, value)  # the message
                self._count(f"transfer_{Status(status).name.lower()}")
        finally:
            sock.close()

    def __enter__(self) -> Flood:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for thread in self._threads:
            thread.join(30)


def _read(sock: socket.socket, nbytes: int) -> bytes:
    out = b""
    while len(out) < nbytes:
        chunk = sock.recv(nbytes - len(out))
        if not chunk:
            raise ConnectionError("the server closed the connection")
        out += chunk
    return out


def victim_latencies(
    server: ThreadServer | FloodServer, num_requests: int = VICTIM_REQUESTS, gap_s: float = 0.03
) -> tuple[list[float], int]:
    """Bob's lookups, one at a time at about his share's pace: their latencies (s) and how
    many were not answered 200."""
    body = json.dumps({"keys": ["11" * 32]}).encode()
    headers = {"Authorization": f"Bearer {TOKENS['bob']}", "Content-Type": "application/json"}
    conn = http.client.HTTPConnection("127.0.0.1", http_port(server), timeout=10)
    latencies, failed = [], 0
    try:
        for _ in range(num_requests):
            start = time.perf_counter()
            conn.request("POST", f"/v1/namespaces/{NS.id}/lookup", body=body, headers=headers)
            resp = conn.getresponse()
            resp.read()
            latencies.append(time.perf_counter() - start)
            failed += resp.status != 200
            time.sleep(gap_s)  # ~30 requests/s: inside bob's share of the server's rate
    finally:
        conn.close()
    return latencies, failed


def test_a_flooding_tenant_is_refused_while_the_other_is_served(tmp_path: Path) -> None:
    # 300 requests/s shared by alice, bob and ops: 100/s guaranteed to each. The server is a
    # process of its own: alice's flood and bob's requests are real clients on loopback.
    server = FloodServer(tmp_path, settings={"max_request_rate": 300.0}).start()
    try:
        port = server.transfer_port
        alone, failed_alone = victim_latencies(server)
        with Flood(server, port) as flood:
            time.sleep(0.3)  # the flood has spent alice's burst and the spare tokens
            during, failed_during = victim_latencies(server)
    finally:
        server.stop()
    ratio = float(np.percentile(during, 99) / np.percentile(alone, 99))
    print(
        f"victim p99 alone {np.percentile(alone, 99) * 1e3:.2f} ms, during the flood "
        f"{np.percentile(during, 99) * 1e3:.2f} ms (ratio {ratio:.2f}); flood answers "
        f"{flood.answers}"
    )
    assert failed_alone == failed_during == 0, "the victim was refused"
    assert flood.answers.get("http_429", 0) > 0 and flood.answers.get("transfer_busy", 0) > 0
    assert flood.answers.get("http_500", 0) == 0


class NoisyTenant:
    """Alice flooding from a process of its own (``tests.faults.noisy_tenant``); ``answers``
    once it has stopped."""

    def __init__(self, server: FloodServer, connections: int = 24) -> None:
        command = [sys.executable, "-m", "tests.faults.noisy_tenant", "--port", str(server.port)]
        command += ["--transfer-port", str(server.transfer_port)]
        command += ["--connections", str(connections)]
        self._command = command
        self.answers: dict[str, int] = {}
        self._proc: subprocess.Popen[str] | None = None

    def __enter__(self) -> NoisyTenant:
        self._proc = subprocess.Popen(
            self._command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        assert self._proc.stdout is not None and self._proc.stdout.readline() == "flooding\n"
        return self

    def pause(self) -> None:
        """Stop alice's process where it is (her requests in flight are still answered)."""
        assert self._proc is not None
        self._proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        assert self._proc is not None
        self._proc.send_signal(signal.SIGCONT)

    def __exit__(self, *exc: object) -> None:
        assert self._proc is not None
        self.resume()
        out, _ = self._proc.communicate(timeout=60)  # closes its stdin: it stops
        self.answers = json.loads(out.strip().splitlines()[-1])


def test_a_flooding_tenant_slows_the_other_little_at_default_settings(
    tmp_path: Path, fault_figures
) -> None:
    # Default settings: the request rate (max_request_rate) is far above what the server can
    # serve here, so only the per-tenant scheduling of its work keeps bob's latency.
    # Alone and during the flood in turns (alice's process stopped, then let go), so that
    # whatever else this machine runs weighs on both alike.
    server = FloodServer(tmp_path).start()
    alone: list[float] = []
    during: list[float] = []
    failed_alone = failed_during = 0
    try:
        with NoisyTenant(server) as flood:
            for _ in range(ROUNDS):
                flood.pause()
                time.sleep(0.1)  # her requests in flight are answered
                latencies, failed = victim_latencies(server, ROUND_REQUESTS, gap_s=0.02)
                alone += latencies
                failed_alone += failed
                flood.resume()
                time.sleep(0.2)  # every one of her connections is sending again
                latencies, failed = victim_latencies(server, ROUND_REQUESTS, gap_s=0.02)
                during += latencies
                failed_during += failed
    finally:
        server.stop()
    ratio = float(np.percentile(during, 99) / np.percentile(alone, 99))
    fault_figures.set("noisy_tenant_victim_p99_ratio", round(ratio, 2))
    print(
        f"victim p50/p99 alone {np.percentile(alone, 50) * 1e3:.2f}/"
        f"{np.percentile(alone, 99) * 1e3:.2f} ms, during the flood "
        f"{np.percentile(during, 50) * 1e3:.2f}/{np.percentile(during, 99) * 1e3:.2f} ms "
        f"(p99 ratio {ratio:.2f}); flood answers {flood.answers}"
    )
    assert failed_alone == failed_during == 0, "the victim was refused"
    assert flood.answers.get("http_200", 0) > 0, "alice is served too, at her share"
    assert not any(k.startswith("http_5") for k in flood.answers), flood.answers
    assert flood.answers.get("http_error", 0) == 0, flood.answers


def test_the_client_backs_off_on_busy_without_opening_its_breaker(tmp_path: Path) -> None:
    # 30 requests/s shared by three tenants: alice's calls in a tight loop pass it at once.
    config = test_config(tmp_path / "srv", transfer_port=0, max_request_rate=30.0)
    server = ThreadServer(config).start()
    try:
        blocks = make_blocks(NS, 2)
        keys = [b.key for b in blocks]
        for options in ({"transfer": False}, {}):
            client = tier(server, "alice", failure_threshold=2, **options)
            try:
                for _ in range(200):
                    client.put_many(NS.id, blocks)
                    client.get_many(NS.id, keys)
                stats = client.stats()
            finally:
                client.close()
            assert stats["busy"] > 0 and stats["deferred"] > 0, stats
            assert stats["breaker"]["num_opens"] == 0 and stats["breaker"]["state"] == "closed"
            assert stats["errors"] == 0 and stats["skipped"] == 0, stats
            assert (stats["transfer"] is None) == (options == {"transfer": False})
            assert stats["fallbacks"] == 0
    finally:
        server.stop()
