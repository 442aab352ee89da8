"""Health, stats and metrics endpoints."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool

from cachetier.server.deps import CallerDep, ServiceDep
from cachetier.server.listener import LISTENERS
from cachetier.server.metrics import CONTENT_TYPE, ServerMetrics
from cachetier.server.schemas import (
    HealthPublic,
    LimitsPublic,
    StatsPublic,
    api_error,
    error_responses,
)

router = APIRouter(tags=["operations"])


@router.get("/healthz", response_model=HealthPublic)
async def healthz(request: Request, ready: bool = False) -> HealthPublic | JSONResponse:
    """Liveness: the server answers (no token needed, nothing disclosed). With ``?ready=1``,
    readiness: 503 while a listener (HTTP, transfer port, Unix socket) cannot accept, e.g.
    out of file descriptors; it accepts again by itself once they come back."""
    if ready:
        down = listeners_down(request)
        if down:
            return JSONResponse({"status": "not_ready", "listeners_down": down}, status_code=503)
    return HealthPublic(status="ok")


def listeners_down(request: Request) -> list[str]:
    """The names of the listeners that cannot accept now (none known: none)."""
    state = request.state
    down = [a.name for a in getattr(state, LISTENERS, []) if not a.up]
    metrics: ServerMetrics | None = getattr(state, "metrics", None)
    if metrics is not None and metrics.transfer is not None:
        down += [name for name, up, _ in metrics.transfer.listener_status() if not up]
    return down


@router.get("/v1/limits", response_model=LimitsPublic)
async def limits(service: ServiceDep) -> LimitsPublic:
    """Request size limits and the block transfer port (no token needed: they say nothing
    about any tenant)."""
    c = service.config
    return LimitsPublic(
        max_block_bytes=c.max_block_bytes,
        max_batch_bytes=c.max_batch_bytes,
        max_batch_blocks=c.max_batch_blocks,
        max_keys=c.max_keys,
        transfer_port=None if service.transfer is None else service.transfer.port,
        transfer_socket=None if service.transfer is None else service.transfer.socket_path,
        transfer_id=None if service.transfer is None else service.transfer.server_id,
        transfer_tls=service.transfer is not None and service.transfer.tls,
    )


@router.get("/v1/stats", response_model=StatsPublic, responses=error_responses(401, 403))
async def stats(caller: CallerDep, service: ServiceDep) -> StatsPublic:
    """Hits, misses and bytes of the caller's tenant; admin tenants see every tenant and tier."""
    if not caller.is_admin:
        return StatsPublic(
            tenant=caller.tenant, tenants={caller.tenant: service.tenant_stats(caller.tenant)}
        )
    # store.stats() may ask Redis for its size: not on the event loop.
    store = await run_in_threadpool(service.store.stats)
    return StatsPublic(
        tenant=caller.tenant,
        tenants={t: service.tenant_stats(t) for t in service.tenant_names},
        tiers=store["tiers"],
        pending_writes=store["pending_writes"],
        admission=store.get("admission"),
        live_curve=store.get("live_curve"),
    )


@router.get(
    "/metrics",
    response_class=Response,
    responses={
        200: {"description": "Prometheus text format", "content": {CONTENT_TYPE: {}}},
        **error_responses(401, 403),
    },
)
async def metrics(caller: CallerDep, request: Request) -> Response:
    """Prometheus metrics of every tier, tenant and endpoint (admin tenants only)."""
    if not caller.is_admin:
        raise api_error(403, "forbidden", "metrics are for admin tenants (admin_tenants)")
    registry: ServerMetrics = request.state.metrics
    return Response(await run_in_threadpool(registry.render), media_type=CONTENT_TYPE)
