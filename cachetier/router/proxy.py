"""Forward one request to the replicas in the router's order, retrying before the first event.

A replica that refuses the connection, times out before answering, answers 5xx, or whose
answer breaks before the first byte of its body (of a stream: before its first whole event) is
marked failed and the next replica in the decision's order is tried: the client never sees a
replica die that way. Our engine sends a stream's head and first event only once its first
token exists, so a replica that dies mid-prefill is retried, not passed on as a broken stream.
Once bytes have gone to the client the answer is the replica's (a retry would duplicate
output); a stream (``text/event-stream``) is passed on whole event by whole event, and one that
breaks or ends without ``data: [DONE]`` ends with an error event and ``[DONE]`` (``sse``), never
a silent cut. 4xx answers are the client's and are passed through as they are.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

import aiohttp

from cachetier.router.replicas import Replica, ReplicaSet
from cachetier.router.sse import DONE, EventFrames, error_event, is_event_stream

log = logging.getLogger("cachetier.router")

# Headers of the replica's answer that are passed to the client; the rest (hop-by-hop, length,
# encoding) belong to each connection.
PASSED_HEADERS = ("content-type", "cache-control", "x-request-id")
CHUNK_BYTES = 64 << 10


@dataclass(slots=True)
class Upstream:
    """A replica's answer whose head and first body bytes (``first``) have arrived; its body
    is read by ``body()``. ``frames`` is set for a stream: its events pass on whole."""

    replica: Replica
    replicas: ReplicaSet
    status: int
    headers: dict[str, str]
    response: aiohttp.ClientResponse
    retries: int
    closed: bool = False
    work_s: float = 0.0
    first: bytes = b""
    frames: EventFrames | None = None

    def take_work(self, seconds: float) -> None:
        """Count ``seconds`` of estimated prefill in the replica's queue until this ends."""
        self.work_s = max(seconds, 0.0)
        self.replica.pending_s += self.work_s

    async def body(self) -> AsyncIterator[bytes]:
        """The body's chunks; the answer is closed when they end, however they end."""
        try:
            if self.first:
                yield self.first
            if self.frames is None:
                async for chunk in self.response.content.iter_chunked(CHUNK_BYTES):
                    yield chunk
            else:
                async for events in self._rest_of_stream(self.frames):
                    yield events
        finally:
            self.close()

    async def _rest_of_stream(self, frames: EventFrames) -> AsyncIterator[bytes]:
        """The stream's later events; an error event and ``[DONE]`` if it does not end with
        ``[DONE]`` (the replica died, timed out or closed early)."""
        why = "it ended the stream before [DONE]"
        try:
            async for chunk in self.response.content.iter_chunked(CHUNK_BYTES):
                ready = frames.take(chunk)
                if ready:
                    yield ready
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            why = f"its answer broke ({type(exc).__name__})"
        else:
            if frames.complete:
                return
        self.replicas.mark_failed(self.replica, f"mid-stream: {why}")
        message = (
            f"replica {self.replica.name} failed in the middle of this answer: {why}; the "
            "answer is incomplete, send the request again"
        )
        # A half event sent on (only one past MAX_HELD_BYTES) is ended first.
        yield (b"\n\n" if frames.open else b"") + error_event(message, code="replica_failed") + DONE

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
        frames = None
        if response.status == 200 and is_event_stream(response.headers.get("content-type")):
            frames = EventFrames()
        try:
            first = await _first_bytes(response, frames)
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            response.close()
            replica.in_flight -= 1
            replicas.mark_failed(replica, f"its answer broke before its body: {exc!r}")
            failures.append(f"{replica.name}: {type(exc).__name__}")
            continue
        passed = {k: v for k, v in response.headers.items() if k.lower() in PASSED_HEADERS}
        return Upstream(
            replica,
            replicas,
            response.status,
            passed,
            response,
            attempt,
            first=first,
            frames=frames,
        )
    raise NoReplicaError("no replica answered: " + ", ".join(failures or ["none is up"]))


async def _first_bytes(response: aiohttp.ClientResponse, frames: EventFrames | None) -> bytes:
    """The body's first bytes (``b""`` for an empty body); of a stream, its first whole
    events: a stream that ends before one is as broken as one that fails.

    Raises:
        aiohttp.ClientPayloadError: the stream ended before its first whole event.
    """
    while True:
        chunk = await response.content.readany()
        if frames is None:
            return chunk
        if not chunk:
            raise aiohttp.ClientPayloadError("the stream ended before its first event")
        ready = frames.take(chunk)
        if ready:
            return ready
