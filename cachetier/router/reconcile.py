"""``Reconciler``: keeps the router's prefix index equal to what each replica holds, whatever
events were lost.

Events are lost for reasons no replay fixes: the router started after them, a publisher's
queue was full, a replay buffer had moved on. Each ``interval_s`` the reconciler asks every
replica for its digests (``GET /v1/fleet/state``: per medium, the count and XOR of the keys its
events describe, ``cachetier.kvevents.HeldKeys``), compares them with the index's, and for a
medium that differs fetches the keys (``GET /v1/fleet/blocks``) and puts them in place of the
index's (``PrefixIndex.resync``). So a lost event leaves the index wrong for at most
``interval_s`` plus a fetch. A replica that is down is forgotten at once: its pool is gone, and
a router does not send it requests anyway.

Shared media (Redis, the sidecar) are not reconciled per replica: every replica's events of
them go into one shared set, which no single replica's digest describes.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

import aiohttp

from cachetier.kvindex import PrefixIndex
from cachetier.kvindex.index import SHARED_MEDIA
from cachetier.router.replicas import Replica, ReplicaSet

log = logging.getLogger("cachetier.router")
MAX_STATE_BYTES = 1 << 20
"""The most of a replica's ``/v1/fleet/state`` read."""
MAX_BLOCKS_BYTES = 32 << 20
"""The most of a ``/v1/fleet/blocks`` answer read (its 262,144 keys take 17 MiB)."""


class Reconciler:
    """Compares digests and resyncs, on a timer.

    Args:
        replicas: the router's replicas (the session and headers of their poller are used).
        index: the index kept right.
        interval_s: seconds between two rounds: the longest a lost event leaves it wrong.
    """

    def __init__(self, replicas: ReplicaSet, index: PrefixIndex, interval_s: float) -> None:
        if not interval_s > 0:
            raise ValueError(f"interval_s must be positive, got {interval_s}")
        self.replicas = replicas
        self.index = index
        self.interval_s = interval_s
        self.num_rounds = 0
        self.num_resyncs = 0
        self.num_errors = 0
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            await self.run_once()

    async def run_once(self) -> int:
        """One round over every replica; returns how many media were resynced."""
        self.num_rounds += 1
        done = await asyncio.gather(*(self._one(r) for r in self.replicas.replicas))
        return sum(done)

    async def _one(self, replica: Replica) -> int:
        if not replica.up:
            if self.index.epoch(replica.name) is not None:
                log.info("replica %s is down: its blocks leave the index", replica.name)
                self.index.forget(replica.name)
            return 0
        session = self.replicas.session
        try:
            async with session.get(replica.url + "/v1/fleet/state") as resp:
                state = await _read_json(resp, MAX_STATE_BYTES) if resp.status == 200 else {}
            return await self._compare(session, replica, state)
        except (
            aiohttp.ClientError,
            asyncio.TimeoutError,
            ValueError,
            TypeError,
            KeyError,
            AttributeError,
        ) as exc:  # a replica answering nonsense is logged and tried again next round
            self.num_errors += 1
            log.warning("reconciling replica %s: %s: %s", replica.name, type(exc).__name__, exc)
            return 0

    async def _compare(
        self, session: aiohttp.ClientSession, replica: Replica, state: dict[str, Any]
    ) -> int:
        events, digest = state.get("kv_events"), state.get("kv_digest")
        if not isinstance(events, dict) or not isinstance(digest, dict):
            return 0  # publishes nothing: nothing to reconcile
        epoch = int(events["epoch"])
        theirs = {
            medium: (int(d["count"]), int(d["xor"], 16))
            for medium, d in digest.items()
            if medium.lower() not in SHARED_MEDIA
        }
        ours = self.index.digests(replica.name) if self.index.epoch(replica.name) == epoch else {}
        names = {m.lower(): m for m in theirs}
        resynced = 0
        for medium in sorted(set(names) | set(ours)):
            if medium in SHARED_MEDIA:
                continue
            wanted = theirs.get(names.get(medium, medium), (0, 0))
            if ours.get(medium, (0, 0)) == wanted:
                continue
            keys = await self._keys(session, replica, names.get(medium, medium))
            self.index.resync(replica.name, epoch, medium, keys)
            self.num_resyncs += 1
            resynced += 1
            log.info(
                "replica %s: index resynced %s (%d keys; it held %d)",
                replica.name,
                medium,
                len(keys),
                ours.get(medium, (0, 0))[0],
            )
        return resynced

    async def _keys(
        self, session: aiohttp.ClientSession, replica: Replica, medium: str
    ) -> list[bytes]:
        url = replica.url + "/v1/fleet/blocks"
        async with session.get(url, params={"medium": medium}) as resp:
            if resp.status != 200:
                raise ValueError(f"/v1/fleet/blocks answered {resp.status}")
            body = await _read_json(resp, MAX_BLOCKS_BYTES)
        if body.get("truncated"):
            log.warning(
                "replica %s lists only part of %s: the index holds that part", replica.name, medium
            )
        keys = [bytes.fromhex(k) for k in body["keys"]]
        if any(len(k) != 32 for k in keys):
            raise ValueError("/v1/fleet/blocks listed a key that is not 32 bytes")
        return keys


async def _read_json(resp: aiohttp.ClientResponse, limit: int) -> Any:
    """The answer's JSON, read up to ``limit`` bytes: a replica that sends more is refused
    before it is all held."""
    chunks: list[bytes] = []
    size = 0
    async for chunk in resp.content.iter_chunked(1 << 16):
        size += len(chunk)
        if size > limit:
            raise ValueError(f"{resp.url.path} answered more than {limit} bytes")
        chunks.append(chunk)
    return json.loads(b"".join(chunks))
