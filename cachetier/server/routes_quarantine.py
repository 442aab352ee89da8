"""Quarantine endpoints: namespaces the server's tiers no longer serve.

A client whose guard found a tier serving KV that does not match a recomputation reports it
here (``POST``): the server quarantines the namespace in each of its tiers, so every client of
that namespace misses there from then on, and the guard of whichever client computes the blocks
again stores honest ones. A tenant reports only its own namespaces; lifting a quarantine is an
operator's decision (admin tenants, ``cachetier quarantine lift``).

A report quarantines the namespace in every tier or, refused, in none. Each tenant holds at
most ``quarantine_quota`` quarantined namespaces by its reports; past it the report is answered
429 ``quarantine_quota``, and the other tenants' reports are taken as before.
"""

from __future__ import annotations

from fastapi import APIRouter

from cachetier.errors import QuarantineQuotaError
from cachetier.guard import Quarantine
from cachetier.server.auth import Scope
from cachetier.server.deps import CallerDep, ServiceDep, acting_tenant
from cachetier.server.schemas import (
    QuarantineCreate,
    QuarantineLift,
    QuarantinePublic,
    QuarantinesPublic,
    api_error,
    error_responses,
)

router = APIRouter(prefix="/v1/quarantines", tags=["quarantines"])


def _public(q: Quarantine) -> QuarantinePublic:
    _, tenant, namespace = q.namespace.split(".", 2)  # storage names are t.<tenant>.<ns>
    return QuarantinePublic(
        tier=q.tier,
        tenant=tenant,
        namespace=namespace,
        reason=q.reason,
        since_unix_s=q.since_unix_s,
        writer=q.writer,
    )


def _scope(tenant: str, namespace: str) -> Scope:
    try:
        return Scope.of(tenant, namespace)
    except ValueError as exc:
        raise api_error(400, "bad_namespace", str(exc)) from None


@router.post("", response_model=QuarantinesPublic, responses=error_responses(400, 401, 403, 429))
async def report(
    body: QuarantineCreate, caller: CallerDep, service: ServiceDep
) -> QuarantinesPublic:
    """Quarantine one of the caller's namespaces (one writer's records of it, if named) in
    every tier of the server."""
    scope = _scope(caller.tenant, body.namespace)
    held = service.store.quarantines
    reason = f"reported by a client of tenant {caller.tenant}: {body.reason}".rstrip(": ")
    tiers = [tier.name for tier in service.store.tiers]
    quota = service.config.quarantine_quota
    try:
        held.add_everywhere(tiers, scope.storage, reason, body.writer, caller.tenant, quota)
    except QuarantineQuotaError as exc:
        raise api_error(429, "quarantine_quota", str(exc)) from None
    mine = [q for q in held.entries() if q.namespace == scope.storage]
    return QuarantinesPublic(quarantines=[_public(q) for q in mine])


@router.get("", response_model=QuarantinesPublic, responses=error_responses(401, 403))
async def listing(caller: CallerDep, service: ServiceDep) -> QuarantinesPublic:
    """The caller's tenant's quarantines; admin tenants see every tenant's."""
    prefix = "t." if caller.is_admin else f"t.{caller.tenant}."
    held = [q for q in service.store.quarantines.entries() if q.namespace.startswith(prefix)]
    return QuarantinesPublic(quarantines=[_public(q) for q in held])


@router.post(
    "/lift", response_model=QuarantinesPublic, responses=error_responses(400, 401, 403, 404)
)
async def lift(body: QuarantineLift, caller: CallerDep, service: ServiceDep) -> QuarantinesPublic:
    """End a namespace's quarantines (in one tier, if named): admin tenants only."""
    if not caller.is_admin:
        raise api_error(403, "forbidden", "lifting a quarantine is for admin tenants")
    scope = _scope(acting_tenant(caller, service, body.tenant), body.namespace)
    lifted = service.store.quarantines.lift(scope.storage, body.tier)
    return QuarantinesPublic(quarantines=[_public(q) for q in lifted])
