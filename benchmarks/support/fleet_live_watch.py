"""What ``benchmarks.bench_fleet`` watches while its fleet runs: a replica killed and restarted
until the router can route to its disk again, and a router's index that lost events until it
agrees with every replica again.

Both read the router's ``GET /v1/fleet/index`` (per replica: epoch, and per medium a count and
an XOR digest) against each replica's ``GET /v1/fleet/state`` (``kv_events.epoch`` and
``kv_digest``), polling every ``POLL_S``: a figure is good to that much.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import aiohttp

from benchmarks.support.fleet_live_client import client_session, get_json, get_text, metric_values
from benchmarks.support.fleet_live_procs import LiveFleet
from cachetier.kvindex.index import SHARED_MEDIA

POLL_S = 0.05
WATCH_TIMEOUT_S = 180.0
BUSY_WAIT_S = 30.0


def replica_media(state: dict[str, Any]) -> dict[str, tuple[int, str]]:
    """A replica's own digests, node-local media only (shared ones are the fleet's), by
    lowercase medium name; empty media left out."""
    digest = state.get("kv_digest") or {}
    return {
        m.lower(): (int(d["count"]), str(d["xor"]))
        for m, d in digest.items()
        if m.lower() not in SHARED_MEDIA and int(d["count"]) > 0
    }


def index_media(index: dict[str, Any], name: str, epoch: int | None) -> dict[str, tuple[int, str]]:
    """What the router's index holds of replica ``name`` under ``epoch``, as ``replica_media``
    has it (nothing if the index holds another epoch of it)."""
    entry = (index.get("replicas") or {}).get(name)
    if not entry or entry.get("epoch") != epoch:
        return {}
    return {
        m.lower(): (int(d["count"]), str(d["xor"]))
        for m, d in (entry.get("media") or {}).items()
        if m.lower() not in SHARED_MEDIA and int(d["count"]) > 0
    }


def _epoch(state: dict[str, Any]) -> int | None:
    events = state.get("kv_events") or {}
    return events.get("epoch")


async def _state(session: aiohttp.ClientSession, url: str) -> dict[str, Any] | None:
    try:
        return await get_json(session, url + "/v1/fleet/state")
    except (aiohttp.ClientError, asyncio.TimeoutError, RuntimeError):
        return None


async def kill_and_restart(fleet: LiveFleet, victim: int, kill_at_s: float, start: float) -> dict:
    """SIGKILL replica ``victim`` ``kill_at_s`` after ``start`` (at its first moment with a
    request in flight from then on), start it again at once on the same port and disk
    folder, and time its way back: to listening, to healthy, to the router's rotation, and
    to the router's index holding its whole disk.

    Returns:
        Seconds from the new process's spawn: ``listening_s``, ``healthy_s``,
        ``router_up_s``, ``routable_s``; ``routable_after_healthy_s``; the disk blocks it
        restarted with (``restored_disk_blocks``) and when they were routable
        (``routable_disk_blocks``); ``down_s`` from the kill to the spawn; the requests it
        was answering when killed (``victim_in_flight_at_kill``).
    """
    await asyncio.sleep(max(start + kill_at_s - time.monotonic(), 0.0))
    child = fleet.replicas[victim]
    async with client_session() as session:
        in_flight = await _wait_busy(session, child.url)
    killed_at = time.monotonic()
    await asyncio.to_thread(child.kill)
    child.spawn()
    spawned = child.spawned_at
    await asyncio.to_thread(child.wait)
    out: dict[str, Any] = {
        "victim": child.name,
        "victim_in_flight_at_kill": in_flight,
        "killed_at_s": killed_at - start,
        "down_s": spawned - killed_at,
        "listening_s": time.monotonic() - spawned,
    }
    async with client_session() as session:
        out.update(await _watch_routable(session, fleet, child.name, child.url, spawned))
    return out


async def _watch_routable(
    session: aiohttp.ClientSession, fleet: LiveFleet, name: str, url: str, spawned: float
) -> dict[str, Any]:
    """Poll until the router's index holds the restarted replica's disk (see the module)."""
    healthy = up = routable = None
    restored = held = None
    deadline = spawned + WATCH_TIMEOUT_S
    while routable is None and time.monotonic() < deadline:
        now = time.monotonic()
        if healthy is None and await _healthy(session, url):
            healthy = now
        if up is None and await _router_has_it_up(session, fleet.router_url, name):
            up = now
        state = await _state(session, url)
        if state is not None:
            disk = replica_media(state).get("disk", (0, ""))[0]
            restored = disk if restored is None else restored
            index = await get_json(session, fleet.router_url + "/v1/fleet/index")
            indexed = index_media(index, name, _epoch(state)).get("disk", (0, ""))[0]
            if disk > 0 and indexed == disk:
                routable, held = now, disk
        await asyncio.sleep(POLL_S)
    since = lambda t: None if t is None else t - spawned  # noqa: E731 - a local helper
    return {
        "healthy_s": since(healthy),
        "router_up_s": since(up),
        "routable_s": since(routable),
        "routable_after_healthy_s": None
        if routable is None or healthy is None
        else routable - healthy,
        "restored_disk_blocks": restored,
        "routable_disk_blocks": held,
    }


async def _wait_busy(session: aiohttp.ClientSession, url: str) -> int:
    """Wait (``BUSY_WAIT_S`` at most) until the replica at ``url`` is answering a request;
    the requests it answers then. A kill of an idle replica would test nothing of what the
    router does with the requests a replica takes with it."""
    deadline = time.monotonic() + BUSY_WAIT_S
    seen = 0
    while time.monotonic() < deadline:
        state = await _state(session, url)
        seen = int((state or {}).get("num_in_flight", 0))
        if seen:
            break
        await asyncio.sleep(POLL_S / 2)
    return seen


async def _healthy(session: aiohttp.ClientSession, url: str) -> bool:
    try:
        async with session.get(url + "/healthz", timeout=aiohttp.ClientTimeout(total=2)) as r:
            return r.status == 200
    except (aiohttp.ClientError, asyncio.TimeoutError):
        return False


async def _router_has_it_up(session: aiohttp.ClientSession, router: str, name: str) -> bool:
    text = await get_text(session, router + "/metrics")
    up = metric_values(text, "cachetier_router_replica_up")
    return up.get(f'replica="{name}"', 0.0) == 1.0


async def watch_agreement(fleet: LiveFleet) -> dict[str, Any]:
    """From now (traffic stopped), poll until the router's index agrees with every replica on
    every node-local medium.

    Returns:
        ``stale_s``: seconds until it agreed (``None``: not within ``WATCH_TIMEOUT_S``);
        ``settled_s``: when a replica's own digests last changed (its tier writes go on
        after the last answer); ``disagreed_at_stop``: replicas the index disagreed with at
        the first poll; ``polls``.
    """
    start = time.monotonic()
    last: dict[str, Any] = {}
    settled = start
    disagreed_first: list[str] | None = None
    polls = 0
    async with client_session() as session:
        while time.monotonic() - start < WATCH_TIMEOUT_S:
            states = await asyncio.gather(*(_state(session, c.url) for c in fleet.replicas))
            index = await get_json(session, fleet.router_url + "/v1/fleet/index")
            now = time.monotonic()
            polls += 1
            differ = []
            for child, state in zip(fleet.replicas, states, strict=True):
                assert state is not None, f"{child.name} stopped answering"
                theirs = replica_media(state)
                if last.get(child.name) not in (None, theirs):
                    settled = now
                last[child.name] = theirs
                if index_media(index, child.name, _epoch(state)) != theirs:
                    differ.append(child.name)
            if disagreed_first is None:
                disagreed_first = differ
            if not differ:
                return {
                    "stale_s": now - start,
                    "settled_s": settled - start,
                    "disagreed_at_stop": disagreed_first,
                    "polls": polls,
                }
            await asyncio.sleep(POLL_S)
    return {
        "stale_s": None,
        "settled_s": settled - start,
        "disagreed_at_stop": disagreed_first,
        "polls": polls,
    }


async def fleet_counters(fleet: LiveFleet) -> dict[str, Any]:
    """The replicas' dropped KV events and the router's event and index counters, now."""
    async with client_session() as session:
        states = await asyncio.gather(*(_state(session, c.url) for c in fleet.replicas))
        text = await get_text(session, fleet.router_url + "/metrics")
    dropped = {
        c.name: int(((s or {}).get("kv_events") or {}).get("num_dropped_events", 0))
        for c, s in zip(fleet.replicas, states, strict=True)
    }
    out: dict[str, Any] = {"num_dropped_events": dropped}
    for name in (
        "kv_event_batches",
        "kv_event_batches_missed",
        "index_resyncs",
        "retries_total",
        "unrouted_requests_total",
    ):
        values = metric_values(text, f"cachetier_router_{name}")
        out[name] = int(sum(values.values()))
    return out
