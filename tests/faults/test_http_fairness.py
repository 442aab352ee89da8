"""Issue 65, item 1: one tenant cannot take the sidecar's whole HTTP port. A real ``cachetier
serve`` with 48 HTTP connection places (16 guaranteed to each of alice, bob and ops); alice
opens authenticated keep-alive connections as fast as she can and holds every one the server
leaves her, and keeps opening more while bob works. Bob, on fresh connections and through a
real ``RemoteTier`` over HTTP, must get every request, get and put; alice, past her share, loses
her own oldest idle connections, never bob's.

Figure: ``http_tenant_starvation`` (bob's requests, gets and puts that failed; must be 0).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from cachetier.primitives.keys import Namespace
from cachetier.tiers.remote import RemoteTier
from tests.faults.conftest import FaultFigures
from tests.faults.flood_server import (
    FloodServer,
    Monopoly,
    http_serves,
    puts_and_gets,
    remote_tier,
)
from tests.server.live import TOKENS
from tests.support import SMALL_LAYOUT

NS = Namespace("http-fairness-model", SMALL_LAYOUT)
PLACES = 48  # the server's max_connections: 16 guaranteed to each of its three tenants
MONOPOLY = 4 * PLACES  # connections alice opens before bob starts
NUM_BOB_REQUESTS = 20


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FloodServer]:
    settings = {"max_connections": PLACES, "max_unauthenticated_connections": PLACES // 3}
    running = FloodServer(tmp_path_factory.mktemp("http-fairness"), settings=settings).start()
    yield running
    running.stop()


def shed_for_shares(server: FloodServer) -> float:
    """Connections the server closed to give a place back to a tenant's share."""
    status, body = server.get("/metrics", token=TOKENS["ops"])
    assert status == 200
    for line in body.decode().splitlines():
        if line.startswith("cachetier_http_connections_shed") and 'reason="tenant_share"' in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_a_tenant_holding_every_http_place_leaves_another_its_share(
    server: FloodServer, fault_figures: FaultFigures
) -> None:
    alice = Monopoly(server.port, "alice")
    bob: RemoteTier | None = None
    failed = 0
    try:
        alice.open(MONOPOLY)
        held_before = alice.num_held()
        alice.keep_opening()
        # Bob: plain requests, each on a fresh connection, then a real client's puts and gets.
        for _ in range(NUM_BOB_REQUESTS):
            failed += not http_serves(server, TOKENS["bob"])
        bob = remote_tier(server, "bob", transfer=False)
        ok, tried = puts_and_gets(bob, NS, seed=65)
        failed += tried - ok
        stats = bob.stats()
    finally:
        alice.close()
        if bob is not None:
            bob.close()
        fault_figures.add("http_tenant_starvation", failed)
    shed = shed_for_shares(server)
    print(
        f"alice opened {alice.num_opened} connections, held {held_before} of {PLACES} places "
        f"before bob came; {shed:.0f} of hers closed for the shares; bob failed {failed}"
    )
    assert failed == 0, f"bob failed {failed} requests, gets and puts"
    assert stats["breaker"]["num_opens"] == 0 and stats["errors"] == 0, stats
    # The attack was real: alice held more than her share, and paid for it with her own.
    assert held_before > PLACES // 3, f"alice held only {held_before} places"
    assert held_before <= PLACES, f"alice held {held_before} of {PLACES} places"
    assert shed > 0, "no connection of alice's was closed for the shares"


def test_a_tenant_within_its_share_keeps_its_connections(server: FloodServer) -> None:
    # Bob holds his guaranteed share; alice then floods: not one of bob's is taken.
    bob = Monopoly(server.port, "bob")
    alice = Monopoly(server.port, "alice")
    try:
        bob.open(PLACES // 3)
        assert bob.num_opened == PLACES // 3
        alice.open(MONOPOLY)
        assert bob.num_held() == PLACES // 3, "alice took places within bob's share"
        assert alice.num_opened == MONOPOLY  # she got a place each time: her own oldest one
    finally:
        alice.close()
        bob.close()
