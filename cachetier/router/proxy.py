"""Forward one request to the replicas in the router's order, retrying before the first byte.

A replica that refuses the connection, times out before answering, answers 5xx, or whose
answer breaks before the first byte of its body is marked failed and the next replica in the
decision's order is tried: the client never sees a replica die that way. The router answers
the client only once the replica's first body bytes are in (a streaming engine sends its head
at once and its first token after the prefill, so a replica that dies mid-prefill is retried,
not passed on as a broken stream). Once bytes have gone to the client the answer is the
replica's, broken stream included (a retry would duplicate output). 4xx answers are the
client's and are passed through as they are.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

import aiohttp

from cachetier.router.replicas import Replica, ReplicaSet

log = logging.getLogger("cachetier.router")

# Headers of the replica's answer that are passed to the client; the rest (hop-by-hop, length,
# encoding) belong to each connection.
PASSED_HEADERS = ("content-type", "cache-control", "x-request-id")
CHUNK_BYTES = 64 << 10


@dataclass(slots=True)
class Upstream:
    """A replica's answer whose head and first body bytes (``first``) have arrived; its body
    is read by ``body()``."""

    replica: Replica
    status: int
    headers: dict[str, str]
    response: aiohttp.ClientResponse
    retries: int
    closed: bool = False
    work_s: float = 0.0
    first: bytes = b""

    def take_work(self, seconds: float) -> None:
        """Count ``seconds`` of estimated prefill in the replica's queue until this ends."""
        self.work_s = max(seconds, 0.0)
        self.replica.pending_s += self.work_s

    async def body(self) -> AsyncIterator[bytes]:
        """The body's chunks; the answer is closed when they end, however they end."""
        try:
            if self.first:
                yield self.first
            async for chunk in self.response.content.iter_chunked(CHUNK_BYTES):
                yield chunk
        finally:
            self.close()

    def close(self) -> None:
        """Release the replica's connection and drop its load count; idempotent (a client that
        left before the body began never runs ``body``, so the app closes it after too)."""
        if not self.closed:
            self.closed = True
            self.response.close()
            self.replica.in_flight -= 1
            self.replica.pending_s = max(self.replica.pending_s - self.work_s, 0.0)


class NoReplicaError(Exception):
    """No replica could take the request (all down, or all failed before answering)."""


async def forward(
    session: aiohttp.ClientSession,
    replicas: ReplicaSet,
    order: Sequence[Replica],
    path: str,
    body: bytes,
    headers: dict[str, str],
) -> Upstream:
    """Send ``body`` to the first replica of ``order`` that answers.

    Args:
        session: the router's client session.
        replicas: where a failed replica is marked.
        order: the replicas to try, best first.
        path: the request's path (``/v1/chat/completions``...).
        body: the request body, as the client sent it.
        headers: headers to send (content type, the replicas' key).

    Raises:
        NoReplicaError: every replica in ``order`` failed.
    """
    failures: list[str] = []
    for attempt, replica in enumerate(order):
        replica.in_flight += 1
        try:
            response = await session.post(replica.url + path, data=body, headers=headers)
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            replica.in_flight -= 1
            replicas.mark_failed(replica, f"{type(exc).__name__}: {exc}")
            failures.append(f"{replica.name}: {type(exc).__name__}")
            continue
        if response.status >= 500:
            response.release()
            replica.in_flight -= 1
            replicas.mark_failed(replica, f"it answered {response.status}")
            failures.append(f"{replica.name}: {response.status}")
            continue
        try:
            first = await response.content.readany()  # b"" for an empty body
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            response.close()
            replica.in_flight -= 1
            replicas.mark_failed(replica, f"its answer broke before its body: {exc!r}")
            failures.append(f"{replica.name}: {type(exc).__name__}")
            continue
        passed = {k: v for k, v in response.headers.items() if k.lower() in PASSED_HEADERS}
        return Upstream(replica, response.status, passed, response, attempt, first=first)
    raise NoReplicaError("no replica answered: " + ", ".join(failures or ["none is up"]))
