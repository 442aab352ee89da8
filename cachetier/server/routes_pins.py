"""Pin endpoints: keep a prefix's blocks from eviction in the server's tiers.

A tenant pins in its own namespaces; an admin tenant may name another tenant (``tenant`` in
the body, or the query of ``GET``). A pin of a block not stored yet is kept, and protects the
block once it arrives (an engine computes the prefix after the operator pinned it). Pins are
kept in ``<data_dir>/pins.json``, so a restarted server keeps them.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, HTTPException, Query
from starlette.concurrency import run_in_threadpool

from cachetier.errors import PinLimitError, TierUnavailableError
from cachetier.pins.registry import PinRegistryError
from cachetier.primitives.keys import BlockHash, chain_keys, parse_key
from cachetier.server.auth import Caller, Scope
from cachetier.server.deps import CallerDep, ServiceDep, acting_tenant
from cachetier.server.schemas import (
    PinEntryPublic,
    PinnedPublic,
    PinsCreate,
    PinsPublic,
    UnpinnedPublic,
    api_error,
    error_responses,
)
from cachetier.server.service import BlockService

router = APIRouter(prefix="/v1/pins", tags=["pins"])
# 409: the pin would pass a tier's bound on pinned bytes (nothing was pinned).
# 503: a tier's service (Redis) did not answer; nothing was changed, retry later.
_ERRORS = error_responses(400, 401, 403, 404, 409, 413, 422, 503)


def _scope_and_keys(
    body: PinsCreate, caller: Caller, service: BlockService
) -> tuple[Scope, list[BlockHash]]:
    tenant = acting_tenant(caller, service, body.tenant)
    try:
        scope = Scope.of(tenant, body.namespace)
    except ValueError as exc:
        raise api_error(400, "bad_namespace", str(exc)) from None
    if (body.keys is None) == (body.token_ids is None):
        raise api_error(400, "bad_request", "give either keys or token_ids (with block_size)")
    if body.keys is not None:
        keys = [parse_key(k) for k in body.keys]  # the schema checked the format
    else:
        assert body.token_ids is not None, "checked above"
        if scope.fingerprint is None or body.block_size is None:
            raise api_error(
                400,
                "bad_request",
                "token_ids need block_size and a namespace that is a Namespace.id (64 "
                "lower-case hex digits): its fingerprint is the root of the chain of keys",
            )
        keys = chain_keys(scope.fingerprint, body.block_size, body.token_ids)
    limit = service.config.max_keys
    if len(keys) > limit:
        raise api_error(413, "too_large", f"{len(keys)} blocks, at most {limit} per request")
    if not keys:
        raise api_error(400, "bad_request", "no full block to pin: fewer tokens than block_size")
    return scope, keys


def _unavailable(exc: TierUnavailableError) -> HTTPException:
    """503: a tier could not take the change now (its message names the tier, never a
    password: urls are redacted)."""
    return api_error(503, "tier_unavailable", str(exc), headers={"Retry-After": "1"})


@router.post("", response_model=PinnedPublic, responses=_ERRORS)
async def pin(body: PinsCreate, caller: CallerDep, service: ServiceDep) -> PinnedPublic:
    """Pin blocks (all or none): stored ones are kept from eviction at once, the others once
    they arrive. Refused with 409 when a tier's pinned bytes would pass its bound, 503 when a
    tier's Redis does not answer."""
    scope, keys = _scope_and_keys(body, caller, service)
    try:
        result = await run_in_threadpool(service.pin, scope, keys)
    except PinLimitError as exc:
        raise api_error(409, "pin_limit", str(exc)) from None
    except TierUnavailableError as exc:
        raise _unavailable(exc) from None
    except PinRegistryError as exc:
        raise api_error(500, "pin_registry", str(exc)) from None
    return PinnedPublic(
        tenant=scope.tenant,
        namespace=body.namespace,
        keys=[k.hex() for k in result.keys],
        num_new=result.num_new,
        protected=result.protected,
    )


@router.post("/delete", response_model=UnpinnedPublic, responses=_ERRORS)
async def unpin(body: PinsCreate, caller: CallerDep, service: ServiceDep) -> UnpinnedPublic:
    """Unpin blocks: they are evicted like any other from then on."""
    scope, keys = _scope_and_keys(body, caller, service)
    try:
        num = await run_in_threadpool(service.unpin, scope, keys)
    except TierUnavailableError as exc:
        raise _unavailable(exc) from None
    except PinRegistryError as exc:
        raise api_error(500, "pin_registry", str(exc)) from None
    return UnpinnedPublic(num_unpinned=num)


@router.get("", response_model=PinsPublic, responses=error_responses(401, 403, 404))
async def pins(
    caller: CallerDep,
    service: ServiceDep,
    tenant: Annotated[
        str | None,
        Query(max_length=32, description="one tenant's pins (admin tenants: default all)"),
    ] = None,
) -> PinsPublic:
    """Pinned keys of the caller's tenant; admin tenants see every tenant's and each tier's
    pinned bytes."""
    who = (
        acting_tenant(caller, service, tenant)
        if tenant is not None or not caller.is_admin
        else None
    )
    listing = await run_in_threadpool(service.pins_of, who)
    entries = [
        PinEntryPublic(tenant=t, namespace=ns, keys=[k.hex() for k in keys])
        for t, ns, keys in listing
    ]
    if not caller.is_admin:
        return PinsPublic(pins=entries)
    tiers = {t.name: t.pin_stats() for t in service.store.tiers}
    return PinsPublic(pins=entries, tiers=tiers)
