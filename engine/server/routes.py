"""The HTTP routes: ``/v1/completions``, ``/v1/chat/completions``, ``/v1/models`` (behind the API
key when one is set), ``/healthz`` and ``/metrics`` (open, for probes and scrapers)."""

from __future__ import annotations

import hmac
import time
from collections.abc import AsyncGenerator
from contextlib import aclosing

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response
from starlette.concurrency import run_in_threadpool

from cachetier.engine.server.async_engine import EngineDeadError
from cachetier.engine.server.errors import APIError
from cachetier.engine.server.metrics import CONTENT_TYPE
from cachetier.engine.server.schemas import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatDelta,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    ErrorResponse,
    ModelCard,
    ModelList,
)
from cachetier.engine.server.serving import (
    CLIENT_GONE,
    OpenAIServing,
    Piece,
    api_error_of,
    cache_info_of,
    new_id,
    sse,
    unless_disconnected,
    usage_of,
)


def usage_event(
    chunk_type: type[CompletionResponse] | type[ChatCompletionChunk],
    request_id: str,
    created: int,
    name: str,
    piece: Piece,
) -> str:
    """The last event of a stream with ``stream_options.include_usage``: no choices, the usage
    (with cached tokens) and our cache extension, as OpenAI sends it."""
    return sse(
        chunk_type(
            id=request_id,
            created=created,
            model=name,
            choices=[],
            usage=usage_of(piece.output),
            cachetier=cache_info_of(piece.output),
        )
    )


_ERRORS = {
    code: {"model": ErrorResponse, "description": text}
    for code, text in (
        (400, "a bad request"),
        (401, "no or a wrong API key"),
        (404, "an unknown model"),
        (413, "a body over the limit"),
        (429, "too many requests in flight"),
        (503, "the engine is not running"),
    )
}


def get_serving(request: Request) -> OpenAIServing:
    """The serving state of the app's lifespan."""
    return request.state.serving


async def require_api_key(request: Request) -> None:
    """401 unless the request carries the configured key (when one is configured)."""
    key = get_serving(request).config.api_key
    if key is None:
        return
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), key.encode()):
        raise APIError(
            401,
            "a valid API key is needed: send 'Authorization: Bearer <key>'",
            code="invalid_api_key",
        )


router = APIRouter()
v1 = APIRouter(prefix="/v1", dependencies=[Depends(require_api_key)], responses=_ERRORS)


@router.get("/healthz", summary="200 while the engine runs, 503 once it stopped")
async def healthz(request: Request) -> JSONResponse:
    alive = get_serving(request).engine.is_alive
    return JSONResponse({"status": "ok" if alive else "engine stopped"}, 200 if alive else 503)


@router.get("/metrics", summary="Prometheus metrics", response_class=Response)
async def metrics(request: Request) -> Response:
    return Response(get_serving(request).metrics.render(), media_type=CONTENT_TYPE)


@v1.get("/models", response_model=ModelList)
async def models(request: Request) -> ModelList:
    serving = get_serving(request)
    card = ModelCard(
        id=serving.config.model_name, created=serving.created, max_model_len=serving.max_model_len
    )
    return ModelList(data=[card])


@v1.post("/completions", response_model=CompletionResponse)
async def completions(body: CompletionRequest, request: Request) -> Response:
    serving = get_serving(request)
    serving.check_model(body.model)
    # Tokenizing a long prompt takes a while: off the event loop, so health checks and other
    # requests are answered meanwhile.
    prompt = await run_in_threadpool(serving.completion_prompt, body)
    params = serving.sampling_params(body, len(prompt), body.max_tokens)
    text = serving.text_stream(body.stop_strings)
    serving.check_capacity()
    request_id, created, name = new_id("cmpl"), int(time.time()), serving.config.model_name
    pieces = serving.pieces(request_id, prompt, params, text)

    def choice(piece: Piece, text: str) -> CompletionChoice:
        return CompletionChoice(
            text=text,
            finish_reason=piece.finish_reason,
            # Streams send the prompt's ids once, in the last chunk.
            prompt_token_ids=prompt if body.return_token_ids and piece.finish_reason else None,
            token_ids=(piece.new_token_ids if body.stream else piece.output.token_ids)
            if body.return_token_ids
            else None,
        )

    if body.stream:

        async def events() -> AsyncGenerator[str, None]:
            async with aclosing(pieces) as run:
                async for piece in run:
                    if piece.text or piece.finish_reason or body.return_token_ids:
                        chunk = CompletionResponse(
                            id=request_id,
                            created=created,
                            model=name,
                            choices=[choice(piece, piece.text)],
                        )
                        yield sse(chunk)
                    if piece.finish_reason and body.include_usage:
                        yield usage_event(CompletionResponse, request_id, created, name, piece)

        return await serving.stream(request, events())
    last = await _finish(request, pieces)
    if last is None:
        return Response(status_code=CLIENT_GONE)
    answer = CompletionResponse(
        id=request_id,
        created=created,
        model=name,
        choices=[choice(last, last.full_text)],
        usage=usage_of(last.output),
        cachetier=cache_info_of(last.output),
    )
    return JSONResponse(answer.model_dump(mode="json"))


@v1.post("/chat/completions", response_model=ChatCompletionResponse)
async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
    serving = get_serving(request)
    serving.check_model(body.model)
    prompt = await run_in_threadpool(serving.chat_prompt, body)
    params = serving.sampling_params(body, len(prompt), body.requested_max_tokens)
    text = serving.text_stream(body.stop_strings)
    serving.check_capacity()
    request_id, created, name = new_id("chatcmpl"), int(time.time()), serving.config.model_name
    pieces = serving.pieces(request_id, prompt, params, text)

    def chunk(delta: ChatDelta, reason: str | None = None, ids: list[int] | None = None) -> str:
        one = ChatChunkChoice(delta=delta, finish_reason=reason, token_ids=ids)
        return sse(ChatCompletionChunk(id=request_id, created=created, model=name, choices=[one]))

    if body.stream:

        async def events() -> AsyncGenerator[str, None]:
            role_sent = False
            async with aclosing(pieces) as run:
                async for piece in run:
                    if not role_sent:
                        # With the first token, not before: until then a replica that dies
                        # has sent nothing, and the router retries the request elsewhere.
                        role_sent = True
                        yield chunk(ChatDelta(role="assistant", content=""))
                    ids = piece.new_token_ids if body.return_token_ids else None
                    if piece.text or ids:
                        yield chunk(ChatDelta(content=piece.text), ids=ids)
                    if piece.finish_reason:
                        yield chunk(ChatDelta(), piece.finish_reason)
                        if body.include_usage:
                            yield usage_event(ChatCompletionChunk, request_id, created, name, piece)

        return await serving.stream(request, events())
    last = await _finish(request, pieces)
    if last is None:
        return Response(status_code=CLIENT_GONE)
    answer = ChatCompletionResponse(
        id=request_id,
        created=created,
        model=name,
        choices=[
            ChatChoice(
                message=AssistantMessage(content=last.full_text),
                finish_reason=last.finish_reason,
                prompt_token_ids=prompt if body.return_token_ids else None,
                token_ids=last.output.token_ids if body.return_token_ids else None,
            )
        ],
        usage=usage_of(last.output),
        cachetier=cache_info_of(last.output),
    )
    return JSONResponse(answer.model_dump(mode="json"))


async def _finish(request: Request, pieces: AsyncGenerator[Piece, None]) -> Piece | None:
    """The last piece of a request run to its end; ``None`` if the client left first."""

    async def last_piece() -> Piece:
        last: Piece | None = None
        async with aclosing(pieces) as run:
            async for piece in run:
                last = piece
        assert last is not None, "a request ended without a final output"
        return last

    try:
        return await unless_disconnected(request, last_piece())
    except (EngineDeadError, ValueError) as exc:
        raise api_error_of(exc) from exc
