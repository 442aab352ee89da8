"""Issue 51, item 5: the remote tier survives a dead transfer port. The server's HTTP API stays
up while its transfer listener is closed (``TransferServer.stop``: listener and connections);
the tier moves every get and put over HTTP meanwhile, probes the port, and goes back to it
once a listener answers there again."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import uvicorn

from cachetier.primitives.keys import Namespace
from cachetier.server.app import create_app
from cachetier.server.httpserver import http_server
from cachetier.server.service import BlockService
from cachetier.server.transfer import TransferServer
from cachetier.tiers.remote import RemoteTier, RemoteTierConfig
from tests.server.live import TOKENS, ThreadServer, test_config
from tests.support import SMALL_LAYOUT, make_blocks

NS = Namespace("fallback-model", SMALL_LAYOUT)


class ServiceServer(ThreadServer):
    """The sidecar in a thread, keeping its lifespan's state so a test can reach its service
    and run the transfer listener itself (started, closed and started again)."""

    state: dict[str, Any]

    def make_server(self) -> uvicorn.Server:
        app = create_app(self.config)
        inner = app.router.lifespan_context

        @asynccontextmanager
        async def lifespan(a: Any) -> AsyncIterator[Any]:
            async with inner(a) as state:
                self.state = state
                yield state

        app.router.lifespan_context = lifespan
        return http_server(app, self.config)

    @property
    def service(self) -> BlockService:
        return self.state["service"]


@pytest.fixture
def server(tmp_path: Path) -> Iterator[ServiceServer]:
    srv = ServiceServer(test_config(tmp_path / "srv"))
    srv.start()
    yield srv
    srv.stop()


def listen(service: BlockService, port: int, server_id: int | None = None) -> TransferServer:
    """A transfer listener for ``service`` on ``port`` (0: any), named in its ``/v1/limits``."""
    transfer = TransferServer(service, "127.0.0.1", port)
    if server_id is not None:
        transfer.server_id = server_id  # the same server: only its listener came back
    service.transfer = transfer.start()
    return transfer


def round_trip(tier: RemoteTier, seed: int) -> tuple[int, int]:
    """Put 4 blocks and get them back: (stored, hits with the right data)."""
    blocks = make_blocks(NS, 4, seed=seed)
    stored = tier.put_many(NS.id, blocks)
    got = tier.get_many(NS.id, [b.key for b in blocks])
    hits = sum(g is not None and bytes(g.data) == bytes(b.data) for g, b in zip(got, blocks))
    return stored, hits


def test_a_dead_transfer_port_falls_back_to_http_and_comes_back(server: ServiceServer) -> None:
    transfer = listen(server.service, 0)
    port, server_id = transfer.port, transfer.server_id
    assert port is not None
    tier = RemoteTier(RemoteTierConfig(url=server.url, token=TOKENS["alice"]))
    revived: TransferServer | None = None
    try:
        assert round_trip(tier, 1) == (4, 4)
        assert tier.stats()["transfer"] == f"tcp:127.0.0.1:{port}"
        assert tier.stats()["fallbacks"] == 0

        transfer.stop()  # the listener and every connection: the port refuses now
        for seed in range(2, 12):
            assert round_trip(tier, seed) == (4, 4)
        stats = tier.stats()
        print("while the port is dead:", {k: stats[k] for k in ("fallbacks", "transfer_failures")})
        assert stats["fallbacks"] >= 10 and stats["transfer_down"] is True
        assert stats["errors"] == 0 and stats["breaker"]["num_opens"] == 0

        revived = listen(server.service, port, server_id)
        # Probes back off (at most fallback.PROBE_CAP_S apart): within a bounded time one finds
        # the port again and the tier goes back to it.
        deadline = time.monotonic() + 15
        while tier.stats()["transfer_down"] and time.monotonic() < deadline:
            assert round_trip(tier, 100) == (4, 4)
            time.sleep(0.05)
        assert tier.stats()["transfer_down"] is False
        before = tier.stats()["fallbacks"]
        for seed in range(200, 205):
            assert round_trip(tier, seed) == (4, 4)
        stats = tier.stats()
        assert stats["fallbacks"] == before and stats["errors"] == 0
        assert revived.admission.num_known_of("alice") >= 1  # its connections are on the port
    finally:
        tier.close()
        if revived is not None:
            revived.stop()


def test_gets_into_buffers_fall_back_too(server: ServiceServer) -> None:
    transfer = listen(server.service, 0)
    tier = RemoteTier(RemoteTierConfig(url=server.url, token=TOKENS["bob"]))
    try:
        blocks = make_blocks(NS, 6, seed=7)
        assert tier.put_many(NS.id, blocks) == 6
        transfer.stop()
        dests = [bytearray(len(b.data)) for b in blocks]
        got = tier.get_into(NS.id, [b.key for b in blocks], dests)
        assert all(g is not None for g in got)
        assert [bytes(d) for d in dests] == [bytes(b.data) for b in blocks]
        stats = tier.stats()
        assert stats["fallbacks"] == 1 and stats["hits"] == 6 and stats["errors"] == 0
    finally:
        tier.close()
