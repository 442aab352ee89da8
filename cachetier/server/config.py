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
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from cachetier.server.tenants_config import OPEN_TENANT, check_tenants, parse_tenants
from cachetier.store.config import (
    ENV_PREFIX,
    REDIS_TIMEOUT_S,
    GiB,
    StoreConfig,
    default_data_dir,
    env_values,
)
from cachetier.tiers.disk.config import DEFAULT_DIR_MODE, DEFAULT_FILE_MODE
from cachetier.util.checks import positive_int
from cachetier.util.redact import redact_url, redacted_repr, url_secrets

MiB = 1 << 20
__all__ = ["OPEN_TENANT", "ServerConfig", "load_config", "parse_tenants", "secrets_of"]
_LOG_LEVELS = ("critical", "error", "warning", "info", "debug")


@dataclass(frozen=True, slots=True)
class ServerConfig:
    """The sidecar's settings: where it listens, what it stores, whom it serves, its limits.

    Args:
        host: address to listen on.
        port: TCP port to listen on (0 picks a free one).
        data_dir: folder of the disk tier (``<data_dir>/blocks``).
        cpu_bytes: capacity of the server's CPU tier; 0 leaves it out.
        disk_bytes: capacity of the disk tier; 0 leaves it out.
        disk_file_mode: permission bits of the disk tier's record files (``0o600``: this user
            only; ``0o640`` lets the pods of one group read them; ``CACHETIER_DISK_FILE_MODE`` is
            read as octal, ``0640``).
        disk_dir_mode: permission bits of the disk tier's folders (``0o700``, or ``0o750``).
        redis_url: Redis behind the server (``redis://host:port/db``, ``rediss://`` for TLS);
            ``None`` for none. Its password is never printed (repr, ``describe``, logs).
        redis_ssl_ca_certs: CA bundle the Redis certificate is checked against (``rediss://``).
        redis_ssl_certfile: client certificate for a Redis that asks for one (``rediss://``).
        redis_ssl_keyfile: private key of ``redis_ssl_certfile``.
        redis_key_prefix: first part of every Redis key the server writes.
        redis_ttl_s: expiry of blocks in Redis, ``None`` for none.
        redis_timeout_s: longest wait for Redis to answer one read or write (seconds); a read
            that waits longer is a miss. Raise it for a Redis across a thin link.
        redis_bytes: most record bytes kept in Redis under ``redis_key_prefix`` (an exact LRU
            shared by every server using the prefix; single-node Redis only, and needed for
            pins in Redis); ``None`` leaves the bound to Redis's ``maxmemory`` policy.
        compression: ``"none"`` or ``"lz4"`` for records on disk and in Redis.
        fsync: fsync each disk record before it is renamed into place.
        sync_puts: answer a put once every tier holds the block, so an acknowledged block
            survives a crash of the server; ``False`` answers once the first tier has it and
            writes the others in the background (faster; a full write queue drops blocks).
        tenants: tenant name -> its bearer tokens (1-32 characters of ``[A-Za-z0-9_-]``; tokens
            of at least 16 characters).
        admin_tenants: tenants that may see every tenant's stats and ``/metrics``.
        open_mode: accept requests without a token as tenant ``open`` (local development only).
        tenant_weights: tenant -> weight (> 0; 1 for a tenant not named): each tenant's
            guaranteed share of the transfer port's connections, the upload bytes in flight
            and ``max_request_rate`` is in proportion to its weight, and it may borrow what
            the others leave idle (``server.fairness``). Also given in the tenants table as
            ``alice = {tokens = ["..."], weight = 2}``.
        max_request_rate: requests per second of all tenants together, HTTP and the transfer
            port alike, shared by ``tenant_weights``; past its share a tenant is answered 429
            with ``Retry-After`` (``BUSY`` on the transfer port). ``None`` for no limit.
        max_block_bytes: largest record accepted.
        max_batch_bytes: largest batch body accepted.
        max_batch_blocks: most records in a batch put and most keys in a batch get.
        max_keys: most keys in a lookup, exists or delete request.
        transfer_port: TCP port of the block transfer protocol (``server.transfer``: batch gets
            and puts without HTTP, on ``host``), 0 for a free one, ``None`` for none. It speaks
            TLS with ``tls_cert`` as HTTP does; without them both are plaintext, tokens in the
            clear: keep them on the pod or node network.
        transfer_socket: Unix socket path the block transfer protocol also listens on, for engines
            on the same host (share its folder with their pods); ``None`` for none.
        transfer_connections: most transfer connections served at once (after their hello).
        transfer_unauthenticated_connections: most transfer connections held before their hello
            has named a tenant; a new one beyond it drops the oldest, so connections that never
            say who they are cannot keep known clients out.
        transfer_hello_timeout_s: the whole hello of a transfer connection (TLS included) must
            arrive within this many seconds of its accept.
        head_timeout_s: an HTTP request's whole head must arrive within this many seconds (of
            the connection's start for its first request, of its first byte for later ones).
        body_timeout_s: an HTTP request's whole body must arrive within this many seconds of its
            head; also the longest an answer may wait for a client that does not read it. The
            transfer port's requests get the same two deadlines (head; records and answer).
        idle_timeout_s: an HTTP or transfer connection with no request for this many seconds is
            closed.
        max_head_bytes: largest HTTP request head (request line and headers).
        max_connections: most HTTP connections open at once; past it a new connection takes
            the place of the oldest one without a valid token, or is closed at once. ``None``
            derives it from the descriptor limit (``RLIMIT_NOFILE``, whose soft limit the server
            raises to the hard one at start): all of it but an eighth (at least 64) and two per
            transfer connection.
        max_unauthenticated_connections: most HTTP connections open that have not yet shown a
            valid token (TLS handshakes included); past it the oldest of them is closed.
            ``None``: a quarter of ``max_connections``.
        unauthenticated_timeout_s: an HTTP connection that has shown no valid token this many
            seconds after its accept is closed, kept alive or not (health checks and limits
            need none, and get a fresh connection each).
        tls_handshake_timeout_s: with TLS, an HTTP connection's whole handshake must be done
            within this many seconds of its accept.
        max_tls_handshakes: most HTTPS handshakes in progress at once (each holds a few hundred
            KiB of buffers); past it the oldest is dropped.
        max_inflight_bytes: most bytes of uploads held at once, all requests together (bodies
            and decompressed payloads being checked); over it a request is answered busy (503,
            ``BUSY``). At least ``max_batch_bytes``.
        write_queue_bytes: most bytes queued for each lower tier (with ``sync_puts`` off) before
            puts to it are dropped.
        tls_cert: PEM certificate chain of HTTPS and the TCP transfer port (the Unix socket
            stays plaintext); ``None`` serves plain HTTP. Needs ``tls_key``.
        tls_key: PEM private key of ``tls_cert``.
        log_level: uvicorn's log level.
        max_pinned_fraction: share of the CPU, disk and Redis (with ``redis_bytes``) tiers'
            capacity pinned blocks may hold (``POST /v1/pins``), in [0, 1); pins are kept in
            ``<data_dir>/pins.json`` (and in Redis itself for the Redis tier).
    """

    host: str = "127.0.0.1"
    port: int = 8470
    data_dir: str = field(default_factory=lambda: str(default_data_dir() / "server"))
    cpu_bytes: int = 2 * GiB
    disk_bytes: int = 20 * GiB
    disk_file_mode: int = DEFAULT_FILE_MODE
    disk_dir_mode: int = DEFAULT_DIR_MODE
    redis_url: str | None = None
    redis_ssl_ca_certs: str | None = None
    redis_ssl_certfile: str | None = None
    redis_ssl_keyfile: str | None = None
    redis_key_prefix: str = "cachetier"
    redis_ttl_s: float | None = None
    redis_timeout_s: float = REDIS_TIMEOUT_S
    redis_bytes: int | None = None
    compression: str = "none"
    fsync: bool = True
    sync_puts: bool = True
    tenants: Mapping[str, tuple[str, ...]] = field(default_factory=dict, repr=False)
    admin_tenants: tuple[str, ...] = ()
    open_mode: bool = False
    tenant_weights: Mapping[str, float] = field(default_factory=dict)
    max_request_rate: float | None = 5000.0
    max_block_bytes: int = 64 * MiB
    max_batch_bytes: int = 512 * MiB
    max_batch_blocks: int = 1024
    max_keys: int = 4096
    transfer_port: int | None = None
    transfer_socket: str | None = None
    transfer_connections: int = 64
    transfer_unauthenticated_connections: int = 8
    transfer_hello_timeout_s: float = 5.0
    head_timeout_s: float = 10.0
    body_timeout_s: float = 60.0
    idle_timeout_s: float = 75.0
    max_head_bytes: int = 32 << 10
    max_connections: int | None = None
    max_unauthenticated_connections: int | None = None
    unauthenticated_timeout_s: float = 5.0
    tls_handshake_timeout_s: float = 5.0
    max_tls_handshakes: int = 128
    max_inflight_bytes: int = 1 * GiB
    write_queue_bytes: int = 1 * GiB
    tls_cert: str | None = None
    tls_key: str | None = None
    log_level: str = "info"
    max_pinned_fraction: float = 0.5

    def __repr__(self) -> str:
        return redacted_repr(self)

    def __post_init__(self) -> None:
        _check_listeners(self)
        _check_limits(self)
        for name in ("tls_cert", "tls_key"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"{name} must be a file path or None, got {value!r}")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("tls_cert and tls_key go together: give both for TLS, or neither")
        if self.log_level not in _LOG_LEVELS:
            raise ValueError(f"log_level must be one of {_LOG_LEVELS}, got {self.log_level!r}")
        check_tenants(self)
        self.store_config()  # raises ValueError on bad sizes, compression or no tier at all
        if self.redis_url:
            from cachetier.tiers.redis import RedisTierConfig

            # Raises ValueError on a bad URL, prefix or TTL now rather than at start-up.
            RedisTierConfig(
                url=self.redis_url,
                key_prefix=self.redis_key_prefix,
                ttl_s=self.redis_ttl_s,
                capacity_bytes=self.redis_bytes,
                ssl_ca_certs=self.redis_ssl_ca_certs,
                ssl_certfile=self.redis_ssl_certfile,
                ssl_keyfile=self.redis_ssl_keyfile,
            )

    @property
    def tls(self) -> bool:
        """Whether HTTP and the TCP transfer port speak TLS."""
        return self.tls_cert is not None

    def store_config(self) -> StoreConfig:
        """The ``StoreConfig`` of the server's tiers (CPU, disk under ``data_dir``, Redis)."""
        return StoreConfig(
            cpu_bytes=self.cpu_bytes,
            disk_path=str(Path(self.data_dir) / "blocks") if self.disk_bytes else None,
            disk_bytes=max(self.disk_bytes, 1),  # unused without disk_path; must be > 0
            disk_file_mode=self.disk_file_mode,
            disk_dir_mode=self.disk_dir_mode,
            redis_url=self.redis_url,
            redis_ttl_s=self.redis_ttl_s,
            redis_timeout_s=self.redis_timeout_s,
            redis_key_prefix=self.redis_key_prefix,
            redis_bytes=self.redis_bytes,
            redis_ssl_ca_certs=self.redis_ssl_ca_certs,
            redis_ssl_certfile=self.redis_ssl_certfile,
            redis_ssl_keyfile=self.redis_ssl_keyfile,
            compression=self.compression,
            fsync=self.fsync,
            write_queue_bytes=self.write_queue_bytes,
            max_pinned_fraction=self.max_pinned_fraction,
            pin_file=str(Path(self.data_dir) / "pins.json"),
        )

    def describe(self) -> dict[str, Any]:
        """The settings as plain data with every token replaced by a count and the Redis
        password masked (safe to print)."""
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "tenants"}
        out["redis_url"] = self.redis_url and redact_url(self.redis_url)
        out["admin_tenants"] = list(self.admin_tenants)
        out["tenant_weights"] = dict(self.tenant_weights)
        out["tenants"] = {name: f"{len(tokens)} token(s)" for name, tokens in self.tenants.items()}
        return out


def secrets_of(config: ServerConfig) -> list[str]:
    """What the server must never print: every tenant's tokens and the Redis password.

    Args:
        config: the server's settings.

    Returns:
        The secrets (for ``cachetier.util.redact``).
    """
    tokens = [token for tokens in config.tenants.values() for token in tokens]
    return tokens + url_secrets(config.redis_url)


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
            ``CACHETIER_TENANTS`` and ``CACHETIER_ADMIN_TENANTS`` take comma-separated lists,
            ``CACHETIER_TENANT_WEIGHTS`` ``tenant:weight`` pairs.
        overrides: field values that win over both (``None`` values are ignored).

    Returns:
        The validated config.
    """
    env = os.environ if env is None else env
    values: dict[str, Any] = read_config_file(path) if path else {}
    values.update(
        env_values(ServerConfig, env, skip=("tenants", "admin_tenants", "tenant_weights"))
    )
    if env.get(ENV_PREFIX + "TENANT_WEIGHTS"):
        pairs = (p.partition(":") for p in env[ENV_PREFIX + "TENANT_WEIGHTS"].split(","))
        try:
            values["tenant_weights"] = {t.strip(): float(w) for t, _, w in pairs if t.strip()}
        except ValueError:
            raise ValueError(f"{ENV_PREFIX}TENANT_WEIGHTS must be 'tenant:weight,...'") from None
    if env.get(ENV_PREFIX + "TENANTS"):
        values["tenants"] = parse_tenants(env[ENV_PREFIX + "TENANTS"])
    if env.get(ENV_PREFIX + "ADMIN_TENANTS") is not None:
        admins = env[ENV_PREFIX + "ADMIN_TENANTS"].split(",")
        values["admin_tenants"] = tuple(a.strip() for a in admins if a.strip())
    values.update({k: v for k, v in overrides.items() if v is not None})
    if "admin_tenants" in values:
        values["admin_tenants"] = tuple(values["admin_tenants"])
    return ServerConfig(**values)


def _check_listeners(config: ServerConfig) -> None:
    """The addresses: ports, the transfer socket's path, the host."""
    if not isinstance(config.port, int) or not 0 <= config.port <= 65535:
        raise ValueError(f"port must be 0-65535, got {config.port!r}")
    port = config.transfer_port
    if port is not None and (
        isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535
    ):
        raise ValueError(f"transfer_port must be 0-65535 or None, got {port!r}")
    if port is not None and port == config.port != 0:
        raise ValueError(f"transfer_port and port are both {config.port}")
    path = config.transfer_socket
    if path is not None and not (isinstance(path, str) and 0 < len(path.encode()) < 108):
        raise ValueError(  # 108: sun_path's size on Linux, terminator included
            f"transfer_socket must be a path of 1-107 bytes or None, got {path!r}"
        )
    if not config.host:
        raise ValueError("host must name an address, e.g. 127.0.0.1")


_POSITIVE_INTS = (
    "max_block_bytes",
    "max_batch_bytes",
    "max_batch_blocks",
    "max_keys",
    "transfer_connections",
    "transfer_unauthenticated_connections",
    "max_head_bytes",
    "max_inflight_bytes",
    "write_queue_bytes",
    "max_tls_handshakes",
)
_POSITIVE_SECONDS = (
    "transfer_hello_timeout_s",
    "head_timeout_s",
    "body_timeout_s",
    "idle_timeout_s",
    "unauthenticated_timeout_s",
    "tls_handshake_timeout_s",
)


def _check_limits(config: ServerConfig) -> None:
    """Sizes, counts, caps and deadlines, and how they must relate."""
    for name in _POSITIVE_INTS:
        positive_int(name, getattr(config, name))
    for name in ("max_connections", "max_unauthenticated_connections"):
        if getattr(config, name) is not None:
            positive_int(name, getattr(config, name))
    if (
        config.max_connections is not None
        and config.max_unauthenticated_connections is not None
        and config.max_unauthenticated_connections > config.max_connections
    ):
        raise ValueError("max_unauthenticated_connections must be at most max_connections")
    for name in _POSITIVE_SECONDS:
        value = getattr(config, name)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")
    if config.max_inflight_bytes < config.max_batch_bytes:
        raise ValueError("max_inflight_bytes must be at least max_batch_bytes")
    if config.disk_bytes < 0:
        raise ValueError(
            f"disk_bytes must be >= 0 (0 leaves the disk tier out), got {config.disk_bytes}"
        )
    if config.max_batch_bytes < config.max_block_bytes:
        raise ValueError("max_batch_bytes must be at least max_block_bytes")
    rate = config.max_request_rate
    if rate is not None and (
        isinstance(rate, bool) or not isinstance(rate, (int, float)) or not rate > 0
    ):
        raise ValueError(f"max_request_rate must be a positive number or None, got {rate!r}")
