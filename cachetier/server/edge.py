"""What every HTTP request passes before a handler sees it: its token and its tenant's shares
(``AuthEdge``: request rate and upload bytes, ``fairness``; past them 429 with
``Retry-After``), then its body's size and the server's bytes in flight
(``body_limit.BodyLimit``, with this server's limits and error format from here).

Both are plain ASGI middlewares that decide on the request's head alone, before anything
calls ``receive()``: FastAPI reads a JSON body whole before it resolves a route's
dependencies, so a token checked there comes after the body, however large, was read. The
guarded HTTP protocol (``httpserver``) reads nothing of a body until the app asks for it.
"""

from __future__ import annotations

import asyncio
import re

from fastapi import HTTPException
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from cachetier.server.auth import TENANT_HEADER, AuthFailure, auth_error
from cachetier.server.body_limit import BodyRefused
from cachetier.server.budget import ByteBudget
from cachetier.server.config import ServerConfig
from cachetier.server.fairness import MAX_HOLD_S, UPLOAD_RETRY_S, busy_message, retry_after_header
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


def error_answer(error: HTTPException) -> JSONResponse:
    """An ``api_error`` answered from outside the app's error handlers (same body, headers)."""
    return JSONResponse(error.detail, status_code=error.status_code, headers=error.headers)


def route_limit(scope: Scope) -> int:
    """``body_limit`` of a request, by the limits of the service in its state (``BodyLimit``)."""
    service: BlockService = scope["state"]["service"]
    return body_limit(scope["method"], scope["path"], service.config)


def inflight_budget(scope: Scope) -> ByteBudget:
    """The budget of upload bytes of the service in a request's state (``BodyLimit``)."""
    service: BlockService = scope["state"]["service"]
    return service.inflight


def refused_answer(refused: BodyRefused) -> JSONResponse:
    """The sidecar's answer to a body ``BodyLimit`` refused: an ``ErrorPublic`` body."""
    error = api_error(refused.status_code, refused.reason, refused.message, refused.headers)
    return error_answer(error)


def over_share(message: str, wait_s: float) -> HTTPException:
    """The answer to a tenant past its share: 429 with ``Retry-After`` (whole seconds; the
    message ends with the exact wait, ``fairness.busy_message``)."""
    headers = {"Retry-After": retry_after_header(wait_s)}
    return api_error(429, "over_share", busy_message(message, wait_s), headers=headers)


class AuthEdge:
    """Refuses a request without a valid token (401, or 403 for a wrong tenant claim) on its
    head, before anything reads its body, and leaves the caller in its state for the routes
    (``deps.require_caller``). Then charges the tenant's shares: one request of its rate, and
    the upload bytes its Content-Length declares (held until the request is done); past either
    it answers 429.

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
            await error_answer(auth_error(exc))(scope, receive, send)
            return
        scope["state"]["caller"] = caller
        shares = service.tokens.shares
        tenant = caller.tenant
        wait_s = shares.admit(tenant)
        if wait_s is not None:
            message = f"tenant {tenant} is past its share of the server's request rate"
            # Answered once its wait is (mostly) over: a client past its rate that asks again
            # at once would otherwise spend the CPU the other tenants need on 429s.
            await asyncio.sleep(min(wait_s, MAX_HOLD_S))
            await error_answer(over_share(message, wait_s))(scope, receive, send)
            return
        nbytes = _declared_upload(scope)
        if not shares.uploads.try_take(tenant, nbytes):
            message = f"tenant {tenant} holds its share of the server's uploads"
            await error_answer(over_share(message, UPLOAD_RETRY_S))(scope, receive, send)
            return
        try:
            await self.app(scope, receive, send)
        finally:
            shares.uploads.give(tenant, nbytes)


def _declared_upload(scope: Scope) -> int:
    """The bytes a request's Content-Length declares, if its route takes them (0 otherwise:
    ``BodyLimit`` refuses a bad or oversized one; a body without a length is held there, in the
    server's budget only)."""
    length = header_of(scope, b"content-length")
    if length is None or not length.isdigit():
        return 0
    nbytes = int(length)
    return nbytes if nbytes <= route_limit(scope) else 0
