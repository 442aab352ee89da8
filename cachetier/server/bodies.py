"""Binary request and response bodies: records and batches in, streamed parts out."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from typing import Any

from fastapi import Request
from starlette.requests import ClientDisconnect
from starlette.responses import StreamingResponse
from starlette.types import Scope

from cachetier.protocol.http_batch import (
    BATCH_MEDIA_TYPE,
    RECORD_MEDIA_TYPE,
    BatchReader,
    FrameError,
    FrameTooLargeError,
)
from cachetier.record import Buffer
from cachetier.server.config import ServerConfig
from cachetier.server.edge import header_of
from cachetier.server.schemas import api_error


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


async def read_batch(request: Request, config: ServerConfig) -> list[memoryview | None]:
    """Read a batch body, enforcing the server's limits while it arrives.

    Args:
        request: a request whose body is a batch (``protocol.http_batch``).
        config: the server's limits.

    Returns:
        One buffer per record (``None`` for an empty one).
    """
    # Its size and Content-Length were checked before this (body_limit.BodyLimit).
    _check_type(request, BATCH_MEDIA_TYPE)
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


def _media_type(scope: Scope) -> str:
    return (header_of(scope, b"content-type") or "").split(";")[0].strip().lower()
