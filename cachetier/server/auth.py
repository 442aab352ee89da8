"""Bearer tokens -> tenants, and the storage scope every request is confined to.

The tenant comes from the token alone; the server writes it into the storage namespace of
every key (``t.<tenant>.<namespace>``), so no key, namespace or salt a client sends can reach
another tenant's blocks.
"""

from __future__ import annotations

import hmac
import re
from dataclasses import dataclass

from fastapi import HTTPException

from cachetier.errors import RequestRefusedError
from cachetier.server.config import OPEN_TENANT, ServerConfig
from cachetier.server.fairness import TenantShares
from cachetier.server.schemas import api_error
from cachetier.tiers.base import check_namespace

TENANT_HEADER = "X-Cachetier-Tenant"
_HEX_NAMESPACE = re.compile(r"^[0-9a-f]{64}$")


@dataclass(frozen=True, slots=True)
class Caller:
    """Who sent a request.

    Args:
        tenant: the tenant its token names (``open`` in open mode without a token).
        is_admin: may read every tenant's stats and the metrics.
    """

    tenant: str
    is_admin: bool


class TokenIndex:
    """Looks up the tenant of a bearer token in time independent of where a guess differs, and
    keeps what each tenant may take of the server's shared limits (``shares``): the one object
    HTTP and the transfer port both ask who a caller is, so both charge the same shares.

    Args:
        config: the tenants, their tokens and weights, the admin tenants and whether open mode
            is on.
    """

    def __init__(self, config: ServerConfig) -> None:
        self._pairs = [
            (token.encode(), tenant)
            for tenant, tokens in config.tenants.items()
            for token in tokens
        ]
        self._admins = frozenset(config.admin_tenants)
        self._open = config.open_mode
        self.shares = TenantShares(config)

    def tenant_of(self, token: str) -> str | None:
        """The tenant of a token.

        Args:
            token: the bearer token a request carried.

        Returns:
            The tenant, or ``None`` if no tenant has this token.
        """
        given = token.encode("utf-8", "surrogateescape")
        found = None
        for known, tenant in self._pairs:
            # Every token is compared, with compare_digest: no early exit to time.
            if hmac.compare_digest(known, given):
                found = tenant
        return found

    def resolve(self, token: str | None, claimed_tenant: str | None) -> str:
        """The tenant a request acts as.

        Args:
            token: the bearer token, ``None`` if the request carried none.
            claimed_tenant: the tenant the client expects its token to act as, if it names one
                (``X-Cachetier-Tenant``; optional).

        Returns:
            The tenant.

        Raises:
            AuthFailure: ``status`` 401 for a missing or unknown token, 403 when the claimed
                tenant is not the token's.
        """
        if token is None:
            if not self._open:
                raise AuthFailure(
                    401, "this server needs a bearer token (Authorization: Bearer ...)"
                )
            tenant = OPEN_TENANT
        else:
            found = self.tenant_of(token)
            if found is None:
                raise AuthFailure(401, "the bearer token is not one of this server's tokens")
            tenant = found
        if claimed_tenant is not None and claimed_tenant != tenant:
            raise AuthFailure(403, f"this token may not act as tenant {claimed_tenant[:40]!r}")
        return tenant

    def authenticate(self, authorization: str | None, claimed_tenant: str | None) -> Caller:
        """Who is calling, from an HTTP request's headers alone (no body is needed for it).

        Args:
            authorization: the ``Authorization`` header, ``None`` if the request had none.
            claimed_tenant: the ``X-Cachetier-Tenant`` header, if sent.

        Returns:
            The caller.

        Raises:
            AuthFailure: 401 for a missing, malformed or unknown token, 403 when the claimed
                tenant is not the token's.
        """
        tenant = self.resolve(bearer_token(authorization), claimed_tenant)
        return Caller(tenant, tenant in self._admins or tenant == OPEN_TENANT)

    def caller(self, authorization: str | None, claimed_tenant: str | None) -> Caller:
        """As ``authenticate``, for a FastAPI dependency.

        Raises:
            HTTPException: 401 or 403, as ``auth_error``.
        """
        try:
            return self.authenticate(authorization, claimed_tenant)
        except AuthFailure as exc:
            raise auth_error(exc) from None


def bearer_token(authorization: str | None) -> str | None:
    """The token of an ``Authorization: Bearer <token>`` header.

    Args:
        authorization: the header's value, ``None`` if the request had none.

    Returns:
        The token, or ``None`` without a header.

    Raises:
        AuthFailure: 401 for a header that is there but is not ``Bearer <token>`` (taken as no
            token at all, it would pass in open mode).
    """
    if authorization is None:
        return None
    scheme, _, token = authorization.partition(" ")
    if scheme.lower() != "bearer" or not token:
        raise AuthFailure(401, "the Authorization header must be 'Bearer <token>'")
    return token


class AuthFailure(RequestRefusedError):
    """A request's token does not let it act (``status``: 401 or 403, as in HTTP)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def auth_error(exc: AuthFailure) -> HTTPException:
    """The HTTP answer to a refused token: 401 (with ``WWW-Authenticate``) or 403.

    Args:
        exc: the refusal.

    Returns:
        An ``api_error``.
    """
    if exc.status == 401:
        return api_error(401, "unauthorized", exc.message, headers={"WWW-Authenticate": "Bearer"})
    return api_error(403, "forbidden", exc.message)


@dataclass(frozen=True, slots=True)
class Scope:
    """Where one request's blocks live.

    Args:
        tenant: the caller's tenant.
        storage: the storage namespace, ``t.<tenant>.<namespace as the client named it>``.
        fingerprint: the namespace fingerprint every record must carry, when the client's
            namespace is a ``Namespace.id`` (64 lower-case hex digits); else ``None``.
    """

    tenant: str
    storage: str
    fingerprint: bytes | None

    @classmethod
    def of(cls, tenant: str, namespace: str) -> Scope:
        """The scope of ``namespace`` for ``tenant``.

        Args:
            tenant: the caller's tenant (from its token, never from the request).
            namespace: the namespace the request names.

        Returns:
            The scope.

        Raises:
            ValueError: if ``namespace`` is not a valid client namespace.
        """
        check_namespace(namespace, prefix=f"t.{tenant}.")
        fingerprint = bytes.fromhex(namespace) if _HEX_NAMESPACE.match(namespace) else None
        return cls(tenant, f"t.{tenant}.{namespace}", fingerprint)
