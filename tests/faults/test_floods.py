"""Connection floods without a token against a real ``cachetier serve`` (disk tier, three
tenants, transfer port; with and without TLS), from raw sockets on 127.0.0.1.

- A descriptor flood: the server runs under a small ``RLIMIT_NOFILE``; connections to its HTTP
  and transfer ports are held until it has no descriptor left, then closed. Every listener must
  serve a real request again within ``RECOVERY_S`` of the flood's end, and a real client's gets
  and puts must all succeed, over the transfer port and over HTTP. Run twice: with the
  connection caps the server derives from its limit (they keep it from running out at all), and
  with caps set above the limit (so its accepts do fail, and the listeners must outlive that).
- A TLS handshake flood: ``HANDSHAKE_FLOOD`` connections that never finish their handshake (some
  silent, some with half a ClientHello, some with a whole one and no answer to the server's)
  while a real HTTPS client works; the server's resident memory is read before, at its peak and
  after the flood, once it is back within ``RSS_RETAINED_MAX_MIB`` of before or
  ``RETAIN_WAIT_S`` on, whichever comes first.

Figures (``tests/faults/conftest.py``): ``fd_flood_listeners_dead`` (summed over the runs),
``fd_flood_legit_success_after`` (the lowest over the runs), ``fd_flood_peak_fds`` and
``fd_flood_nofile``; ``https_handshake_flood_connections`` (per round),
``https_handshake_flood_rounds``, ``https_handshake_flood_rss_growth_mib``,
``https_handshake_flood_rss_retained_mib``, ``https_handshake_flood_retain_wait_s`` and
``legit_https_success_during_handshake_flood``.

- Plain-HTTP floods (issue 65, item 8), against a server with the caps it derives: requests
  without a token on thousands of connections, then one tenant's thousands of authenticated
  keep-alive connections; after each, the server's RSS must come back within
  ``RSS_RETAINED_MAX_MIB`` of before (``flood_rss_retained_mib``, the most of the two; with
  ``flood_rss_retain_wait_s``, the longest wait).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from cachetier.primitives.keys import Namespace
from cachetier.server.fdlimits import raise_nofile_limit
from cachetier.tiers.remote import RemoteTier
from tests.certs import TLSFiles
from tests.faults.conftest import FaultFigures
from tests.faults.flood_server import (
    Flood,
    FloodServer,
    Monopoly,
    client_hello,
    http_serves,
    puts_and_gets,
    remote_tier,
    transfer_serves,
    wait_until,
)
from tests.faults.hostile import max_figure, min_figure
from tests.server.live import TOKENS
from tests.support import SMALL_LAYOUT

pytestmark = pytest.mark.slow(
    reason="floods real servers with thousands of connections and waits for memory to fall"
)

NS = Namespace("flood-model", SMALL_LAYOUT)
NOFILE = 256  # the descriptor-flooded server's RLIMIT_NOFILE, soft and hard
MAX_FLOOD = 1500  # most connections one descriptor flood opens to the HTTP port
HOLD_S = 2.0  # how long a flood is held once it is all open
RECOVERY_S = 5.0  # every listener serves again within this long of a flood's end
NUM_LEGIT_BLOCKS = 8  # blocks a real client puts and gets back, per client
# Caps above the limit: nothing stops the flood before the accepts fail for want of descriptors.
CAPS_OVER_LIMIT = {
    "max_connections": 4 * NOFILE,
    "max_unauthenticated_connections": 4 * NOFILE,
    "max_tls_handshakes": 4 * NOFILE,
}
# Unfinished TLS handshakes opened per round: 3,000 in the suite (about a minute);
# CACHETIER_HANDSHAKE_FLOOD sets another count for a one-off measurement (the 20,000
# needs this process's own RLIMIT_NOFILE above it).
HANDSHAKE_FLOOD = int(os.environ.get("CACHETIER_HANDSHAKE_FLOOD", "3000"))
HANDSHAKE_ROUNDS = 2
RETAIN_WAIT_S = 60.0  # longest wait after the last round for the retained memory to fall
RSS_GROWTH_MAX_MIB = 256
RSS_RETAINED_MAX_MIB = 32
NO_TOKEN_FLOOD = 3000  # connections per round of requests without a token
NO_TOKEN_ROUNDS = 3
MONOPOLY = 4000  # authenticated keep-alive connections one tenant opens and holds


@pytest.fixture
def servers() -> Iterator[list[FloodServer]]:
    """Servers a test started; each stopped at the end, failed or not."""
    started: list[FloodServer] = []
    yield started
    for server in started:
        server.stop()


@pytest.fixture
def floods() -> Iterator[list[Flood]]:
    """Floods a test opened; each closed at the end, failed or not."""
    opened: list[Flood] = []
    yield opened
    for flood in opened:
        flood.close()


@pytest.fixture
def tiers() -> Iterator[list[RemoteTier]]:
    """Remote tiers a test made; each closed at the end."""
    made: list[RemoteTier] = []
    yield made
    for tier in made:
        tier.close()


def legit_puts_and_gets(
    tier: RemoteTier, seed: int, count: int = NUM_LEGIT_BLOCKS
) -> tuple[int, int]:
    """``puts_and_gets`` in this module's namespace."""
    return puts_and_gets(tier, NS, seed, count)


def flood_to_the_limit(server: FloodServer, http: Flood, transfer: Flood) -> int:
    """Open connections to both ports until the server holds ``NOFILE`` descriptors or
    ``MAX_FLOOD`` are open, then a last batch its accepts cannot take; returns the most
    descriptors the server was seen holding."""
    peak = server.num_fds()
    while len(http.socks) < MAX_FLOOD and http.num_failed < 64:
        http.open(32)
        transfer.open(4)
        peak = max(peak, server.num_fds())
        if peak >= NOFILE - 2:
            break
    http.open(64)  # queued past the limit: the accepts that take them fail
    transfer.open(16)
    return max(peak, server.num_fds())


@pytest.mark.parametrize("caps", ["derived", "over_limit"])
@pytest.mark.parametrize("tls", [False, True], ids=["plain", "tls"])
def test_every_listener_serves_after_a_descriptor_flood(
    tmp_path: Path,
    tls_files: TLSFiles,
    fault_figures: FaultFigures,
    servers: list[FloodServer],
    floods: list[Flood],
    tiers: list[RemoteTier],
    tls: bool,
    caps: str,
) -> None:
    server = FloodServer(
        tmp_path,
        tls=tls_files if tls else None,
        nofile=NOFILE,
        settings=CAPS_OVER_LIMIT if caps == "over_limit" else {},
    )
    servers.append(server)
    server.start()
    http, transfer = Flood(server.port), Flood(server.transfer_port)
    floods += [http, transfer]

    peak_fds = flood_to_the_limit(server, http, transfer)
    time.sleep(HOLD_S)
    num_flood = len(http.socks) + len(transfer.socks)
    http.close()
    transfer.close()
    recovered_by = time.monotonic() + RECOVERY_S

    def left_s() -> float:
        return max(0.0, recovered_by - time.monotonic())

    http_up = wait_until(lambda: http_serves(server), left_s())
    transfer_up = wait_until(lambda: transfer_serves(server, NS.id), left_s())
    dead = [name for name, up in (("http", http_up), ("transfer", transfer_up)) if not up]

    # A real client of each tenant, one over the transfer port and one over HTTP.
    over_transfer = remote_tier(server, "alice", transfer=True)
    over_http = remote_tier(server, "bob", transfer=False)
    tiers += [over_transfer, over_http]
    done = total = 0
    for seed, tier in enumerate((over_transfer, over_http)):
        ok, attempted = legit_puts_and_gets(tier, seed)
        done, total = done + ok, total + attempted
    transfer_stats = over_transfer.stats()
    accept_errors = server.metric_sum("cachetier_accept_errors") if http_up else -1.0
    assert server.proc is not None and server.proc.poll() is None, server.stop()[-3000:]

    fault_figures.add("fd_flood_listeners_dead", len(dead))
    min_figure(fault_figures, "fd_flood_legit_success_after", done / total)
    max_figure(fault_figures, "fd_flood_peak_fds", peak_fds)
    fault_figures.set("fd_flood_nofile", NOFILE)
    print(
        f"descriptor flood ({'tls' if tls else 'plain'}, caps {caps}): {num_flood} connections, "
        f"peak {peak_fds} of {NOFILE} descriptors, {accept_errors:.0f} accept errors, "
        f"dead {dead}, legit {done}/{total}, transfer {transfer_stats['transfer']} "
        f"fallbacks {transfer_stats['fallbacks']}"
    )
    assert dead == [], f"listeners not serving {RECOVERY_S} s after the flood: {dead}"
    assert done == total, f"a real client after the flood: {done} of {total} gets and puts"
    assert transfer_stats["transfer"] is not None, "the transfer client fell to HTTP for good"
    assert transfer_stats["fallbacks"] == 0, transfer_stats
    if caps == "over_limit":
        # The flood did what it is for: the server ran out, and its accepts failed (the
        # descriptor count, sampled, may miss its peak; the failed accepts do not).
        assert accept_errors > 0, f"the flood never exhausted the server ({peak_fds} fds)"


def test_caps_derived_from_a_small_limit_keep_the_server_off_it(
    tmp_path: Path, servers: list[FloodServer], floods: list[Flood]
) -> None:
    server = FloodServer(tmp_path, nofile=NOFILE)
    servers.append(server)
    server.start()
    http = Flood(server.port)
    floods.append(http)
    peak_fds = server.num_fds()
    for _ in range(30):
        http.open(32)
        peak_fds = max(peak_fds, server.num_fds())
    time.sleep(HOLD_S)
    http.close()
    assert wait_until(lambda: http_serves(server), RECOVERY_S)
    accept_errors = server.metric_sum("cachetier_accept_errors")
    print(f"derived caps, {NOFILE} descriptors: peak {peak_fds}, {accept_errors:.0f} accept errors")
    assert accept_errors == 0, f"out of descriptors under its own caps (peak {peak_fds} seen)"


class LegitHttps:
    """A real HTTPS client at work in a thread: alternately a request on a fresh connection (a
    new handshake) and a put and get of one block through the remote tier over HTTPS."""

    def __init__(self, server: FloodServer, tier: RemoteTier) -> None:
        self._server = server
        self._tier = tier
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="legit-https", daemon=True)
        self.num_ok = self.num_tried = 0
        self.failures: list[str] = []

    def start(self) -> LegitHttps:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(30)

    def _run(self) -> None:
        seed = 1000
        while not self._stop.wait(0.02):
            seed += 1
            try:
                if seed % 2:
                    status, _ = self._server.get("/v1/stats", token=TOKENS["alice"])
                    ok, tried, what = int(status == 200), 1, f"GET /v1/stats: {status}"
                else:
                    ok, tried = legit_puts_and_gets(self._tier, seed, count=1)
                    what = f"put and get: {ok} of {tried}"
            except Exception as exc:  # noqa: BLE001 - a failure is counted, not raised
                ok, tried, what = 0, 1, repr(exc)
            self.num_ok += ok
            self.num_tried += tried
            if ok < tried:
                self.failures.append(what)


class RssPeak:
    """The highest resident memory of a process, sampled in a thread."""

    def __init__(self, server: FloodServer) -> None:
        self._server = server
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rss-peak", daemon=True)
        self.peak_mib = server.rss_mib()

    def __enter__(self) -> RssPeak:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join(10)
        self.peak_mib = max(self.peak_mib, self._server.rss_mib())

    def _run(self) -> None:
        while not self._stop.wait(0.05):
            self.peak_mib = max(self.peak_mib, self._server.rss_mib())


def retained_rss_mib(server: FloodServer, target_mib: float, deadline_s: float) -> float:
    """The server's RSS once it is at or under ``target_mib``, or at ``deadline_s`` if it never
    gets there: the heap is trimmed after a burst (``cachetier.server.heap``), and waiting
    for that, not out a fixed time, is what the retained-memory check needs."""
    deadline = time.monotonic() + deadline_s
    while (rss_mib := server.rss_mib()) > target_mib and time.monotonic() < deadline:
        time.sleep(0.5)
    return rss_mib


def test_unfinished_tls_handshakes_hold_bounded_memory_and_let_clients_in(
    tmp_path: Path,
    tls_files: TLSFiles,
    fault_figures: FaultFigures,
    servers: list[FloodServer],
    floods: list[Flood],
    tiers: list[RemoteTier],
) -> None:
    server = FloodServer(tmp_path, tls=tls_files)
    servers.append(server)
    server.start()
    tier = remote_tier(server, "alice", transfer=False)
    tiers.append(tier)
    assert legit_puts_and_gets(tier, seed=1) == (2 * NUM_LEGIT_BLOCKS, 2 * NUM_LEGIT_BLOCKS)
    time.sleep(1.0)
    before_mib = server.rss_mib()

    hello = client_hello()
    kinds = (b"", hello[: len(hello) // 2], hello)  # silent, half a ClientHello, a whole one
    legit = LegitHttps(server, tier).start()
    closed_by_server = []
    try:
        with RssPeak(server) as rss:
            for _ in range(HANDSHAKE_ROUNDS):
                flood = Flood(server.port, lambda i: kinds[i % len(kinds)])
                floods.append(flood)
                flood.open(HANDSHAKE_FLOOD, connect_timeout_s=1.0)
                time.sleep(HOLD_S)
                closed_by_server.append((len(flood.socks), flood.num_closed_by_server()))
                flood.close()
    finally:
        legit.stop()
    after_mib = retained_rss_mib(server, before_mib + RSS_RETAINED_MAX_MIB, RETAIN_WAIT_S)
    assert server.proc is not None and server.proc.poll() is None, server.stop()[-3000:]

    growth_mib = rss.peak_mib - before_mib
    retained_mib = after_mib - before_mib
    success = legit.num_ok / max(1, legit.num_tried)
    fault_figures.set("https_handshake_flood_connections", HANDSHAKE_FLOOD)
    fault_figures.set("https_handshake_flood_rounds", HANDSHAKE_ROUNDS)
    fault_figures.set("https_handshake_flood_retain_wait_s", RETAIN_WAIT_S)
    max_figure(fault_figures, "https_handshake_flood_rss_growth_mib", round(growth_mib, 1))
    max_figure(fault_figures, "https_handshake_flood_rss_retained_mib", round(retained_mib, 1))
    min_figure(fault_figures, "legit_https_success_during_handshake_flood", round(success, 4))
    print(
        f"handshake flood: {HANDSHAKE_ROUNDS} x {HANDSHAKE_FLOOD} connections "
        f"(held, closed by the server: {closed_by_server}); RSS {before_mib:.1f} MiB before, "
        f"{rss.peak_mib:.1f} peak, {after_mib:.1f} after (at most {RETAIN_WAIT_S:.0f} s); legit "
        f"{legit.num_ok}/{legit.num_tried}, first failures {legit.failures[:5]}"
    )
    assert legit.num_tried >= 20, "the real client barely ran: the test did not test it"
    assert success >= 0.99, f"{legit.num_ok} of {legit.num_tried}: {legit.failures[:5]}"
    assert growth_mib <= RSS_GROWTH_MAX_MIB, f"{before_mib:.1f} -> {rss.peak_mib:.1f} MiB"
    # Freed memory is handed back once the burst is over (``cachetier.server.heap``).
    assert retained_mib <= RSS_RETAINED_MAX_MIB, (
        f"RSS {before_mib:.1f} MiB before, {rss.peak_mib:.1f} peak, {after_mib:.1f} "
        f"up to {RETAIN_WAIT_S:.0f} s after: {retained_mib:.1f} MiB retained"
    )


def no_token_flood(server: FloodServer, floods: list[Flood]) -> int:
    """Rounds of connections that each send a request without a token (answered 401) or
    nothing, held a moment, then closed unread (so the server's ends are resets)."""
    request = b"GET /v1/stats HTTP/1.1\r\nHost: x\r\n\r\n"
    opened = 0
    for _ in range(NO_TOKEN_ROUNDS):
        flood = Flood(server.port, lambda i: request if i % 4 else b"")
        floods.append(flood)
        opened += flood.open(NO_TOKEN_FLOOD, connect_timeout_s=1.0)
        time.sleep(HOLD_S / 2)
        flood.close()
    return opened


def test_plain_http_floods_give_their_memory_back(
    tmp_path: Path,
    fault_figures: FaultFigures,
    servers: list[FloodServer],
    floods: list[Flood],
    tiers: list[RemoteTier],
) -> None:
    raise_nofile_limit()  # this process holds a monopoly's thousands of connections
    server = FloodServer(tmp_path)
    servers.append(server)
    server.start()
    tier = remote_tier(server, "alice", transfer=False)
    tiers.append(tier)
    assert legit_puts_and_gets(tier, seed=2) == (2 * NUM_LEGIT_BLOCKS, 2 * NUM_LEGIT_BLOCKS)
    time.sleep(1.0)
    before_mib = server.rss_mib()
    target_mib = before_mib + RSS_RETAINED_MAX_MIB

    with RssPeak(server) as no_token_rss:
        num_no_token = no_token_flood(server, floods)
    no_token_after = retained_rss_mib(server, target_mib, RETAIN_WAIT_S)

    monopoly = Monopoly(server.port, "bob")
    try:
        with RssPeak(server) as monopoly_rss:
            monopoly.open(MONOPOLY)
            num_held = monopoly.num_held()
    finally:
        monopoly.close()
    monopoly_after = retained_rss_mib(server, target_mib, RETAIN_WAIT_S)
    served_after = http_serves(server) and legit_puts_and_gets(tier, seed=3)[0]
    assert server.proc is not None and server.proc.poll() is None, server.stop()[-3000:]

    retained = {
        "no_token": no_token_after - before_mib,
        "monopoly": monopoly_after - before_mib,
    }
    max_figure(fault_figures, "flood_rss_retained_mib", round(max(retained.values()), 1))
    fault_figures.set("flood_rss_retain_wait_s", RETAIN_WAIT_S)
    print(
        f"plain floods: RSS {before_mib:.1f} MiB before; {num_no_token} connections without a "
        f"token: peak {no_token_rss.peak_mib:.1f}, after {no_token_after:.1f}; {num_held} of "
        f"{monopoly.num_opened} authenticated connections held: peak "
        f"{monopoly_rss.peak_mib:.1f}, after {monopoly_after:.1f} (at most {RETAIN_WAIT_S:.0f} s)"
    )
    assert served_after, "the server did not serve a real client after the floods"
    assert num_no_token >= NO_TOKEN_ROUNDS * NO_TOKEN_FLOOD // 2, "the flood barely opened"
    assert num_held >= MONOPOLY // 2, f"the monopoly held only {num_held} connections"
    for flood, mib in retained.items():
        assert mib <= RSS_RETAINED_MAX_MIB, (
            f"{flood} flood: RSS {before_mib:.1f} MiB before, {mib:.1f} MiB retained up to "
            f"{RETAIN_WAIT_S:.0f} s after"
        )
