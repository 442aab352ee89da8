"""The app factory: a FastAPI app whose lifespan owns the store, the tenants' counters and the
metrics registry."""

from __future__ import annotations

import gc
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from cachetier.server import routes_admin, routes_blocks, routes_pins, routes_quarantine
from cachetier.server.body_limit import install_body_limit
from cachetier.server.config import ServerConfig
from cachetier.server.edge import AuthEdge, inflight_budget, refused_answer, route_limit
from cachetier.server.events import shared_publisher
from cachetier.server.fair_edge import FairEdge
from cachetier.server.metrics import RequestMetricsMiddleware, ServerMetrics
from cachetier.server.service import BlockService
from cachetier.server.transfer import TransferServer
from cachetier.store.config import build_store
from cachetier.util.tls import server_context

logger = logging.getLogger("cachetier.server")

OPEN_MODE_WARNING = (
    "OPEN MODE: requests without a token are accepted as tenant 'open'. Anyone who can reach "
    "this port can read, write and delete its blocks. For local development only."
)

_DESCRIPTION = """Shared, persistent KV-cache tiers for LLM engines.

Blocks travel as binary `cachetier.record` records (never base64): one record as
`application/octet-stream`, many as `application/x-cachetier-batch`
(`"CTB1" | count u32 | count x length u64 | records`, little-endian; a length of 0 is a miss).
The tenant comes from the bearer token; every namespace is the caller's tenant's own.
"""


def create_app(config: ServerConfig) -> FastAPI:
    """Build the server's app.

    Args:
        config: the server's settings; the store is opened when the app starts (lifespan)
            and flushed and closed when it stops.

    Returns:
        The app, for uvicorn.
    """

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[dict[str, Any]]:
        # The transfer port speaks TLS when HTTP does, with the same certificate. Read first:
        # a bad one fails the start before the store is opened.
        tls = server_context(config.tls_cert, config.tls_key) if config.tls_cert else None
        # Opening the disk tier scans its folder: not on the event loop.
        store = await run_in_threadpool(build_store, config.store)
        store.refuse_quarantined_writers = True  # for its clients: it has no tokens to check
        service = BlockService(config, store)
        try:
            service.publisher = await run_in_threadpool(shared_publisher, config, store)
        except (ValueError, OSError):
            await run_in_threadpool(service.close)
            raise
        transfer: TransferServer | None = None
        if config.transfer_port is not None or config.transfer_socket:
            transfer = TransferServer(
                service,
                config.host,
                config.transfer_port,
                config.transfer_socket or None,
                max_connections=config.transfer_connections,
                max_unauthenticated=config.transfer_unauthenticated_connections,
                hello_timeout_s=config.transfer_hello_timeout_s,
                head_timeout_s=config.head_timeout_s,
                body_timeout_s=config.body_timeout_s,
                idle_timeout_s=config.idle_timeout_s,
                tls=tls,
            )
            try:
                service.transfer = transfer.start()
            except OSError:
                await run_in_threadpool(service.close)
                raise
        if config.open_mode:
            logger.warning(OPEN_MODE_WARNING)
        logger.info("cachetier serving tiers %s", [t.name for t in store.tiers])
        # What start-up built lives as long as the server: out of the collector's sight, a
        # full collection under load walks only what requests made since, not every module
        # and route (a pause every request of every tenant would wait out).
        gc.freeze()
        try:
            yield {"service": service, "metrics": ServerMetrics(service, transfer)}
        finally:
            if transfer is not None:  # first: its puts in flight still reach the store
                await run_in_threadpool(transfer.stop)
            # Waits for every queued write to the lower tiers: nothing acknowledged is dropped.
            await run_in_threadpool(service.close)
            logger.info("cachetier store flushed and closed")

    app = FastAPI(
        title="cachetier",
        version="1",
        description=_DESCRIPTION,
        lifespan=lifespan,
    )
    # The last added runs first: metrics (so every answer is counted), then the token, then
    # the body's size; all on the head, before anything reads a body.
    # Innermost: a request refused on its head (token, size) never waits for a slot.
    app.add_middleware(FairEdge)
    install_body_limit(app, route_limit, refused_answer, inflight_budget)
    app.add_middleware(AuthEdge)
    app.add_middleware(RequestMetricsMiddleware)
    app.include_router(routes_blocks.router)
    app.include_router(routes_admin.router)
    app.include_router(routes_pins.router)
    app.include_router(routes_quarantine.router)
    _install_error_handlers(app)
    return app


def _install_error_handlers(app: FastAPI) -> None:
    """Every error answer is an ``ErrorPublic`` JSON body."""

    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        detail = exc.detail
        if not (isinstance(detail, dict) and "error" in detail):
            detail = {"error": _code(exc.status_code), "message": str(detail)}
        return JSONResponse(detail, status_code=exc.status_code, headers=exc.headers)

    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        problems = []
        for err in exc.errors()[:5]:
            where = ".".join(str(part) for part in err.get("loc", ()))
            problems.append(f"{where}: {err.get('msg', 'invalid')}")
        message = "; ".join(problems) or "the request does not match the API"
        return JSONResponse({"error": "invalid_request", "message": message}, status_code=422)

    async def unexpected(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unexpected error on %s %s", request.method, request.url.path)
        return JSONResponse(
            {"error": "internal", "message": "the server failed; see its log"}, status_code=500
        )

    app.add_exception_handler(StarletteHTTPException, http_error)  # type: ignore[arg-type]
    app.add_exception_handler(RequestValidationError, invalid)  # type: ignore[arg-type]
    app.add_exception_handler(Exception, unexpected)


def _code(status: int) -> str:
    return {404: "not_found", 405: "method_not_allowed"}.get(status, f"http_{status}")
