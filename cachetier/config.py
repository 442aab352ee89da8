"""The store's configuration, and the one place that turns it into tiers."""

from __future__ import annotations

import os
from collections.abc import Container, Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path

from cachetier.store import TieredStore
from cachetier.tiers.base import Tier
from cachetier.tiers.cpu import CPUTier, CPUTierConfig
from cachetier.tiers.disk import DiskTier, DiskTierConfig

GiB = 1 << 30
ENV_PREFIX = "CACHETIER_"


def default_data_dir() -> Path:
    """Where blocks go when no folder is given: ``$CACHETIER_HOME`` or ``~/.cache/cachetier``."""
    return Path(os.environ.get("CACHETIER_HOME", Path.home() / ".cache" / "cachetier"))


@dataclass(frozen=True, slots=True)
class StoreConfig:
    """Which tiers a store stacks, fastest first: CPU, then disk, then Redis, then the sidecar.

    Args:
        cpu_bytes: CPU tier capacity; 0 leaves the CPU tier out.
        disk_path: disk tier folder; ``None`` or ``""`` leaves the disk tier out.
        disk_bytes: disk tier capacity.
        redis_url: Redis URL (``redis://host:port/db``); ``None`` leaves Redis out.
        redis_ttl_s: expiry of blocks in Redis, ``None`` for none.
        redis_key_prefix: first part of every Redis key (tests and tenants of one Redis use
            their own).
        compression: ``"none"`` or ``"lz4"`` for the disk and Redis records.
        policy: eviction policy of the CPU and disk tiers.
        write_queue_blocks: most blocks queued per lower tier before puts are dropped.
        fsync: fsync disk records before they are renamed into place.
        remote_url: base URL of a cachetier server (``http://host:port``); ``None`` leaves the
            remote tier out.
        remote_token: bearer token for the server (it names the tenant); ``None`` for a server
            in open mode.
    """

    cpu_bytes: int = 2 * GiB
    disk_path: str | None = None
    disk_bytes: int = 20 * GiB
    redis_url: str | None = None
    redis_ttl_s: float | None = None
    redis_key_prefix: str = "cachetier"
    compression: str = "none"
    policy: str = "lru"
    write_queue_blocks: int = 4096
    fsync: bool = True
    remote_url: str | None = None
    remote_token: str | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.cpu_bytes < 0 or self.disk_bytes <= 0:
            raise ValueError("cpu_bytes must be >= 0 and disk_bytes > 0")
        if self.compression not in ("none", "lz4"):
            raise ValueError(f"compression must be 'none' or 'lz4', got {self.compression!r}")
        if not (self.cpu_bytes or self.disk_path or self.redis_url or self.remote_url):
            raise ValueError(
                "a store needs at least one tier: set cpu_bytes, disk_path, redis_url or remote_url"
            )
        if self.remote_token and not self.remote_url:
            raise ValueError("remote_token is set without remote_url: name the server too")

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
        tiers.append(CPUTier(CPUTierConfig(config.cpu_bytes, policy=config.policy)))
    if config.disk_path:
        tiers.append(
            DiskTier(
                DiskTierConfig(
                    root=config.disk_path,
                    capacity_bytes=config.disk_bytes,
                    policy=config.policy,
                    compression=config.compression,
                    fsync=config.fsync,
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
                    compression=config.compression,
                )
            )
        )
    if config.remote_url:
        # Imported here: the remote tier needs aiohttp, which a store without one does not.
        from cachetier.tiers.remote import RemoteTier, RemoteTierConfig

        tiers.append(RemoteTier(RemoteTierConfig(url=config.remote_url, token=config.remote_token)))
    return tiers


def build_store(config: StoreConfig) -> TieredStore:
    """A ``TieredStore`` over the tiers ``config`` names.

    Args:
        config: the store configuration.

    Returns:
        The store; close it (or use it as a context manager) to flush and release the tiers.
    """
    return TieredStore(build_tiers(config), write_queue_blocks=config.write_queue_blocks)
