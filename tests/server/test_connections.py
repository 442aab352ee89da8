"""The HTTP port's connection table: places shared by tenant weight, a tenant past its share
losing its own oldest idle connection and never another tenant's, and the unauthenticated cap.
On a real event loop; each connection is an entry whose ``drop`` notes why it was closed."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest

from cachetier.server.connections import ConnectionTable, Entry
from cachetier.server.fairness import TenantWeights
from cachetier.server.fdlimits import ConnectionCaps

WEIGHTS = TenantWeights({"alice": 1.0, "bob": 1.0, "ops": 1.0})
CAPS = ConnectionCaps(max_connections=6, max_unauthenticated=3, max_tls_handshakes=1)


@pytest.fixture
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    running = asyncio.new_event_loop()
    yield running
    running.close()


class Connections:
    """A table and the entries it gave, with what each was closed for."""

    def __init__(self, table: ConnectionTable) -> None:
        self.table = table
        self.dropped: dict[int, str] = {}  # entry index -> reason
        self.entries: list[Entry] = []

    def arrive(self, tenant: str | None = None) -> int | None:
        entry = self.table.arrive()
        if entry is None:
            return None
        index = len(self.entries)
        self.entries.append(entry)

        def drop(reason: str) -> bool:
            self.dropped[index] = reason
            return True

        entry.drop = drop
        if tenant is not None:
            self.table.promote(entry, tenant)
        return index


def test_each_tenant_is_guaranteed_its_weights_part(loop: asyncio.AbstractEventLoop) -> None:
    table = ConnectionTable(CAPS, 60.0, loop, TenantWeights({"alice": 2.0, "bob": 1.0}))
    assert (table.guaranteed("alice"), table.guaranteed("bob")) == (4, 2)
    assert ConnectionTable(CAPS, 60.0, loop).guaranteed("alice") == 6  # no weights: all


def test_a_tenant_past_its_share_loses_its_own_oldest_idle_place(
    loop: asyncio.AbstractEventLoop,
) -> None:
    conns = Connections(ConnectionTable(CAPS, 60.0, loop, WEIGHTS))
    alice = [conns.arrive("alice") for _ in range(6)]  # every place, 4 past her share
    conns.entries[0].busy = True  # her oldest is answering a request: spared while one is idle
    newcomer = conns.arrive()
    assert newcomer is not None and conns.dropped == {1: "tenant_share"}
    conns.table.promote(conns.entries[newcomer], "bob")
    assert conns.table.num_known_of("alice") == 5 and conns.table.num_known_of("bob") == 1
    # Alice herself reconnecting takes her own places too, never bob's.
    for _ in range(10):
        again = conns.arrive()
        assert again is not None
        conns.table.promote(conns.entries[again], "alice")
    assert conns.table.num_known_of("bob") == 1 and newcomer not in conns.dropped
    assert conns.table.num_open == CAPS.max_connections
    assert conns.table.num_shed["tenant_share"] == 11 and alice[0] is not None


def test_when_no_tenant_is_past_its_share_a_newcomer_is_refused(
    loop: asyncio.AbstractEventLoop,
) -> None:
    conns = Connections(ConnectionTable(CAPS, 60.0, loop, WEIGHTS))
    for tenant in ("alice", "alice", "bob", "bob", "ops", "ops"):
        conns.arrive(tenant)
    assert conns.arrive() is None and conns.table.num_refused == 1
    assert conns.dropped == {}


def test_an_unauthenticated_newcomer_takes_an_over_share_place_first(
    loop: asyncio.AbstractEventLoop,
) -> None:
    conns = Connections(ConnectionTable(CAPS, 60.0, loop, WEIGHTS))
    waiting = conns.arrive()  # bob's, before his first request shows his token
    for _ in range(5):
        conns.arrive("alice")
    assert conns.arrive() is not None
    # Alice's newest connection makes room from her own, not from bob's waiting one.
    assert waiting not in conns.dropped and list(conns.dropped.values()) == ["tenant_share"]


def test_without_weights_the_oldest_unauthenticated_place_goes(
    loop: asyncio.AbstractEventLoop,
) -> None:
    conns = Connections(ConnectionTable(CAPS, 60.0, loop))
    for _ in range(4):
        conns.arrive("alice")
    first = conns.arrive()
    conns.arrive()
    assert conns.arrive() is not None and conns.dropped == {first: "connection_cap"}
    for index in range(len(conns.entries)):
        if index not in conns.dropped and not conns.entries[index].known:
            conns.table.promote(conns.entries[index], "alice")
    assert conns.arrive() is None  # every place known, and no shares to take one back by


def test_a_place_left_is_free_again_and_counted(loop: asyncio.AbstractEventLoop) -> None:
    table = ConnectionTable(CAPS, 60.0, loop, WEIGHTS)
    ended: list[int] = []
    table.on_leave = lambda: ended.append(1)
    conns = Connections(table)
    index = conns.arrive("alice")
    assert index is not None
    table.leave(conns.entries[index])
    table.leave(conns.entries[index])  # any number of times
    assert table.num_open == 0 and table.num_known_of("alice") == 0 and ended == [1]
