"""Binary request and response bodies: records and batches in, streamed parts out."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from typing import Any

from fastapi import Request
from starlette.requests import ClientDisconnect
from starlette.responses import JSONResponse, StreamingResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from cachetier.record import Buffer
from cachetier.server.config import ServerConfig
from cachetier.server.schemas import api_error
from cachetier.server.wire import (
    BATCH_MEDIA_TYPE,
    RECORD_MEDIA_TYPE,
    BatchReader,
    FrameError,
    FrameTooLargeError,
)


def binary_body(media_type: str, description: str) -> dict[str, Any]:
    """Document a raw (not JSON, not base64) request body.

    Args:
        media_type: the body's content type.
        description: what the body holds.

    Returns:
        An ``openapi_extra`` for a route.
    """
    schema = {"type": "string", "contentMediaType": media_type}
    return {
        "requestBody": {
            "required": True,
            "description": description,
            "content": {media_type: {"schema": schema}},
        }
    }


def binary_response(media_type: str, description: str) -> dict[str, Any]:
    """Document a raw response body.

    Args:
        media_type: the body's content type.
        description: what the body holds.

    Returns:
        A ``responses`` entry for a route.
    """
    return {
        "description": description,
        "content": {media_type: {"schema": {"type": "string", "contentMediaType": media_type}}},
    }


class PartsResponse(StreamingResponse):
    """Sends buffers one after another under a known Content-Length, never joining them.

    With the length known, uvicorn writes each part as it is (no chunked framing, which would
    copy every part once more).
    """

    def __init__(self, parts: Sequence[Buffer], total: int, media_type: str) -> None:
        async def each() -> AsyncIterator[Buffer]:
            for part in parts:
                yield memoryview(part).cast("B")

        super().__init__(each(), media_type=media_type, headers={"content-length": str(total)})


def _check_type(request: Request, expected: str) -> None:
    given = _media_type(request.scope)
    if given != expected:
        raise api_error(
            415, "unsupported_media_type", f"send the body as {expected}, not {given or 'nothing'}"
        )


def _check_length(request: Request, limit: int) -> None:
    length = request.headers.get("content-length")
    if length is None:
        return
    if not length.isdigit():
        raise api_error(400, "bad_request", f"Content-Length {length[:20]!r} is not a number")
    if int(length) > limit:
        raise api_error(413, "too_large", f"body of {length} bytes is over the limit of {limit}")


async def read_batch(request: Request, config: ServerConfig) -> list[memoryview | None]:
    """Read a batch body, enforcing the server's limits while it arrives.

    Args:
        request: a request whose body is a batch (``wire``).
        config: the server's limits.

    Returns:
        One buffer per record (``None`` for an empty one).
    """
    _check_type(request, BATCH_MEDIA_TYPE)
    _check_length(request, config.max_batch_bytes)
    reader = BatchReader(
        max_records=config.max_batch_blocks,
        max_record_bytes=config.max_block_bytes,
        max_batch_bytes=config.max_batch_bytes,
    )
    try:
        async for chunk in request.stream():
            reader.feed(chunk)
        return reader.finish()
    except FrameTooLargeError as exc:
        raise api_error(413, "too_large", str(exc)) from None
    except FrameError as exc:
        raise api_error(400, "bad_batch", str(exc)) from None
    except ClientDisconnect:
        raise api_error(400, "bad_batch", "the client went away before the body ended") from None


async def read_record(request: Request, config: ServerConfig) -> memoryview:
    """Read a single-record body.

    Args:
        request: a request whose body is one record.
        config: the server's limits (``max_block_bytes``).

    Returns:
        The body, read-only.
    """
    _check_type(request, RECORD_MEDIA_TYPE)
    _check_length(request, config.max_block_bytes)
    body = bytearray()
    try:
        async for chunk in request.stream():
            body += chunk
            if len(body) > config.max_block_bytes:
                raise api_error(
                    413, "too_large", f"record is over the limit of {config.max_block_bytes} bytes"
                )
    except ClientDisconnect:
        raise api_error(400, "bad_record", "the client went away before the body ended") from None
    return memoryview(body).toreadonly()


def json_body_limit(config: ServerConfig) -> int:
    """Largest body a JSON endpoint takes: room for its most keys, generously spaced.

    A key is 64 hex digits in quotes and a comma; 128 bytes each leaves room for indentation.
    """
    return 128 * max(config.max_keys, config.max_batch_blocks) + (64 << 10)


class JsonBodyLimit:
    """Refuses a body that is not a record or a batch (413) once it passes ``max_bytes``.

    The binary endpoints count their bodies while they read them (``read_batch``); FastAPI
    reads a JSON body whole before any handler sees it, so without this a client could make
    the server hold any amount of JSON in memory. Plain ASGI, like ``RequestMetricsMiddleware``.

    Args:
        app: the app to wrap.
        max_bytes: the limit (``json_body_limit``).
    """

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or _media_type(scope) in (RECORD_MEDIA_TYPE, BATCH_MEDIA_TYPE):
            await self.app(scope, receive, send)
            return
        length = _header(scope, b"content-length")
        if length.isdigit() and int(length) > self.max_bytes:
            body = {"error": "too_large", "message": self._message(f"body of {length} bytes")}
            await JSONResponse(body, status_code=413)(scope, receive, send)
            return
        seen = 0

        async def counted() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    # Raised inside the handler's body read: the app's handlers answer it.
                    raise api_error(413, "too_large", self._message("body"))
            return message

        await self.app(scope, counted, send)

    def _message(self, what: str) -> str:
        return f"{what} is over the limit of {self.max_bytes} bytes for a JSON request"


def _header(scope: Scope, name: bytes) -> str:
    for key, value in scope.get("headers", ()):
        if key.lower() == name:
            return value.decode("latin-1")
    return ""


def _media_type(scope: Scope) -> str:
    return _header(scope, b"content-type").split(";")[0].strip().lower()
