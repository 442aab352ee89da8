"""The router's HTTP edge helpers: OpenAI-style error answers, bounded body reads, and the
caller's key checked into a tenant."""

from __future__ import annotations

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from cachetier.router.config import RouterConfig
from cachetier.router.keys import caller_tenant


def error(
    status: int,
    message: str,
    kind: str = "invalid_request_error",
    headers: dict[str, str] | None = None,
) -> JSONResponse:
    """An OpenAI error body (``{"error": {"message", "type", "param", "code"}}``)."""
    body = {"error": {"message": message, "type": kind, "param": None, "code": None}}
    return JSONResponse(body, status, headers=headers)


def busy(message: str) -> JSONResponse:
    """503 with ``Retry-After``: the router has no room for the request now."""
    return error(503, message, "server_error", {"Retry-After": "1"})


def tenant_or_refusal(request: Request, config: RouterConfig) -> str | Response:
    """The caller's tenant by its key, or the 401 to answer."""
    tenant = caller_tenant(
        request.headers.get("authorization", ""), config.api_key, config.client_keys
    )
    if tenant is None:
        return error(401, "a valid API key is needed: send 'Authorization: Bearer <key>'")
    return tenant


async def read_body(request: Request, limit: int) -> bytes | Response:
    """The body, or the 413 to answer once it passes ``limit`` (read no further)."""
    too_large = error(413, f"the body is over {limit} bytes, the router's (and replicas') limit")
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        return too_large
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            return too_large
        chunks.append(chunk)
    return b"".join(chunks)
