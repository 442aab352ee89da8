"""The server's tenants: names, bearer tokens and weights, as the settings give them.

Checked here once, at load: a name the storage scope can carry, tokens a bearer header can
carry and long enough not to be guessed, one owner per token, and a positive weight for the
tenants that share the server's limits (``cachetier.server.fairness``).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from cachetier.server.config import ServerConfig

OPEN_TENANT = "open"
"""The tenant every request without a token acts as, in open mode only."""

_TENANT_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,31}$")
# RFC 6750 b64token characters; ':' and ',' stay free to separate the CACHETIER_TENANTS list.
_TOKEN_RE = re.compile(r"^[A-Za-z0-9._~+/-]+=*$")
MIN_TOKEN_CHARS = 16


def split_weights(
    tenants: Mapping[str, Any], weights: Mapping[str, Any]
) -> tuple[Mapping[str, Any], dict[str, Any]]:
    """Tokens and weights apart, from a tenants table whose entries may be tables
    (``{tokens = [...], weight = 2}``) beside ``tenant_weights``."""
    if not isinstance(tenants, Mapping) or not isinstance(weights, Mapping):
        return tenants, dict(weights)  # frozen_tenants and checked_weights say what is wrong
    out_weights = dict(weights)
    out: dict[str, Any] = {}
    for tenant, entry in tenants.items():
        if isinstance(entry, Mapping):
            unknown = sorted(set(entry) - {"tokens", "weight"})
            if unknown:
                raise ValueError(
                    f"tenant {tenant!r} has unknown keys {unknown}; known: tokens, weight"
                )
            if "weight" in entry:
                out_weights[tenant] = entry["weight"]
            entry = entry.get("tokens", ())
        out[tenant] = entry
    return out, out_weights


def checked_weights(weights: Mapping[str, Any], tenants: Mapping[str, Any]) -> Mapping[str, float]:
    out: dict[str, float] = {}
    for tenant, weight in weights.items():
        if tenant not in tenants and tenant != OPEN_TENANT:
            raise ValueError(f"tenant_weights names {tenant!r}, which is not a configured tenant")
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not weight > 0:
            raise ValueError(
                f"the weight of tenant {tenant!r} must be a positive number, got {weight!r}"
            )
        out[tenant] = float(weight)
    return MappingProxyType(out)


def frozen_tenants(tenants: Mapping[str, Any]) -> Mapping[str, tuple[str, ...]]:
    if not isinstance(tenants, Mapping):
        raise TypeError(f"tenants must map tenant names to tokens, got {type(tenants).__name__}")
    owner: dict[str, str] = {}
    out: dict[str, tuple[str, ...]] = {}
    for tenant, tokens in tenants.items():
        if not isinstance(tenant, str) or not _TENANT_RE.match(tenant):
            raise ValueError(
                f"tenant name {tenant!r} must be 1-32 characters of [A-Za-z0-9_-] starting with "
                "a letter or digit"
            )
        if tenant == OPEN_TENANT:
            raise ValueError(f"tenant name {OPEN_TENANT!r} is reserved for open mode")
        tokens = (tokens,) if isinstance(tokens, str) else tuple(tokens)
        if not tokens:
            raise ValueError(f"tenant {tenant!r} has no token")
        for token in tokens:
            if not isinstance(token, str) or not _TOKEN_RE.match(token):
                raise ValueError(
                    f"a token of tenant {tenant!r} has characters a bearer token cannot have"
                )
            if len(token) < MIN_TOKEN_CHARS:
                raise ValueError(
                    f"a token of tenant {tenant!r} has {len(token)} characters; use at least"
                    f" {MIN_TOKEN_CHARS} (python -c 'import secrets; print(secrets.token_hex())')"
                )
            if owner.setdefault(token, tenant) != tenant:
                raise ValueError(f"one token is given to tenants {owner[token]!r} and {tenant!r}")
        out[tenant] = tokens
    return MappingProxyType(out)


def parse_tenants(text: str) -> dict[str, list[str]]:
    """Parse ``"alice:<token>,bob:<token>,alice:<second token>"``.

    Args:
        text: comma-separated ``tenant:token`` pairs.

    Returns:
        tenant -> tokens.
    """
    out: dict[str, list[str]] = {}
    for n, item in enumerate(filter(None, (part.strip() for part in text.split(","))), 1):
        tenant, sep, token = item.partition(":")
        if not sep or not tenant or not token:
            # Not the entry itself: without its ':' it may be a whole token.
            raise ValueError(f"entry {n} is not 'tenant:token'")
        out.setdefault(tenant.strip(), []).append(token.strip())
    return out


def parse_names(text: str) -> tuple[str, ...]:
    """Parse ``"ops,audit"`` (``admin_tenants`` as text).

    Args:
        text: comma-separated tenant names.

    Returns:
        The names.
    """
    return tuple(name.strip() for name in text.split(",") if name.strip())


def parse_weights(text: str) -> dict[str, float]:
    """Parse ``"alice:2,bob:0.5"`` (``tenant_weights`` as text).

    Args:
        text: comma-separated ``tenant:weight`` pairs.

    Returns:
        tenant -> weight (``checked_weights`` checks them).
    """
    out: dict[str, float] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        tenant, _, weight = item.partition(":")
        try:
            out[tenant.strip()] = float(weight)
        except ValueError:
            raise ValueError(f"{item!r} is not 'tenant:weight'") from None
    return out


def check_tenants(config: ServerConfig) -> None:
    """Freeze the tenants, their weights and the admin tenants, and check they agree."""
    tenants, weights = split_weights(config.tenants, config.tenant_weights)
    object.__setattr__(config, "tenants", frozen_tenants(tenants))
    object.__setattr__(config, "tenant_weights", checked_weights(weights, config.tenants))
    object.__setattr__(config, "admin_tenants", tuple(config.admin_tenants))
    for tenant in config.admin_tenants:
        if tenant not in config.tenants:
            raise ValueError(f"admin tenant {tenant!r} is not one of the configured tenants")
    if not config.tenants and not config.open_mode:
        raise ValueError(
            "no tenants are configured: give tenants and their tokens (CACHETIER_TENANTS="
            "'name:token,...' or a [tenants] table), or set open_mode for local development"
        )
