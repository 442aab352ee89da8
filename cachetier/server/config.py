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
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from cachetier.kvevents.config import check_endpoint
from cachetier.server.events_config import kv_events_publisher
from cachetier.server.tenants_config import (
    OPEN_TENANT,
    check_tenants,
    parse_names,
    parse_tenants,
    parse_weights,
)
from cachetier.store.config import GiB, StoreConfig, default_data_dir
from cachetier.util.checks import positive_int
from cachetier.util.redact import redact_url, redacted_repr, url_secrets
from cachetier.util.settings import (
    build,
    env_values,
    flat_settings,
    nested,
    parse_settings,
    setting,
)

MiB = 1 << 20
__all__ = ["OPEN_TENANT", "ServerConfig", "load_config", "parse_tenants", "secrets_of"]
_LOG_LEVELS = ("critical", "error", "warning", "info", "debug")


@dataclass(frozen=True, slots=True)
class ServerConfig:
    """The sidecar's settings: where it listens, what it stores, whom it serves, its limits.

    Each field's description is declared with it (``cachetier.util.settings.setting``). The
    tiers are ``store``, whose settings are given by their own names beside these
    (``redis_url = ...`` in the file, ``CACHETIER_REDIS_URL``, ``--redis-url``).
    """

    host: str = setting("127.0.0.1", "address to listen on.")
    port: int = setting(8470, "TCP port to listen on (0 picks a free one).")
    data_dir: str = setting(
        default_factory=lambda: str(default_data_dir() / "server"),
        description="folder of the server's disk tier (``<data_dir>/blocks``, unless "
        "``disk_path`` names another) and of its pins (``<data_dir>/pins.json``); default "
        "``$CACHETIER_HOME/server`` or ``~/.cache/cachetier/server``.",
    )
    store: StoreConfig = nested(
        StoreConfig,
        "the server's tiers: every store setting, given by its own name; the disk tier and the "
        "pins default to files under ``data_dir``.",
    )
    sync_puts: bool = setting(
        True,
        "answer a put once every tier holds the block, so an acknowledged block survives a "
        "crash of the server; ``False`` answers once the first tier has it and writes the "
        "others in the background (faster; a full write queue drops blocks).",
    )
    tenants: Mapping[str, tuple[str, ...]] = setting(
        default_factory=dict,
        description="tenant name -> its bearer tokens (1-32 characters of ``[A-Za-z0-9_-]``; "
        "tokens of at least 16 characters). A ``[tenants]`` table in the file, or "
        "``CACHETIER_TENANTS='alice:<token>,bob:<token>'``.",
        secret=True,
        parse=parse_tenants,
    )
    admin_tenants: tuple[str, ...] = setting(
        (),
        "tenants that may see every tenant's stats and ``/metrics`` (text: comma-separated).",
        parse=parse_names,
    )
    open_mode: bool = setting(
        False,
        "accept requests without a token as tenant ``open`` (local development only).",
    )
    tenant_weights: Mapping[str, float] = setting(
        default_factory=dict,
        description="tenant -> weight (> 0; 1 for a tenant not named): each tenant's "
        "guaranteed share of the transfer port's connections, the upload bytes in flight and "
        "``max_request_rate`` is in proportion to its weight, and it may borrow what the "
        "others leave idle (``server.fairness``). Also given in the tenants table as "
        '``alice = {tokens = ["..."], weight = 2}``; as text, ``alice:2,bob:1``.',
        parse=parse_weights,
    )
    max_request_rate: float | None = setting(
        5000.0,
        "requests per second of all tenants together, HTTP and the transfer port alike, shared "
        "by ``tenant_weights``; past its share a tenant is answered 429 with ``Retry-After`` "
        "(``BUSY`` on the transfer port). ``None`` for no limit.",
    )
    max_concurrent_requests: int | None = setting(
        None,
        "requests that work at once (``server.scheduling``); the others wait in their "
        "tenant's queue, and the tenant served least per weight goes next. Once a tenant's "
        "oldest queued request has waited a second, one whose queue would wait longer at its "
        "share of the measured capacity is answered 429 with ``Retry-After``. ``None``: the "
        "number of CPUs, at least 2.",
    )
    quarantine_quota: int = setting(
        64,
        "most namespaces (or writers of one) each tenant may hold quarantined by its reports "
        "at once, in every tier; past it a report is answered 429 ``quarantine_quota`` until "
        "an operator lifts one of that tenant's. A tenant's reports never take another's "
        "places.",
    )
    max_block_bytes: int = setting(64 * MiB, "largest record accepted.")
    max_batch_bytes: int = setting(512 * MiB, "largest batch body accepted.")
    max_batch_blocks: int = setting(
        1024, "most records in a batch put and most keys in a batch get."
    )
    max_keys: int = setting(4096, "most keys in a lookup, exists or delete request.")
    transfer_port: int | None = setting(
        None,
        "TCP port of the block transfer protocol (``server.transfer``: batch gets and puts "
        "without HTTP, on ``host``), 0 for a free one, ``None`` for none. It speaks TLS with "
        "``tls_cert`` as HTTP does; without them both are plaintext, tokens in the clear: keep "
        "them on the pod or node network.",
    )
    transfer_socket: str | None = setting(
        None,
        "Unix socket path the block transfer protocol also listens on, for engines on the same "
        "host (share its folder with their pods); ``None`` for none.",
    )
    kv_events: str | None = setting(
        None,
        "ZMQ endpoint (``tcp://host:port``; port 0 for a free one, logged) where the server "
        "publishes the blocks its last tier holds as KV events (vLLM's wire format), under "
        "replica ``*`` and medium ``remote``: every engine reading this server can load them "
        "(``cachetier route --shared-events``). ``None`` publishes none.",
    )
    kv_events_replay: str | None = setting(
        None, "ZMQ endpoint answering replay requests for ``kv_events``; ``None`` for none."
    )
    kv_events_curve_key: str | None = setting(
        None,
        "CURVE certificate of ``kv_events`` with its secret key (``zmq.auth``'s "
        "``.key_secret``; ``cachetier kv-events-keys`` makes it). With "
        "``kv_events_curve_clients``, only readers whose public key is listed there receive "
        "anything, and ``kv_events`` may bind beyond loopback (without them it may not).",
    )
    kv_events_curve_clients: str | None = setting(
        None, "folder of the public certificates (``*.key``) allowed to read ``kv_events``."
    )
    transfer_connections: int = setting(
        64, "most transfer connections served at once (after their hello)."
    )
    transfer_unauthenticated_connections: int = setting(
        8,
        "most transfer connections held before their hello has named a tenant; a new one "
        "beyond it drops the oldest, so connections that never say who they are cannot keep "
        "known clients out.",
    )
    transfer_hello_timeout_s: float = setting(
        5.0,
        "the whole hello of a transfer connection (TLS included) must arrive within this many "
        "seconds of its accept.",
    )
    head_timeout_s: float = setting(
        10.0,
        "an HTTP request's whole head must arrive within this many seconds (of the "
        "connection's start for its first request, of its first byte for later ones).",
    )
    body_timeout_s: float = setting(
        60.0,
        "an HTTP request's whole body must arrive within this many seconds of its head; also "
        "the longest an answer may wait for a client that does not read it. The transfer "
        "port's requests get the same two deadlines (head; records and answer).",
    )
    idle_timeout_s: float = setting(
        75.0,
        "an HTTP or transfer connection with no request for this many seconds is closed.",
    )
    max_head_bytes: int = setting(32 << 10, "largest HTTP request head (request line and headers).")
    max_connections: int | None = setting(
        None,
        "most HTTP connections open at once; past it a new connection takes the place of the "
        "oldest one without a valid token, or is closed at once. ``None`` derives it from the "
        "descriptor limit (``RLIMIT_NOFILE``, whose soft limit the server raises to the hard "
        "one at start): all of it but an eighth (at least 64) and two per transfer connection.",
    )
    max_unauthenticated_connections: int | None = setting(
        None,
        "most HTTP connections open that have not yet shown a valid token (TLS handshakes "
        "included); past it the oldest of them is closed. ``None``: a quarter of "
        "``max_connections``.",
    )
    unauthenticated_timeout_s: float = setting(
        5.0,
        "an HTTP connection that has shown no valid token this many seconds after its accept "
        "is closed, kept alive or not (health checks and limits need none, and get a fresh "
        "connection each).",
    )
    tls_handshake_timeout_s: float = setting(
        5.0,
        "with TLS, an HTTP connection's whole handshake must be done within this many seconds "
        "of its accept.",
    )
    max_tls_handshakes: int = setting(
        128,
        "most HTTPS handshakes in progress at once (each holds a few hundred KiB of buffers); "
        "past it the oldest is dropped.",
    )
    max_inflight_bytes: int = setting(
        1 * GiB,
        "most bytes of uploads held at once, all requests together (bodies and decompressed "
        "payloads being checked); over it a request is answered busy (503, ``BUSY``). At least "
        "``max_batch_bytes``.",
    )
    tls_cert: str | None = setting(
        None,
        "PEM certificate chain of HTTPS and the TCP transfer port (the Unix socket stays "
        "plaintext); ``None`` serves plain HTTP. Needs ``tls_key``.",
    )
    tls_key: str | None = setting(None, "PEM private key of ``tls_cert``.")
    log_level: str = setting("info", f"uvicorn's log level: one of {', '.join(_LOG_LEVELS)}.")

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
        if self.kv_events is not None:
            check_endpoint("kv_events", self.kv_events)
        if self.kv_events_replay is not None:
            if self.kv_events is None:
                raise ValueError("kv_events_replay needs kv_events (the events it replays)")
            check_endpoint("kv_events_replay", self.kv_events_replay)
        kv_events_publisher(  # the publisher's own checks: keys in pairs, exposure
            self.kv_events,
            self.kv_events_replay,
            self.kv_events_curve_key,
            self.kv_events_curve_clients,
        )
        check_tenants(self)
        if not isinstance(self.store, StoreConfig):
            raise TypeError(f"store must be a StoreConfig, got {type(self.store).__name__}")
        # The disk tier and the pins live under data_dir unless the store names other files.
        under = {
            k: v for k, v in _data_dir_files(self.data_dir).items() if not getattr(self.store, k)
        }
        if under:
            object.__setattr__(self, "store", replace(self.store, **under))

    @classmethod
    def from_flat(cls, values: Mapping[str, Any], *, source: str = "settings") -> ServerConfig:
        """The config from settings given by name, the store's among them.

        Args:
            values: setting name -> value (text or Python values), e.g.
                ``{"port": 0, "redis_url": "redis://127.0.0.1:6379/0", "open_mode": True}``.
            source: where they were given, for errors.

        Returns:
            The validated config.

        Raises:
            ValueError: an unknown name or a bad value, named.
        """
        parsed = parse_settings(cls, values, source=source)
        data_dir = parsed.get("data_dir") or cls.__dataclass_fields__["data_dir"].default_factory()
        parsed["data_dir"] = data_dir
        for name, path in _data_dir_files(data_dir).items():
            if not parsed.get(name):  # the store's own check needs its disk tier named
                parsed[name] = path
        return build(cls, parsed)

    @property
    def tls(self) -> bool:
        """Whether HTTP and the TCP transfer port speak TLS."""
        return self.tls_cert is not None

    def describe(self) -> dict[str, Any]:
        """The settings by name, as plain data, with every token replaced by a count and the
        Redis password masked (safe to print)."""
        out = {}
        for name, item in SETTINGS.items():
            holder: Any = self
            for part in item.path:  # the nested configs that hold it, outermost first
                holder = getattr(holder, part)
            out[name] = getattr(holder, name)
        out["redis_url"] = self.store.redis_url and redact_url(self.store.redis_url)
        out["remote_token"] = self.store.remote_token and "***"
        out["admin_tenants"] = list(self.admin_tenants)
        out["tenant_weights"] = dict(self.tenant_weights)
        out["tenants"] = {name: f"{len(tokens)} token(s)" for name, tokens in self.tenants.items()}
        return out


SETTINGS = flat_settings(ServerConfig)
"""Every setting of the server by name, the store's among them (two of one name fail here)."""


def _data_dir_files(data_dir: str) -> dict[str, str]:
    return {
        "disk_path": str(Path(data_dir) / "blocks"),
        "pin_file": str(Path(data_dir) / "pins.json"),
    }


def secrets_of(config: ServerConfig) -> list[str]:
    """What the server must never print: every tenant's tokens, the Redis password and the
    token of a sidecar behind it.

    Args:
        config: the server's settings.

    Returns:
        The secrets (for ``cachetier.util.redact``).
    """
    tokens = [token for tokens in config.tenants.values() for token in tokens]
    remote = [config.store.remote_token] if config.store.remote_token else []
    return tokens + remote + url_secrets(config.store.redis_url)


def read_config_file(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Settings from a file.

    Args:
        path: a ``.toml`` or ``.json`` file whose keys are setting names (``SETTINGS``).

    Returns:
        setting name -> parsed value (``ServerConfig`` checks them together).

    Raises:
        ValueError: not a table, an unknown key or a value its setting cannot take, named.
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
    return parse_settings(ServerConfig, data, source=f"config file {path}")


def load_config(
    path: str | os.PathLike[str] | None = None,
    env: Mapping[str, str] | None = None,
    **overrides: Any,
) -> ServerConfig:
    """Build the server's config from a file, the environment and explicit values.

    Args:
        path: a ``.toml`` or ``.json`` file, or ``None``.
        env: the environment (default ``os.environ``); ``CACHETIER_<NAME>`` sets a setting
            (``CACHETIER_TENANTS`` is ``tenant:token`` pairs, ``CACHETIER_ADMIN_TENANTS`` a
            comma-separated list, ``CACHETIER_TENANT_WEIGHTS`` ``tenant:weight`` pairs).
        overrides: settings that win over both (``None`` values are ignored): the CLI's flags.

    Returns:
        The validated config.
    """
    env = os.environ if env is None else env
    values: dict[str, Any] = read_config_file(path) if path else {}
    values.update(env_values(ServerConfig, env))
    given = {k: v for k, v in overrides.items() if v is not None}
    values.update(parse_settings(ServerConfig, given, source="arguments"))
    return ServerConfig.from_flat(values)


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
    "max_tls_handshakes",
    "quarantine_quota",
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
    for name in ("max_connections", "max_unauthenticated_connections", "max_concurrent_requests"):
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
    if config.max_batch_bytes < config.max_block_bytes:
        raise ValueError("max_batch_bytes must be at least max_block_bytes")
    rate = config.max_request_rate
    if rate is not None and (
        isinstance(rate, bool) or not isinstance(rate, (int, float)) or not rate > 0
    ):
        raise ValueError(f"max_request_rate must be a positive number or None, got {rate!r}")
