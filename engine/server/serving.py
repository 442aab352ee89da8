"""The OpenAI completions and chat completions over ``AsyncEngine``: prompt checks, sampling
parameters, text with stop strings, usage with cached tokens, and SSE streams."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncGenerator, Awaitable
from contextlib import aclosing, suppress
from dataclasses import dataclass, field
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel

from cachetier.engine.llm_engine import RequestOutput
from cachetier.engine.sampling import SamplingParams
from cachetier.engine.server.async_engine import AsyncEngine, EngineDeadError
from cachetier.engine.server.config import EngineServerConfig
from cachetier.engine.server.errors import APIError
from cachetier.engine.server.metrics import EngineMetrics
from cachetier.engine.server.schemas import (
    CacheInfo,
    ChatCompletionRequest,
    CompletionRequest,
    PromptTokensDetails,
    Usage,
)
from cachetier.engine.server.text_stream import TextStream

T = TypeVar("T")
# Status 499 (nginx's "client closed request"): logged, never read by anyone.
CLIENT_GONE = 499


@dataclass(slots=True)
class Piece:
    """What one engine output adds to a request's answer."""

    text: str
    new_token_ids: list[int]
    output: RequestOutput
    finish_reason: str | None = None  # set on the last piece: stop or length
    full_text: str = ""  # the answer so far (final on the last piece)


def usage_of(output: RequestOutput) -> Usage:
    """Token counts of a request, with the prompt tokens served from cache."""
    num_prompt, num_out = len(output.prompt_token_ids), len(output.token_ids)
    return Usage(
        prompt_tokens=num_prompt,
        completion_tokens=num_out,
        total_tokens=num_prompt + num_out,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=output.num_cached_tokens),
    )


def cache_info_of(output: RequestOutput) -> CacheInfo:
    return CacheInfo(
        cached_tokens_by_source=dict(output.cached_tokens_by_source),
        miss_tokens_by_cause=dict(output.miss_tokens_by_cause),
        miss_tier=output.miss_tier,
        miss_detail=output.miss_detail,
    )


def sse(body: BaseModel | str) -> str:
    """One server-sent event."""
    data = body if isinstance(body, str) else body.model_dump_json()
    return f"data: {data}\n\n"


@dataclass
class OpenAIServing:
    """Everything a request needs, built once by the app's lifespan.

    Args:
        config: the server's settings.
        engine: the engine thread.
        tokenizer: the model's tokenizer, ``None`` if its folder has none (token-id prompts).
        metrics: where request and token metrics go.
        max_model_len: longest sequence the engine runs (prompt + output).
        vocab_size: the model's vocabulary size.
    """

    config: EngineServerConfig
    engine: AsyncEngine
    tokenizer: Any
    metrics: EngineMetrics
    max_model_len: int
    vocab_size: int
    created: int = field(default_factory=lambda: int(time.time()))
    num_in_flight: int = 0  # touched on the event loop only
    kv_events: Any = None  # the pool's KVEventPublisher, with ``EngineServerConfig.kv_events``

    @property
    def max_prompt_tokens(self) -> int:
        # The engine needs room for at least one output token.
        limit = self.max_model_len - 1
        if self.config.max_prompt_tokens is not None:
            limit = min(limit, self.config.max_prompt_tokens)
        return limit

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.config.model_name:
            raise APIError(
                404,
                f"the model {name!r} does not exist; this server serves "
                f"{self.config.model_name!r} (see /v1/models)",
                param="model",
                code="model_not_found",
            )

    def completion_prompt(self, request: CompletionRequest) -> list[int]:
        if isinstance(request.prompt, str):
            ids = _encode(self._need_tokenizer("a text prompt"), request.prompt, "prompt")
        else:
            ids = list(request.prompt)
        return self._check_prompt(ids)

    def chat_prompt(self, request: ChatCompletionRequest) -> list[int]:
        tokenizer = self._need_tokenizer("chat")
        messages = [m.as_template_input() for m in request.messages]
        try:
            # Render the template to text, then tokenize it once (as cachetier.engine.llm does): its
            # special tokens are in the text, so encoding must not add more.
            text = tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=False
            )
        except ValueError as exc:
            raise APIError(400, f"the chat template failed: {exc}", param="messages") from exc
        return self._check_prompt(_encode(tokenizer, text, "messages", add_special_tokens=False))

    def sampling_params(
        self,
        request: CompletionRequest | ChatCompletionRequest,
        num_prompt: int,
        max_tokens: int | None,
    ) -> SamplingParams:
        room = self.max_model_len - num_prompt
        if max_tokens is not None and max_tokens > room:
            raise APIError(
                400,
                f"this model's maximum context length is {self.max_model_len} tokens; the "
                f"prompt has {num_prompt} and {max_tokens} more were asked for: lower "
                "max_tokens or shorten the prompt",
                param="max_tokens",
                code="context_length_exceeded",
            )
        try:
            return SamplingParams(
                temperature=request.temperature,
                top_p=request.top_p,
                top_k=request.top_k,
                seed=request.seed,
                max_tokens=max_tokens if max_tokens is not None else room,
                ignore_eos=request.ignore_eos,
            )
        except ValueError as exc:
            raise APIError(400, str(exc)) from exc

    def text_stream(self, stop: list[str]) -> TextStream:
        tokenizer = self.tokenizer
        if stop and tokenizer is None:
            raise APIError(400, "stop strings need a tokenizer; this model has none", param="stop")
        if tokenizer is None:
            return TextStream(None)
        return TextStream(lambda ids: tokenizer.decode(ids, skip_special_tokens=True), stop)

    def check_capacity(self) -> None:
        """429 at ``max_concurrent_requests`` generations in flight, 503 with no engine."""
        if not self.engine.is_alive:
            raise APIError(503, "the engine is not running", type="server_error")
        if self.num_in_flight >= self.config.max_concurrent_requests:
            raise APIError(
                429,
                f"{self.num_in_flight} requests are in flight, the limit: retry later",
                type="rate_limit_error",
                code="rate_limit_exceeded",
            )

    async def pieces(
        self, request_id: str, prompt_ids: list[int], params: SamplingParams, text: TextStream
    ) -> AsyncGenerator[Piece, None]:
        """Run a request; one piece per engine output, the last one with its finish reason.

        Leaving early aborts the request in the engine.
        """
        # Counted here, not when the response is built: a stream never iterated (its client
        # left first) never runs this generator's cleanup either.
        self.num_in_flight += 1
        start = time.perf_counter()
        reason = "abort"
        try:
            generate = self.engine.generate(prompt_ids, params, request_id)
            async with aclosing(generate) as outputs:
                async for out in outputs:
                    delta = text.update(out.token_ids, final=out.finished)
                    if text.stopped or out.finished:
                        reason = "stop" if text.stopped else (out.finish_reason or "stop")
                        yield Piece(delta, out.new_token_ids, out, reason, text.text)
                        return  # leaving the engine's generator aborts a request cut short
                    yield Piece(delta, out.new_token_ids, out, None, text.text)
        except (EngineDeadError, ValueError):
            reason = "error"
            raise
        finally:
            self.num_in_flight -= 1
            self.metrics.on_request_done(reason, time.perf_counter() - start)

    async def stream(self, request: Request, events: AsyncGenerator[str, None]) -> Response:
        """The SSE answer of ``events``, its head held until the first event (the first
        token) exists: a failure before it is an HTTP error that a router retries on another
        replica, and a client that leaves during the prefill aborts its request (499)."""
        first = await unless_disconnected(request, _first_event(events))
        if first is None:
            await events.aclose()
            return Response(status_code=CLIENT_GONE)
        if isinstance(first, BaseException):
            await events.aclose()
            raise first

        async def with_errors() -> AsyncGenerator[str, None]:
            # The status line is sent by now: a failure becomes an error event, then the end.
            async with aclosing(events) as inner:
                try:
                    for event in first:
                        yield event
                    async for event in inner:
                        yield event
                except (EngineDeadError, ValueError) as exc:
                    yield sse(api_error_of(exc).body)
            yield sse("[DONE]")

        return StreamingResponse(
            with_errors(),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )

    def _need_tokenizer(self, what: str) -> Any:
        if self.tokenizer is None:
            raise APIError(
                400,
                f"{what} needs a tokenizer and this model folder has none: send the prompt as "
                "a list of token ids to /v1/completions",
                param="prompt" if what != "chat" else "messages",
            )
        return self.tokenizer

    def _check_prompt(self, ids: list[int]) -> list[int]:
        if not ids:
            raise APIError(400, "the prompt is empty", param="prompt")
        if len(ids) > self.max_prompt_tokens:
            raise APIError(
                400,
                f"the prompt has {len(ids)} tokens; this server takes at most "
                f"{self.max_prompt_tokens}",
                param="prompt",
                code="context_length_exceeded",
            )
        if min(ids) < 0 or max(ids) >= self.vocab_size:
            raise APIError(
                400, f"prompt token ids must be in [0, {self.vocab_size})", param="prompt"
            )
        return ids


def api_error_of(exc: EngineDeadError | ValueError) -> APIError:
    """The HTTP error of a request the engine failed: 503 once it died, 400 for a refusal."""
    if isinstance(exc, EngineDeadError):
        return APIError(503, str(exc), type="server_error")
    return APIError(400, str(exc))


async def _first_event(events: AsyncGenerator[str, None]) -> list[str] | APIError:
    """The stream's first event (``[]`` if it has none), or the error it failed with first."""
    try:
        async for event in events:
            return [event]
    except (EngineDeadError, ValueError) as exc:
        return api_error_of(exc)
    return []


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T | None:
    """Await ``work`` unless the client goes away first (then cancel it and return ``None``).

    A non-streaming request otherwise keeps its engine slot until it finishes, for nobody.
    """
    task = asyncio.ensure_future(work)

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        raise
    finally:
        watcher.cancel()
    if task.done():
        return task.result()
    task.cancel()
    with suppress(asyncio.CancelledError):
        await task
    return None


def _encode(tokenizer: Any, text: str, param: str, **options: Any) -> list[int]:
    """``text``'s token ids; text that is not valid Unicode (a lone surrogate, which JSON's
    ``\\ud800`` escapes can carry) is the client's error, not the tokenizer's."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise APIError(400, f"the text is not valid Unicode: {exc.reason}", param=param) from None
    return list(tokenizer.encode(text, **options))
