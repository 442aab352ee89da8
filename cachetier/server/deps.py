"""FastAPI dependencies: the lifespan's service, the caller's tenant, the request's scope."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Header, Path, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from cachetier.server.auth import TENANT_HEADER, Caller, Scope
from cachetier.server.schemas import api_error
from cachetier.server.service import BlockService
from cachetier.tiers.base import MAX_NAMESPACE_CHARS

_bearer = HTTPBearer(auto_error=False, description="a token the server's config gives a tenant")


def get_service(request: Request) -> BlockService:
    """The service of the app's lifespan."""
    return request.state.service


async def require_caller(
    request: Request,
    credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)],
    claimed: Annotated[
        str | None,
        Header(
            alias=TENANT_HEADER,
            description="optional: the tenant the caller expects its token to act as (403 if not)",
        ),
    ] = None,
) -> Caller:
    """The caller's tenant, from its bearer token (401/403 otherwise).

    ``edge.AuthEdge`` has checked the token before anything read the body and left the caller
    in the request's state; ``credentials`` is declared for the OpenAPI document only.
    """
    found = getattr(request.state, "caller", None)
    if isinstance(found, Caller):
        return found
    # A route the edge lets through without a token: check it here all the same.
    authorization = request.headers.get("authorization")
    return get_service(request).tokens.caller(authorization, claimed)


async def scope_of(
    caller: Annotated[Caller, Depends(require_caller)],
    namespace: Annotated[
        str,
        Path(
            description=f"the client's namespace (e.g. Namespace.id): 1-{MAX_NAMESPACE_CHARS} "
            "characters of [A-Za-z0-9._-]; a 64-hex-digit one is taken as a namespace "
            "fingerprint that every record stored under it must carry"
        ),
    ],
) -> Scope:
    """The storage scope of this request (the caller's tenant + the named namespace)."""
    try:
        return Scope.of(caller.tenant, namespace)
    except ValueError as exc:
        raise api_error(400, "bad_namespace", str(exc)) from None


ServiceDep = Annotated[BlockService, Depends(get_service)]
ScopeDep = Annotated[Scope, Depends(scope_of)]
CallerDep = Annotated[Caller, Depends(require_caller)]


def acting_tenant(caller: Caller, service: BlockService, tenant: str | None) -> str:
    """The tenant a request acts on: the caller's own, or any for an admin tenant."""
    if tenant is None or tenant == caller.tenant:
        return caller.tenant
    if not caller.is_admin:
        raise api_error(
            403, "forbidden", "only admin tenants (admin_tenants) may name another tenant"
        )
    if tenant not in service.tenant_names:
        raise api_error(404, "no_tenant", f"no tenant {tenant[:40]!r} is configured")
    return tenant
