"""The server's settings: one frozen dataclass, loaded from a TOML/JSON file and the environment.

Precedence, lowest first: the dataclass defaults, the file, ``CACHETIER_*`` variables, then
what the caller passes (the CLI's flags). Tenants and their tokens::

    # cachetier.toml
    data_dir = "/var/lib/cachetier"
    admin_tenants = ["ops"]
    [tenants]
    alice = ["a-token-of-at-least-16-chars"]
    ops = ["another-long-token-for-prometheus"]

or ``CACHETIER_TENANTS="alice:<token>,ops:<token>"`` and ``CACHETIER_ADMIN_TENANTS="ops"``.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from types import MappingProxyType
from typing import Any

from cachetier.config import ENV_PREFIX, GiB, StoreConfig, default_data_dir, env_values

MiB = 1 << 20
OPEN_TENANT = "open"
"""The tenant every request without a token acts as, in open mode only."""

_TENANT_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,31}$")
# RFC 6750 b64token characters; ':' and ',' stay free to separate the CACHETIER_TENANTS list.
_TOKEN_RE = re.compile(r"^[A-Za-z0-9._~+/-]+=*$")
MIN_TOKEN_CHARS = 16
_LOG_LEVELS = ("critical", "error", "warning", "info", "debug")


@dataclass(frozen=True, slots=True)
class ServerConfig:
    """Args:
    host: address to listen on.
    port: TCP port to listen on (0 picks a free one).
    data_dir: folder of the disk tier (``<data_dir>/blocks``).
    cpu_bytes: capacity of the server's CPU tier; 0 leaves it out.
    disk_bytes: capacity of the disk tier; 0 leaves it out.
    redis_url: Redis behind the server (``redis://host:port/db``); ``None`` for none.
    redis_key_prefix: first part of every Redis key the server writes.
    redis_ttl_s: expiry of blocks in Redis, ``None`` for none.
    compression: ``"none"`` or ``"lz4"`` for records on disk and in Redis.
    fsync: fsync each disk record before it is renamed into place.
    sync_puts: answer a put once every tier holds the block, so an acknowledged block
        survives a crash of the server; ``False`` answers once the first tier has it and
        writes the others in the background (faster; a full write queue drops blocks).
    tenants: tenant name -> its bearer tokens (1-32 characters of ``[A-Za-z0-9_-]``; tokens
        of at least 16 characters).
    admin_tenants: tenants that may see every tenant's stats and ``/metrics``.
    open_mode: accept requests without a token as tenant ``open`` (local development only).
    max_block_bytes: largest record accepted.
    max_batch_bytes: largest batch body accepted.
    max_batch_blocks: most records in a batch put and most keys in a batch get.
    max_keys: most keys in a lookup, exists or delete request.
    transfer_port: TCP port of the block transfer protocol (``server.transfer``: batch gets
        and puts without HTTP, on ``host``), 0 for a free one, ``None`` for none. Plain TCP,
        token in the clear like HTTP here: keep it on the pod or node network.
    transfer_socket: Unix socket path the block transfer protocol also listens on, for engines
        on the same host (share its folder with their pods); ``None`` for none.
    transfer_connections: most transfer connections served at once.
    log_level: uvicorn's log level.
    """

    host: str = "127.0.0.1"
    port: int = 8470
    data_dir: str = field(default_factory=lambda: str(default_data_dir() / "server"))
    cpu_bytes: int = 2 * GiB
    disk_bytes: int = 20 * GiB
    redis_url: str | None = None
    redis_key_prefix: str = "cachetier"
    redis_ttl_s: float | None = None
    compression: str = "none"
    fsync: bool = True
    sync_puts: bool = True
    tenants: Mapping[str, tuple[str, ...]] = field(default_factory=dict, repr=False)
    admin_tenants: tuple[str, ...] = ()
    open_mode: bool = False
    max_block_bytes: int = 64 * MiB
    max_batch_bytes: int = 512 * MiB
    max_batch_blocks: int = 1024
    max_keys: int = 4096
    transfer_port: int | None = None
    transfer_socket: str | None = None
    transfer_connections: int = 64
    log_level: str = "info"

    def __post_init__(self) -> None:
        if not isinstance(self.port, int) or not 0 <= self.port <= 65535:
            raise ValueError(f"port must be 0-65535, got {self.port!r}")
        if self.transfer_port is not None and (
            isinstance(self.transfer_port, bool)
            or not isinstance(self.transfer_port, int)
            or not 0 <= self.transfer_port <= 65535
        ):
            raise ValueError(f"transfer_port must be 0-65535 or None, got {self.transfer_port!r}")
        if self.transfer_port is not None and self.transfer_port == self.port != 0:
            raise ValueError(f"transfer_port and port are both {self.port}")
        if self.transfer_socket is not None and not (
            isinstance(self.transfer_socket, str) and 0 < len(self.transfer_socket.encode()) < 108
        ):
            raise ValueError(  # 108: sun_path's size on Linux, terminator included
                f"transfer_socket must be a path of 1-107 bytes or None, "
                f"got {self.transfer_socket!r}"
            )
        if not self.host:
            raise ValueError("host must name an address, e.g. 127.0.0.1")
        for name in (
            "max_block_bytes",
            "max_batch_bytes",
            "max_batch_blocks",
            "max_keys",
            "transfer_connections",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.disk_bytes < 0:
            raise ValueError(
                f"disk_bytes must be >= 0 (0 leaves the disk tier out), got {self.disk_bytes}"
            )
        if self.max_batch_bytes < self.max_block_bytes:
            raise ValueError("max_batch_bytes must be at least max_block_bytes")
        if self.log_level not in _LOG_LEVELS:
            raise ValueError(f"log_level must be one of {_LOG_LEVELS}, got {self.log_level!r}")
        object.__setattr__(self, "tenants", _frozen_tenants(self.tenants))
        object.__setattr__(self, "admin_tenants", tuple(self.admin_tenants))
        for tenant in self.admin_tenants:
            if tenant not in self.tenants:
                raise ValueError(f"admin tenant {tenant!r} is not one of the configured tenants")
        if not self.tenants and not self.open_mode:
            raise ValueError(
                "no tenants are configured: give tenants and their tokens (CACHETIER_TENANTS="
                "'name:token,...' or a [tenants] table), or set open_mode for local development"
            )
        self.store_config()  # raises ValueError on bad sizes, compression or no tier at all
        if self.redis_url:
            from cachetier.tiers.redis import RedisTierConfig

            # Raises ValueError on a bad URL, prefix or TTL now rather than at start-up.
            RedisTierConfig(
                url=self.redis_url, key_prefix=self.redis_key_prefix, ttl_s=self.redis_ttl_s
            )

    def store_config(self) -> StoreConfig:
        """The ``StoreConfig`` of the server's tiers (CPU, disk under ``data_dir``, Redis)."""
        return StoreConfig(
            cpu_bytes=self.cpu_bytes,
            disk_path=str(Path(self.data_dir) / "blocks") if self.disk_bytes else None,
            disk_bytes=max(self.disk_bytes, 1),  # unused without disk_path; must be > 0
            redis_url=self.redis_url,
            redis_ttl_s=self.redis_ttl_s,
            redis_key_prefix=self.redis_key_prefix,
            compression=self.compression,
            fsync=self.fsync,
        )

    def describe(self) -> dict[str, Any]:
        """The settings as plain data with every token replaced by a count (safe to print)."""
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "tenants"}
        out["admin_tenants"] = list(self.admin_tenants)
        out["tenants"] = {name: f"{len(tokens)} token(s)" for name, tokens in self.tenants.items()}
        return out


def _frozen_tenants(tenants: Mapping[str, Any]) -> Mapping[str, tuple[str, ...]]:
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
    for item in filter(None, (part.strip() for part in text.split(","))):
        tenant, sep, token = item.partition(":")
        if not sep or not tenant or not token:
            raise ValueError(f"{ENV_PREFIX}TENANTS entries are 'tenant:token', got {item[:40]!r}")
        out.setdefault(tenant.strip(), []).append(token.strip())
    return out


def read_config_file(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Settings from a file.

    Args:
        path: a ``.toml`` or ``.json`` file whose keys are ``ServerConfig`` field names.

    Returns:
        field name -> value, unchecked (``ServerConfig`` checks them).
    """
    path = Path(path)
    if path.suffix not in (".json", ".toml"):
        raise ValueError(f"config file {path} must end in .toml or .json")
    text = path.read_text()
    if path.suffix == ".json":
        data = json.loads(text)
    else:
        try:
            import tomllib
        except ModuleNotFoundError:  # Python 3.10
            import tomli as tomllib  # type: ignore[no-redef]
        data = tomllib.loads(text)
    if not isinstance(data, dict):
        raise ValueError(f"config file {path} must hold a table of settings")
    known = {f.name for f in fields(ServerConfig)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ValueError(
            f"config file {path} has unknown settings {unknown}; known: {sorted(known)}"
        )
    return data


def load_config(
    path: str | os.PathLike[str] | None = None,
    env: Mapping[str, str] | None = None,
    **overrides: Any,
) -> ServerConfig:
    """Build the server's config from a file, the environment and explicit values.

    Args:
        path: a ``.toml`` or ``.json`` file, or ``None``.
        env: the environment (default ``os.environ``); ``CACHETIER_<FIELD>`` sets a field,
            ``CACHETIER_TENANTS`` and ``CACHETIER_ADMIN_TENANTS`` take comma-separated lists.
        overrides: field values that win over both (``None`` values are ignored).

    Returns:
        The validated config.
    """
    env = os.environ if env is None else env
    values: dict[str, Any] = read_config_file(path) if path else {}
    values.update(env_values(ServerConfig, env, skip=("tenants", "admin_tenants")))
    if env.get(ENV_PREFIX + "TENANTS"):
        values["tenants"] = parse_tenants(env[ENV_PREFIX + "TENANTS"])
    if env.get(ENV_PREFIX + "ADMIN_TENANTS") is not None:
        admins = env[ENV_PREFIX + "ADMIN_TENANTS"].split(",")
        values["admin_tenants"] = tuple(a.strip() for a in admins if a.strip())
    values.update({k: v for k, v in overrides.items() if v is not None})
    if "admin_tenants" in values:
        values["admin_tenants"] = tuple(values["admin_tenants"])
    return ServerConfig(**values)
