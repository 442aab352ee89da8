"""What every HTTP request passes before a handler sees it: its token (``AuthEdge``), then its
body's size and the server's bytes in flight (``BodyLimit``).

Both are plain ASGI middlewares that decide on the request's head alone, before anything
calls ``receive()``: FastAPI reads a JSON body whole before it resolves a route's
dependencies, so a token checked there comes after the body, however large, was read. The
guarded HTTP protocol (``httpserver``) reads nothing of a body until the app asks for it.
"""

from __future__ import annotations

import re

from fastapi import HTTPException
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from cachetier.server.auth import TENANT_HEADER, AuthFailure, auth_error
from cachetier.server.budget import Hold
from cachetier.server.config import ServerConfig
from cachetier.server.schemas import api_error
from cachetier.server.service import BlockService

# Paths anyone may ask for: health, limits and the API's own description. Every other path,
# an unknown one included, needs a token first.
PUBLIC_PATHS = frozenset(
    {"/healthz", "/v1/limits", "/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc"}
)
# The two routes whose bodies are records (routes_blocks); every other body is JSON.
_RECORD_PUT = re.compile(r"/v1/namespaces/[^/]+/blocks/[^/]+")
_BATCH_PUT = re.compile(r"/v1/namespaces/[^/]+/batch/put")


def header_of(scope: Scope, name: bytes) -> str | None:
    """The first value of a request header (``name`` in lower case), ``None`` if absent."""
    for key, value in scope.get("headers", ()):
        if key.lower() == name:
            return value.decode("latin-1")
    return None


def json_body_limit(config: ServerConfig) -> int:
    """Largest body a JSON endpoint takes: room for its most keys, generously spaced.

    A key is 64 hex digits in quotes and a comma; 128 bytes each leaves room for indentation.
    """
    return 128 * max(config.max_keys, config.max_batch_blocks) + (64 << 10)


def body_limit(method: str, path: str, config: ServerConfig) -> int:
    """Largest body a request may send, by its route, whatever its Content-Type says.

    Args:
        method: the request's method.
        path: its path.
        config: the server's limits.

    Returns:
        ``max_block_bytes`` for a record put, ``max_batch_bytes`` for a batch put,
        ``json_body_limit`` for anything else.
    """
    if method == "PUT" and _RECORD_PUT.fullmatch(path):
        return config.max_block_bytes
    if method == "POST" and _BATCH_PUT.fullmatch(path):
        return config.max_batch_bytes
    return json_body_limit(config)


def busy(message: str) -> HTTPException:
    """The answer when the server has no room for a request now (503, retry after a second)."""
    return api_error(503, "busy", message, headers={"Retry-After": "1"})


async def _answer(error: HTTPException, scope: Scope, receive: Receive, send: Send) -> None:
    """Send an ``api_error`` from outside the app's error handlers (same body, same headers)."""
    response = JSONResponse(error.detail, status_code=error.status_code, headers=error.headers)
    await response(scope, receive, send)


class AuthEdge:
    """Refuses a request without a valid token (401, or 403 for a wrong tenant claim) on its
    head, before anything reads its body, and leaves the caller in its state for the routes
    (``deps.require_caller``).

    Args:
        app: the app to wrap.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in PUBLIC_PATHS:
            await self.app(scope, receive, send)
            return
        service: BlockService = scope["state"]["service"]
        claimed = header_of(scope, TENANT_HEADER.lower().encode())
        try:
            caller = service.tokens.authenticate(header_of(scope, b"authorization"), claimed)
        except AuthFailure as exc:
            await _answer(auth_error(exc), scope, receive, send)
            return
        scope["state"]["caller"] = caller
        await self.app(scope, receive, send)


class BodyLimit:
    """Bounds every request's body by its route (``body_limit``), whatever its Content-Type,
    and holds its bytes in the service's ``inflight`` budget while the request runs.

    A Content-Length over the limit is refused (413) and one that does not fit in the budget
    is answered busy (503) before a byte of the body is read; a body without one (chunked) is
    counted as it arrives and refused the same way once it passes either.

    Args:
        app: the app to wrap.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        service: BlockService = scope["state"]["service"]
        limit = body_limit(scope["method"], scope["path"], service.config)
        held = Hold(service.inflight)
        length = header_of(scope, b"content-length")
        if length is not None:
            if not length.isdigit():
                message = f"Content-Length {length[:20]!r} is not a number"
                error = api_error(400, "bad_request", message)
                await _answer(error, scope, receive, send)
                return
            if int(length) > limit:
                error = api_error(413, "too_large", _over(f"body of {length} bytes", limit))
                await _answer(error, scope, receive, send)
                return
            if not held.take(int(length)):
                await _answer(busy(_no_room(int(length), held)), scope, receive, send)
                return
        seen = 0

        async def counted() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:
                    # Raised inside the handler's body read: the app's handlers answer it.
                    raise api_error(413, "too_large", _over("body", limit))
                # Without a Content-Length what is held grows with the body.
                if seen > held.nbytes and not held.take(seen - held.nbytes):
                    raise busy(_no_room(seen, held))
            return message

        try:
            await self.app(scope, counted, send)
        finally:
            held.release()


def _over(what: str, limit: int) -> str:
    return f"{what} is over the limit of {limit} bytes for this endpoint"


def _no_room(nbytes: int, held: Hold) -> str:
    return (
        f"a body of {nbytes} bytes does not fit in the {held.budget.limit_bytes} bytes of"
        " uploads the server holds at once; retry shortly"
    )
