"""Issue 65, item 5: one tenant's quarantine reports never take another tenant's places, and a
report is applied to every tier of the server or to none. Alice reports new namespaces as fast
as four connections allow against a real ``cachetier serve`` process (a CPU and a disk tier)
while bob reports his own; bob's must all be taken, in both tiers.

Figure: ``quarantine_cross_tenant_refusals``: bob's reports during alice's flood that were not
answered 200 or not quarantined in every tier (any one also fails the test).
"""

from __future__ import annotations

import http.client
import json
import threading
from collections.abc import Iterator

import pytest

from tests.faults.flood_server import FloodServer
from tests.server.live import TOKENS

QUOTA = 40  # alice's places: small, so that her flood reaches it within the test
BOB_REPORTS = 30
ALICE_THREADS = 4


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FloodServer]:
    folder = tmp_path_factory.mktemp("quarantine")
    started = FloodServer(folder, settings={"quarantine_quota": QUOTA}).start()
    yield started
    started.stop()


def report(conn: http.client.HTTPConnection, tenant: str, namespace: str) -> tuple[int, dict]:
    body = json.dumps({"namespace": namespace, "reason": "layer 0 K differs"}).encode()
    headers = {"Authorization": f"Bearer {TOKENS[tenant]}", "Content-Type": "application/json"}
    conn.request("POST", "/v1/quarantines", body=body, headers=headers)
    resp = conn.getresponse()
    return resp.status, json.loads(resp.read() or b"{}")


def held(server: FloodServer) -> dict[tuple[str, str], set[str]]:
    """(tenant, namespace) -> the tiers it is quarantined in, as the admin tenant sees them."""
    status, body = server.get("/v1/quarantines", token=TOKENS["ops"])
    assert status == 200, body[:200]
    out: dict[tuple[str, str], set[str]] = {}
    for q in json.loads(body)["quarantines"]:
        out.setdefault((q["tenant"], q["namespace"]), set()).add(q["tier"])
    return out


class ReportFlood:
    """Alice reporting a new namespace per request on a few connections until stopped."""

    def __init__(self, server: FloodServer) -> None:
        self.server = server
        self.stop = threading.Event()
        self.answers: dict[int, int] = {}
        self.messages: set[str] = set()
        self._lock = threading.Lock()
        self._threads = [
            threading.Thread(target=self._run, args=(i,)) for i in range(ALICE_THREADS)
        ]

    def _run(self, index: int) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", self.server.port, timeout=10)
        n = 0
        while not self.stop.is_set():
            n += 1
            try:
                status, answer = report(conn, "alice", f"alice-{index}-{n}")
            except (OSError, http.client.HTTPException):
                conn.close()
                conn = http.client.HTTPConnection("127.0.0.1", self.server.port, timeout=10)
                status, answer = -1, {}
            with self._lock:
                self.answers[status] = self.answers.get(status, 0) + 1
                if status == 429:
                    self.messages.add(answer.get("error", ""))
        conn.close()

    def __enter__(self) -> ReportFlood:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for thread in self._threads:
            thread.join(30)


def test_a_tenant_flooding_reports_takes_none_of_another_tenants_places(
    server: FloodServer, fault_figures
) -> None:
    tiers = {"cpu", "disk"}
    refused = 0
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
    try:
        with ReportFlood(server) as flood:
            # Bob reports once alice is at her quota, and while she keeps on reporting.
            while flood.answers.get(429, 0) == 0 and not flood.answers.get(-1):
                threading.Event().wait(0.02)
            for i in range(BOB_REPORTS):
                status, answer = report(conn, "bob", f"bob-{i}")
                mine = {q["tier"] for q in answer.get("quarantines", [])}
                refused += status != 200 or mine != tiers
    finally:
        conn.close()
        fault_figures.add("quarantine_cross_tenant_refusals", refused)
    assert refused == 0, "bob's reports were refused or applied to some tiers only"
    assert flood.answers.get(-1, 0) == 0 and flood.answers.get(500, 0) == 0, flood.answers
    assert flood.messages == {"quarantine_quota"}, flood.messages
    now = held(server)
    alices = [ns for tenant, ns in now if tenant == "alice"]
    assert len(alices) == QUOTA, "alice holds exactly her quota"
    assert all(tier_set == tiers for tier_set in now.values()), "a namespace in one tier only"
    assert sum(tenant == "bob" for tenant, _ in now) == BOB_REPORTS


def test_a_tenant_past_its_quota_is_told_so_and_a_lift_gives_a_place_back(
    server: FloodServer,
) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
    try:
        for i in range(QUOTA):  # idempotent if the test above filled it already
            report(conn, "alice", f"alice-0-{i + 1}")
        status, answer = report(conn, "alice", "one-more")
        assert status == 429 and answer["error"] == "quarantine_quota"
        assert f"quarantine_quota {QUOTA}" in answer["message"] and "alice" in answer["message"]
        assert report(conn, "alice", "alice-0-1")[0] == 200  # held already: no new place
        lift = json.dumps({"namespace": "alice-0-1", "tenant": "alice"}).encode()
        headers = {"Authorization": f"Bearer {TOKENS['ops']}", "Content-Type": "application/json"}
        conn.request("POST", "/v1/quarantines/lift", body=lift, headers=headers)
        resp = conn.getresponse()
        resp.read()
        assert resp.status == 200
        status, answer = report(conn, "alice", "one-more")
        assert status == 200 and {q["tier"] for q in answer["quarantines"]} == {"cpu", "disk"}
    finally:
        conn.close()
