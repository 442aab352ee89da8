"""The replicas behind the router: which are up, how loaded, and what each has measured.

A poller asks every replica's ``/healthz`` and ``GET /v1/fleet/state`` (our engine server) each
``poll_interval_s``. A replica that fails to answer, or answers a request with an error before
its first byte (``mark_failed``), leaves the rotation; it comes back at its next good poll. A
replica without the state route (``vllm serve`` with our connector) is still routed to, by its
load as the router counts it (the requests it is proxying there) and the rates of the others.

What a replica reports is checked before it is used: KV events are followed only at an endpoint
on the replica's own host (the host of its URL, or a wildcard bind there); a replica that names
another host (to draw the router's subscriber, and its traffic, elsewhere) is followed nowhere
until it reports its own, unless the router was told its endpoint (``replica_events``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import aiohttp

from cachetier.primitives.keys import KVLayout, Namespace
from cachetier.router.keys import replica_auth

log = logging.getLogger("cachetier.router")
ROUTED_DECAY = 0.998
"""Per request routed: a count's half-life is about 350 requests."""
WILDCARD_HOSTS = frozenset({"0.0.0.0", "*", "::", "[::]"})
LOOPBACK_HOSTS = frozenset({"127.0.0.1", "localhost", "::1"})


@dataclass(slots=True)
class Replica:
    """One replica as the router sees it."""

    name: str
    url: str
    up: bool = False
    in_flight: int = 0  # requests the router is proxying to it now
    pending_s: float = 0.0  # the estimated prefill of those requests: its queue's work
    routed: float = 0.0  # requests routed to it, decayed (``ReplicaSet.count_routed``)
    state: dict[str, Any] = field(default_factory=dict)  # its last /v1/fleet/state
    version: int = 0  # counts the polls that brought a state
    polled_in_flight: int = 0  # ``in_flight`` when that state was asked for
    namespace: Namespace | None = None
    last_ok: float = 0.0
    failures: int = 0
    refused_events: str | None = None  # an events endpoint it reported off its own host

    @property
    def load(self) -> int:
        """What the router weighs as its queue: the requests it proxies there now (exact),
        plus what the replica reported running and waiting beyond those the router had in
        flight when it asked (other clients': a report is up to a poll interval old)."""
        reported = self.state.get("num_running", 0) + self.state.get("num_waiting", 0)
        return max(reported - self.polled_in_flight, 0) + self.in_flight


class ReplicaSet:
    """Every replica, polled in the background.

    Args:
        urls: the replicas' base URLs (``http://host:port``).
        keys: base URL -> the key sent to that replica as a bearer token (its ``--api-key``);
            a replica not named is sent none.
        poll_interval_s: how often each replica is asked.
        timeout_s: how long a poll may take before the replica counts as down.
    """

    def __init__(
        self,
        urls: Sequence[str],
        keys: dict[str, str] | None = None,
        poll_interval_s: float = 1.0,
        timeout_s: float = 2.0,
    ) -> None:
        if not urls:
            raise ValueError("a router needs at least one replica URL")
        self.replicas = [Replica(f"r{i}", url.rstrip("/")) for i, url in enumerate(urls)]
        self.auth = replica_auth(keys or {})
        self.poll_interval_s = poll_interval_s
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._task: asyncio.Task[None] | None = None
        self._session: aiohttp.ClientSession | None = None

    @property
    def session(self) -> aiohttp.ClientSession:
        """The poller's session (each replica sent its own key), open between start and
        close."""
        assert self._session is not None, "start() opens the session"
        return self._session

    def by_name(self, name: str) -> Replica:
        return next(r for r in self.replicas if r.name == name)

    def up(self) -> list[Replica]:
        return [r for r in self.replicas if r.up]

    async def start(self) -> None:
        """Poll once (so the first request finds the replicas that answer), then on a timer."""
        self._session = aiohttp.ClientSession(timeout=self._timeout, middlewares=(self.auth,))
        await self.poll()
        self._task = asyncio.create_task(self._loop())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        if self._session is not None:
            await self._session.close()

    async def poll(self) -> None:
        """Ask every replica now."""
        await asyncio.gather(*(self._poll_one(r) for r in self.replicas))

    def count_routed(self, replica: Replica) -> None:
        """Count a request routed to ``replica``; every count decays, so the balance the
        policies keep is that of recent traffic (a replica back from a restart is not sent
        the whole backlog of what it missed)."""
        for other in self.replicas:
            other.routed *= ROUTED_DECAY
        replica.routed += 1.0

    def mark_failed(self, replica: Replica, reason: str) -> None:
        """A request to ``replica`` failed before its first byte: out of the rotation until
        its next good poll."""
        if replica.up:
            log.warning(
                "replica %s (%s) leaves the rotation: %s", replica.name, replica.url, reason
            )
        replica.up = False
        replica.failures += 1

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.poll_interval_s)
            await self.poll()

    async def _poll_one(self, replica: Replica) -> None:
        assert self._session is not None
        try:
            async with self._session.get(replica.url + "/healthz") as resp:
                healthy = resp.status == 200
            state: dict[str, Any] = {}
            in_flight = replica.in_flight
            if healthy:
                async with self._session.get(replica.url + "/v1/fleet/state") as resp:
                    if resp.status == 200:
                        state = _own_events(replica, await resp.json())
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:
            healthy, state = False, {}
            reason = f"{type(exc).__name__}: {exc}"
        else:
            reason = "its health check failed"
        if healthy:
            if not replica.up:
                log.info("replica %s (%s) is in the rotation", replica.name, replica.url)
            replica.up, replica.last_ok = True, time.monotonic()
            replica.state, replica.polled_in_flight = state, in_flight
            replica.version += 1
            replica.namespace = _namespace(state) or replica.namespace
        else:
            self.mark_failed(replica, reason)


def _own_events(replica: Replica, state: Any) -> dict[str, Any]:
    """``state`` without its ``kv_events`` when they name an endpoint off the replica's host."""
    if not isinstance(state, dict):
        return {}
    events = state.get("kv_events")
    if not isinstance(events, dict):
        return state
    host = (urlsplit(replica.url).hostname or "").lower()
    named = [events.get("endpoint"), events.get("replay_endpoint")]
    bad = next((e for e in named if e is not None and not _on_host(e, host)), None)
    if bad is None:
        replica.refused_events = None
        return state
    if replica.refused_events != str(bad):
        log.warning(
            "replica %s (%s) reports KV events off its host (%r): not followed",
            replica.name,
            replica.url,
            bad,
        )
        replica.refused_events = str(bad)
    return {**state, "kv_events": None}


def _on_host(endpoint: object, host: str) -> bool:
    """Whether a ZMQ endpoint is on ``host``: tcp at that host or a wildcard, or ipc when the
    replica is on this machine's loopback."""
    if not isinstance(endpoint, str):
        return False
    scheme, _, rest = endpoint.partition("://")
    if scheme == "ipc":
        return host in LOOPBACK_HOSTS
    if scheme != "tcp":
        return False
    where, _, port = rest.rpartition(":")
    where = where.lower()
    return port.isdigit() and (where in WILDCARD_HOSTS or where.strip("[]") == host)


def _namespace(state: dict[str, Any]) -> Namespace | None:
    raw = state.get("namespace")
    if not isinstance(raw, dict):
        return None
    try:
        return Namespace(raw["model_fingerprint"], KVLayout(**raw["layout"]), raw.get("tenant", ""))
    except (KeyError, TypeError, ValueError):
        return None
