"""The client side of ``benchmarks.bench_fleet``: streamed OpenAI completions with their TTFT,
sent open loop on a schedule, and the small HTTP reads the benchmark polls.

A request's TTFT is measured here, at the client: from just before its POST to the first
streamed event that carries a choice (``return_token_ids`` makes the first token one, whatever
its text). A request fails when its answer is not 200, its connection breaks, its stream ends
before ``[DONE]``, or the stream carries an error event: what a client of the router would see.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from benchmarks.support.fleet_live_requests import LiveRequest

REQUEST_TIMEOUT_S = 600.0


@dataclass(slots=True)
class Outcome:
    """What one request saw.

    Args:
        sent_at: when it was sent, seconds from the start of its run.
        ttft_s: its time to first token; ``None`` if no token came.
        error: why it failed; ``None`` if it did not.
        prompt_tokens: its prompt's tokens.
        cached_by_source: prompt tokens the replica did not compute, by where they came from
            (its answer's ``cachetier.cached_tokens_by_source``).
    """

    sent_at: float
    ttft_s: float | None = None
    error: str | None = None
    prompt_tokens: int = 0
    cached_by_source: dict[str, int] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.error is None


def client_session() -> aiohttp.ClientSession:
    """A session with no cap on connections (an open loop may have many requests waiting),
    and a new connection per request: on a kept-alive one that the server closes as its
    keep-alive ends, the next request fails while it is written, in the client's pool, not
    in the router."""
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0, force_close=True),
        timeout=aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S),
    )


def completion_body(prompt: Sequence[int], max_tokens: int) -> dict[str, Any]:
    """A streamed completion of ``max_tokens`` tokens, greedy, EOS ignored (every request
    decodes the same number)."""
    return {
        "prompt": list(prompt),
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
        "return_token_ids": True,
    }


async def stream_completion(
    session: aiohttp.ClientSession,
    url: str,
    prompt: Sequence[int],
    max_tokens: int,
    *,
    session_id: str | None = None,
    sent_at: float = 0.0,
) -> Outcome:
    """POST one streamed completion to ``url`` (a router or a replica) and read it to the end."""
    out = Outcome(sent_at, prompt_tokens=len(prompt))
    headers = {"x-session-id": session_id} if session_id else {}
    start = time.perf_counter()
    try:
        async with session.post(
            url + "/v1/completions", json=completion_body(prompt, max_tokens), headers=headers
        ) as resp:
            if resp.status != 200:
                out.error = f"status {resp.status}: {(await resp.text())[:200]}"
                return out
            async with aclosing(stream_events(resp)) as events:
                async for event in events:
                    if "error" in event:
                        out.error = f"error event: {str(event['error'])[:200]}"
                        return out
                    if event.get("choices") and out.ttft_s is None:
                        out.ttft_s = time.perf_counter() - start
                    info = event.get("cachetier") or {}
                    out.cached_by_source = dict(info.get("cached_tokens_by_source") or {})
    except StreamCut as exc:
        out.error = str(exc)
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:
        out.error = f"{type(exc).__name__}: {str(exc)[:200]}"
    return out


class StreamCut(Exception):
    """A streamed answer that ended before its ``[DONE]``."""


async def stream_events(resp: aiohttp.ClientResponse) -> AsyncIterator[dict[str, Any]]:
    """The JSON events of a streamed OpenAI answer (``data: ...`` lines), up to ``[DONE]``.

    Raises:
        StreamCut: the stream ended before ``[DONE]``.
        ValueError: an event is not JSON.
    """
    async for raw in resp.content:
        line = raw.strip()
        if not line.startswith(b"data: "):
            continue
        data = line[len(b"data: ") :]
        if data == b"[DONE]":
            return
        yield json.loads(data)
    raise StreamCut("the stream ended before [DONE]")


async def open_loop(
    url: str,
    requests: Sequence[LiveRequest],
    arrivals: Sequence[float],
    max_tokens: int,
    beside: Callable[[float], Awaitable[Any]] | None = None,
) -> tuple[list[Outcome], Any]:
    """Send ``requests[i]`` at ``arrivals[i]`` seconds from now, whatever the earlier ones are
    doing, and wait for every answer.

    Args:
        url: the router.
        requests: the requests, in order.
        arrivals: when each is sent (seconds from the start, ascending).
        max_tokens: tokens each generates.
        beside: run alongside the requests, given the start (``time.monotonic()``); what it
            returns is returned second.

    Returns:
        Each request's outcome, in order, and what ``beside`` returned (``None`` without it).
    """
    start = time.monotonic()

    async with client_session() as session:

        async def one(request: LiveRequest, at: float) -> Outcome:
            await asyncio.sleep(max(start + at - time.monotonic(), 0.0))
            return await stream_completion(
                session,
                url,
                request.prompt,
                max_tokens,
                session_id=request.session,
                sent_at=time.monotonic() - start,
            )

        sent = asyncio.gather(*(one(r, at) for r, at in zip(requests, arrivals, strict=True)))
        if beside is None:
            return list(await sent), None
        outcomes, extra = await asyncio.gather(sent, beside(start))
        return list(outcomes), extra


async def cold_rounds(
    urls: Sequence[str], prompts: Sequence[Sequence[int]], max_tokens: int
) -> list[float]:
    """Send one prompt to each replica at once, ``len(prompts) // len(urls)`` times; each
    round's wall time (until its last answer ends). Every prompt is new to the fleet, so a
    round is what the fleet takes to serve one cold request per replica, all busy at once."""
    rounds = []
    async with client_session() as session:
        for r in range(len(prompts) // len(urls)):
            batch = prompts[r * len(urls) : (r + 1) * len(urls)]
            start = time.perf_counter()
            outcomes = await asyncio.gather(
                *(stream_completion(session, u, p, max_tokens) for u, p in zip(urls, batch))
            )
            rounds.append(time.perf_counter() - start)
            failed = [o.error for o in outcomes if not o.ok]
            if failed:
                raise RuntimeError(f"a cold request failed: {failed[0]}")
    return rounds


async def get_json(session: aiohttp.ClientSession, url: str) -> dict[str, Any]:
    """GET ``url``'s JSON (raises on an answer other than 200)."""
    async with session.get(url, timeout=aiohttp.ClientTimeout(total=10)) as resp:
        if resp.status != 200:
            raise RuntimeError(f"GET {url}: {resp.status}")
        return await resp.json()


async def get_text(session: aiohttp.ClientSession, url: str) -> str:
    async with session.get(url, timeout=aiohttp.ClientTimeout(total=10)) as resp:
        return await resp.text()


def metric_values(text: str, name: str) -> dict[str, float]:
    """Every series of ``name`` in a Prometheus text page, by its label text (``""`` for
    none): ``{'policy="x",replica="r0"': 3.0}``."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("#") or not line.startswith(name):
            continue
        series, _, value = line.rpartition(" ")
        head, _, labels = series.partition("{")
        if head == name:
            out[labels.rstrip("}")] = float(value)
    return out


async def router_decisions(url: str, num_replicas: int) -> tuple[list[int], float | None]:
    """Requests the router at ``url`` has routed to each replica (r0, r1...), and the mean of
    the TTFT its policy estimated for the replica each went to (``None`` before any)."""
    async with client_session() as session:
        text = await get_text(session, url + "/metrics")
    counts = metric_values(text, "cachetier_router_requests_total")
    per = [0] * num_replicas
    for labels, value in counts.items():
        for i in range(num_replicas):
            if f'replica="r{i}"' in labels:
                per[i] += int(value)
    total = sum(metric_values(text, "cachetier_router_estimated_ttft_seconds_sum").values())
    count = sum(metric_values(text, "cachetier_router_estimated_ttft_seconds_count").values())
    return per, (total / count if count else None)
