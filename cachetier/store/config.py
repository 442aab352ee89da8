"""The store's configuration, and the one place that turns it into tiers."""

from __future__ import annotations

import os
from collections.abc import Container, Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path

from cachetier.pins.registry import PinRegistry
from cachetier.store.rates_file import RATES_FILE_NAME, RatesFile
from cachetier.store.tiered import TieredStore
from cachetier.tiers.base import Tier
from cachetier.tiers.cpu import CPUTier, CPUTierConfig
from cachetier.tiers.disk.config import DEFAULT_DIR_MODE, DEFAULT_FILE_MODE, check_mode
from cachetier.tiers.disk.tier import DiskTier, DiskTierConfig
from cachetier.util.checks import fraction
from cachetier.util.redact import redacted_repr

GiB = 1 << 30
ENV_PREFIX = "CACHETIER_"


def default_data_dir() -> Path:
    """Where blocks go when no folder is given: ``$CACHETIER_HOME`` or ``~/.cache/cachetier``."""
    return Path(os.environ.get("CACHETIER_HOME", Path.home() / ".cache" / "cachetier"))


# Longest wait for Redis to answer one read or write, by default (seconds).
REDIS_TIMEOUT_S = 0.5


@dataclass(frozen=True, slots=True)
class StoreConfig:
    """Which tiers a store stacks, fastest first: CPU, then disk, then Redis, then the sidecar.

    Args:
        cpu_bytes: CPU tier capacity; 0 leaves the CPU tier out.
        disk_path: disk tier folder; ``None`` or ``""`` leaves the disk tier out.
        disk_bytes: disk tier capacity (shared by every process that opens ``disk_path``).
        disk_file_mode: permission bits of the disk tier's files (``CACHETIER_DISK_FILE_MODE``
            is read as octal, e.g. ``0640`` to let the pods of one group read them).
        disk_dir_mode: permission bits of the disk tier's folders (e.g. ``0750``).
        redis_url: Redis URL (``redis://host:port/db``); ``None`` leaves Redis out.
        redis_ttl_s: expiry of blocks in Redis, ``None`` for none.
        redis_key_prefix: first part of every Redis key (tests and tenants of one Redis use
            their own).
        redis_timeout_s: longest wait for Redis to answer one read or write, and for a
            connection (seconds). Raise it for a Redis across a thin or congested link: a read
            that waits longer is a miss (the block is recomputed).
        redis_bytes: most record bytes the Redis tier keeps under ``redis_key_prefix`` (its
            exact LRU, shared by every process using the prefix; single-node Redis only);
            ``None`` leaves the bound to Redis's ``maxmemory`` policy, and pins out of Redis.
        compression: ``"none"`` or ``"lz4"`` for the disk and Redis records.
        policy: eviction policy of the CPU and disk tiers.
        write_queue_blocks: most blocks queued per lower tier before puts are dropped.
        write_queue_bytes: most bytes queued per lower tier before puts are dropped; ``None``
            for no limit but ``write_queue_blocks``.
        fsync: fsync disk records before they are renamed into place.
        writer_nice: CPU priority of the background writes to lower tiers, 0 (the process's)
            to 19 (the lowest, the default: they use the cores the engine leaves idle).
        remote_url: base URL of a cachetier server (``http://host:port``); ``None`` leaves the
            remote tier out.
        remote_token: bearer token for the server (it names the tenant); ``None`` for a server
            in open mode.
        redis_ssl_ca_certs: CA bundle Redis's certificate is checked against (``rediss://``
            only; ``None``: the system's CAs).
        redis_ssl_certfile: client certificate for a Redis that asks for one.
        redis_ssl_keyfile: private key of ``redis_ssl_certfile``.
        remote_ca_file: CA bundle the server's certificate is checked against (``https://``
            only; ``None``: the system's CAs).
        max_pinned_fraction: share of the CPU, disk and Redis (with ``redis_bytes``) tiers'
            capacity pinned blocks may hold, in [0, 1) (``TieredStore.pin_prefix``).
        pin_file: a JSON file that keeps the store's pins across restarts
            (``cachetier.pins.registry``); ``None`` keeps them in memory only.
    """

    cpu_bytes: int = 2 * GiB
    disk_path: str | None = None
    disk_bytes: int = 20 * GiB
    disk_file_mode: int = DEFAULT_FILE_MODE
    disk_dir_mode: int = DEFAULT_DIR_MODE
    redis_url: str | None = None
    redis_ttl_s: float | None = None
    redis_key_prefix: str = "cachetier"
    redis_bytes: int | None = None
    redis_timeout_s: float = REDIS_TIMEOUT_S
    compression: str = "none"
    policy: str = "lru"
    write_queue_blocks: int = 4096
    write_queue_bytes: int | None = None
    fsync: bool = True
    writer_nice: int = 19
    remote_url: str | None = None
    remote_token: str | None = field(default=None, repr=False)
    redis_ssl_ca_certs: str | None = None
    redis_ssl_certfile: str | None = None
    redis_ssl_keyfile: str | None = None
    remote_ca_file: str | None = None
    max_pinned_fraction: float = 0.5
    pin_file: str | None = None

    def __repr__(self) -> str:
        return redacted_repr(self)

    def __post_init__(self) -> None:
        if self.cpu_bytes < 0 or self.disk_bytes <= 0:
            raise ValueError("cpu_bytes must be >= 0 and disk_bytes > 0")
        check_mode("disk_file_mode", self.disk_file_mode, needs=0o600)
        check_mode("disk_dir_mode", self.disk_dir_mode, needs=0o700)
        if self.compression not in ("none", "lz4"):
            raise ValueError(f"compression must be 'none' or 'lz4', got {self.compression!r}")
        fraction("max_pinned_fraction", self.max_pinned_fraction)
        if not 0 <= self.writer_nice <= 19:
            raise ValueError(f"writer_nice must be in [0, 19], got {self.writer_nice}")
        if not (self.cpu_bytes or self.disk_path or self.redis_url or self.remote_url):
            raise ValueError(
                "a store needs at least one tier: set cpu_bytes, disk_path, redis_url or remote_url"
            )
        if self.remote_token and not self.remote_url:
            raise ValueError("remote_token is set without remote_url: name the server too")
        if self.remote_ca_file and not self.remote_url:
            raise ValueError("remote_ca_file is set without remote_url: name the server too")
        if not self.redis_timeout_s > 0:
            raise ValueError(f"redis_timeout_s must be positive, got {self.redis_timeout_s!r}")
        if self.redis_bytes is not None and not self.redis_url:
            raise ValueError("redis_bytes is set without redis_url: name the Redis too")
        redis_tls = (self.redis_ssl_ca_certs, self.redis_ssl_certfile, self.redis_ssl_keyfile)
        if any(redis_tls) and not self.redis_url:
            raise ValueError("redis_ssl_* settings are set without redis_url: name the Redis too")

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **overrides: object) -> StoreConfig:
        """Read ``CACHETIER_CPU_BYTES``, ``CACHETIER_DISK_PATH``, ... (one per field).

        Args:
            env: the environment to read (default ``os.environ``).
            overrides: field values that win over the environment.

        Returns:
            The config.
        """
        values = env_values(cls, os.environ if env is None else env)
        values.update(overrides)
        return cls(**values)  # type: ignore[arg-type]


def env_values(
    cls: type, env: Mapping[str, str], *, skip: Container[str] = ()
) -> dict[str, object]:
    """Values of a config dataclass's fields given as ``CACHETIER_<FIELD>`` in ``env``.

    Args:
        cls: a dataclass whose fields are ``int``, ``float``, ``bool``, ``str`` or optional ones.
        env: the environment to read.
        skip: field names the caller parses itself.

    Returns:
        field name -> parsed value, for the fields ``env`` sets.
    """
    values: dict[str, object] = {}
    for f in fields(cls):
        raw = env.get(ENV_PREFIX + f.name.upper())
        if raw is None or f.name in skip:
            continue
        values[f.name] = _parse(f.name, raw, str(f.type))
    return values


def _parse(name: str, raw: str, type_name: str) -> object:
    if raw.lower() in ("", "none", "null") and "None" in type_name:
        return None
    if name.endswith("_mode"):  # permission bits are written in octal: 0640, not 640 decimal
        try:
            return int(raw, 8)
        except ValueError:
            raise ValueError(
                f"{ENV_PREFIX}{name.upper()}={raw!r} is not octal permission bits like 0640"
            ) from None
    try:
        if type_name.startswith("int"):
            return int(raw)
        if type_name.startswith("float"):
            return float(raw)
    except ValueError:
        raise ValueError(f"{ENV_PREFIX}{name.upper()}={raw!r} is not a number") from None
    if type_name.startswith("bool"):
        return raw.lower() in ("1", "true", "yes", "on")
    return raw


def build_tiers(config: StoreConfig) -> list[Tier]:
    """The tiers ``config`` names, fastest first (not yet stacked)."""
    tiers: list[Tier] = []
    if config.cpu_bytes:
        tiers.append(
            CPUTier(
                CPUTierConfig(
                    config.cpu_bytes,
                    policy=config.policy,
                    max_pinned_fraction=config.max_pinned_fraction,
                )
            )
        )
    if config.disk_path:
        tiers.append(
            DiskTier(
                DiskTierConfig(
                    root=config.disk_path,
                    capacity_bytes=config.disk_bytes,
                    policy=config.policy,
                    compression=config.compression,
                    fsync=config.fsync,
                    file_mode=config.disk_file_mode,
                    dir_mode=config.disk_dir_mode,
                    max_pinned_fraction=config.max_pinned_fraction,
                )
            )
        )
    if config.redis_url:
        from cachetier.tiers.redis import RedisTier, RedisTierConfig

        tiers.append(
            RedisTier(
                RedisTierConfig(
                    url=config.redis_url,
                    key_prefix=config.redis_key_prefix,
                    ttl_s=config.redis_ttl_s,
                    capacity_bytes=config.redis_bytes,
                    compression=config.compression,
                    ssl_ca_certs=config.redis_ssl_ca_certs,
                    ssl_certfile=config.redis_ssl_certfile,
                    ssl_keyfile=config.redis_ssl_keyfile,
                    max_pinned_fraction=config.max_pinned_fraction,
                    socket_timeout_s=config.redis_timeout_s,
                    connect_timeout_s=config.redis_timeout_s,
                )
            )
        )
    if config.remote_url:
        # Imported here: the remote tier needs aiohttp, which a store without one does not.
        from cachetier.tiers.remote import RemoteTier, RemoteTierConfig

        tiers.append(
            RemoteTier(
                RemoteTierConfig(
                    url=config.remote_url, token=config.remote_token, ca_file=config.remote_ca_file
                )
            )
        )
    return tiers


def build_store(config: StoreConfig) -> TieredStore:
    """A ``TieredStore`` over the tiers ``config`` names.

    Args:
        config: the store configuration.

    Returns:
        The store; close it (or use it as a context manager) to flush and release the tiers.
    """
    registry = None if not config.pin_file else PinRegistry(config.pin_file, config.disk_file_mode)
    tiers = build_tiers(config)
    try:
        return TieredStore(
            tiers,
            write_queue_blocks=config.write_queue_blocks,
            write_queue_bytes=config.write_queue_bytes,
            writer_nice=config.writer_nice,
            pin_registry=registry,
            # The disk tier's measured speed, kept in its folder for the next process.
            rates_file=RatesFile(
                Path(config.disk_path) / RATES_FILE_NAME, "disk", config.disk_file_mode
            )
            if config.disk_path
            else None,
        )
    except BaseException:
        for tier in tiers:  # e.g. an unreadable pin registry: leave no tier open
            tier.close()
        raise
