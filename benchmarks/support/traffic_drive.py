"""The client of ``benchmarks.traffic``: the window's requests sent closed loop to one server.

Requests are sent in window order, at most ``concurrency`` at a time; a turn waits for its
conversation's previous turn to be answered before it is sent (and holds back the ones after
it, so every configuration gets the requests in the same order). Each is a streamed OpenAI
completion of token ids, greedy with EOS ignored; its TTFT is measured here, from just before
the POST to the first streamed event with a choice. The answer's usage gives the prompt tokens
the server did not compute (``prompt_tokens_details.cached_tokens``), and ours also where they
came from (``cachetier.cached_tokens_by_source``).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from benchmarks.support.fleet_live_client import StreamCut, stream_events
from benchmarks.support.traffic_trace import TrafficRequest

REQUEST_TIMEOUT_S = 900.0


@dataclass(frozen=True, slots=True)
class Endpoint:
    """Where a server listens: ``base_url``, over the Unix socket ``uds`` when it is set."""

    base_url: str
    uds: str | None = None
    model: str | None = None
    headers: dict[str, str] = field(default_factory=dict)

    def session(self) -> aiohttp.ClientSession:
        connector = (
            aiohttp.UnixConnector(path=self.uds, limit=0)
            if self.uds
            else aiohttp.TCPConnector(limit=0)
        )
        return aiohttp.ClientSession(
            connector=connector,
            timeout=aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S),
            headers=self.headers,
        )


@dataclass(slots=True)
class Answer:
    """What one request got.

    Args:
        index: the request's window position.
        sent_s: when it was sent, seconds from the run's start.
        ttft_s: its time to first token (``None``: no token came).
        done_s: when its stream ended, seconds from the run's start.
        token_ids: the generated tokens.
        prompt_tokens: its prompt's length.
        cached_tokens: prompt tokens the server did not compute.
        cached_by_source: those by source, where the server says (ours).
        error: why it failed, ``None`` if it did not.
    """

    index: int
    sent_s: float
    ttft_s: float | None = None
    done_s: float = 0.0
    token_ids: list[int] = field(default_factory=list)
    prompt_tokens: int = 0
    cached_tokens: int = 0
    cached_by_source: dict[str, int] = field(default_factory=dict)
    error: str | None = None


def body(endpoint: Endpoint, request: TrafficRequest) -> dict[str, Any]:
    out: dict[str, Any] = {
        "prompt": list(request.prompt),
        "max_tokens": request.max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
        "return_token_ids": True,
    }
    if endpoint.model:
        out["model"] = endpoint.model
    return out


def _take(answer: Answer, event: dict[str, Any], start: float) -> None:
    """Fold one streamed event into ``answer``."""
    if "error" in event:
        answer.error = f"error event: {str(event['error'])[:200]}"
        return
    for choice in event.get("choices") or ():
        if answer.ttft_s is None:
            answer.ttft_s = time.perf_counter() - start
        answer.token_ids.extend(choice.get("token_ids") or ())
    usage = event.get("usage") or {}
    details = usage.get("prompt_tokens_details") or {}
    if usage:
        answer.prompt_tokens = int(usage.get("prompt_tokens") or 0)
        answer.cached_tokens = int(details.get("cached_tokens") or 0)
    info = event.get("cachetier") or {}
    if info.get("cached_tokens_by_source"):
        answer.cached_by_source = dict(info["cached_tokens_by_source"])


async def send(
    session: aiohttp.ClientSession, endpoint: Endpoint, request: TrafficRequest, t0: float
) -> Answer:
    """POST one streamed completion and read it to ``[DONE]``."""
    start = time.perf_counter()
    answer = Answer(request.index, start - t0, prompt_tokens=len(request.prompt))
    try:
        url = endpoint.base_url + "/v1/completions"
        async with session.post(url, json=body(endpoint, request)) as resp:
            if resp.status != 200:
                answer.error = f"status {resp.status}: {(await resp.text())[:300]}"
                return answer
            async with aclosing(stream_events(resp)) as events:
                async for event in events:
                    _take(answer, event, start)
                    if answer.error:
                        return answer
    except StreamCut as exc:
        answer.error = str(exc)
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:
        answer.error = f"{type(exc).__name__}: {str(exc)[:200]}"
    finally:
        answer.done_s = time.perf_counter() - t0
    return answer


async def closed_loop(
    endpoint: Endpoint, requests: Sequence[TrafficRequest], concurrency: int
) -> tuple[list[Answer], float]:
    """Send every request as the module says; the answers in window order and the run's wall
    time in seconds."""
    answered = {r.index: asyncio.Event() for r in requests}
    slots = asyncio.Semaphore(concurrency)
    answers: dict[int, Answer] = {}

    async with endpoint.session() as session:
        t0 = time.perf_counter()

        async def one(request: TrafficRequest) -> None:
            try:
                answers[request.index] = await send(session, endpoint, request, t0)
            finally:
                answered[request.index].set()
                slots.release()

        tasks = []
        for request in requests:
            if request.after is not None:
                await answered[request.after].wait()
            await slots.acquire()
            tasks.append(asyncio.create_task(one(request)))
        await asyncio.gather(*tasks)
        wall_s = time.perf_counter() - t0
    return [answers[r.index] for r in requests], wall_s
