"""The store's settings, declared once, and the one place that turns them into tiers.

``StoreConfig`` is every store setting: the sidecar (``cachetier.server.config.ServerConfig``)
and the engine plugins (``cachetier.connectors.config.ConnectorConfig``) hold one instead of
declaring its fields again, and read it from their surfaces by the same names
(``cachetier.util.settings``).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cachetier.admission import (
    STATE_FILE_NAME,
    AdmissionConfig,
    AdmissionStateFile,
    make_admission_policy,
)
from cachetier.admission.config import MAX_SAMPLE_KEYS
from cachetier.admission.live_curve import DEFAULT_SAMPLE_KEYS, LiveCurve
from cachetier.misses.token_file import FOLDER_NAME, TokenFiles
from cachetier.pins.registry import PinRegistry
from cachetier.store.namespace_watch import NamespaceWatch
from cachetier.store.rates_file import RATES_FILE_NAME, RatesFile
from cachetier.store.tiered import TieredStore
from cachetier.tiers.base import Tier
from cachetier.tiers.cpu import CPUTier, CPUTierConfig
from cachetier.tiers.disk.config import DEFAULT_DIR_MODE, DEFAULT_FILE_MODE, check_mode
from cachetier.tiers.disk.tier import DiskTier, DiskTierConfig
from cachetier.tiers.eviction import POLICIES
from cachetier.util.checks import fraction, positive_int
from cachetier.util.redact import redacted_repr
from cachetier.util.settings import (
    ENV_PREFIX,
    build,
    env_values,
    nested,
    parse_settings,
    setting,
)

GiB = 1 << 30
__all__ = ["ENV_PREFIX", "GiB", "StoreConfig", "build_store", "build_tiers", "env_values"]


def default_data_dir() -> Path:
    """Where blocks go when no folder is given: ``$CACHETIER_HOME`` or ``~/.cache/cachetier``."""
    return Path(os.environ.get("CACHETIER_HOME", Path.home() / ".cache" / "cachetier"))


def octal(text: str) -> int:
    """Permission bits as written in a shell: ``0640`` (or ``0o640``) is octal, not decimal."""
    try:
        return int(text.strip().removeprefix("0o"), 8)
    except ValueError:
        raise ValueError("not octal permission bits like 0640") from None


@dataclass(frozen=True, slots=True)
class StoreConfig:
    """Which tiers a store stacks, fastest first: CPU, then disk, then Redis, then the sidecar.

    Each field's description is declared with it (``cachetier.util.settings.setting``);
    ``docs/configuration.md`` lists them with their defaults and where each can be given.
    """

    cpu_bytes: int = setting(
        2 * GiB,
        "capacity of the CPU tier, in the process that opens the store (the sidecar, each "
        "engine worker); 0 leaves it out.",
    )
    disk_path: str | None = setting(
        None,
        "folder of the disk tier; it survives restarts, and every process that opens it shares "
        'its capacity. ``None`` or ``""`` leaves it out (the sidecar: ``<data_dir>/blocks``).',
    )
    disk_bytes: int = setting(
        20 * GiB,
        "capacity of the disk tier, for every process that opens ``disk_path`` together (give "
        "them all the same value); 0 leaves the disk tier out.",
    )
    disk_file_mode: int = setting(
        DEFAULT_FILE_MODE,
        "permission bits of the disk tier's files: ``0o600`` this user only, ``0o640`` lets the "
        "pods of one group read them (octal as text too: ``0640``).",
        parse=octal,
    )
    disk_dir_mode: int = setting(
        DEFAULT_DIR_MODE,
        "permission bits of the disk tier's folders (``0o700``, or ``0o750`` beside a "
        "``0o640`` ``disk_file_mode``).",
        parse=octal,
    )
    redis_url: str | None = setting(
        None,
        "a Redis tier: ``redis://host:port/db``, ``rediss://`` for TLS, "
        "``redis+cluster://h1:7000,h2:7001`` for a cluster; ``None`` leaves it out. Its "
        "password is never printed; give one through ``CACHETIER_REDIS_URL`` or a file, not a "
        "flag or an engine's config (both are shown to others).",
    )
    redis_ttl_s: float | None = setting(None, "expiry of blocks in Redis, ``None`` for none.")
    redis_key_prefix: str = setting(
        "cachetier",
        "first part of every Redis key: processes with the same prefix share blocks (tests and "
        "tenants of one Redis use their own).",
    )
    redis_bytes: int | None = setting(
        None,
        "most record bytes the Redis tier keeps under ``redis_key_prefix`` (an exact LRU shared "
        "by every process using the prefix; single-node Redis only, and needed for pins in "
        "Redis); ``None`` leaves the bound to Redis's ``maxmemory`` policy.",
    )
    redis_timeout_s: float = setting(
        0.5,
        "longest wait for Redis to answer one read or write, and for a connection. Raise it "
        "for a Redis across a thin or congested link: a read that waits longer is a miss (the "
        "block is recomputed).",
    )
    redis_ssl_ca_certs: str | None = setting(
        None,
        "CA bundle Redis's certificate is checked against (``rediss://`` only; ``None``: the "
        "system's CAs).",
    )
    redis_ssl_certfile: str | None = setting(
        None, "client certificate for a Redis that asks for one (``rediss://``)."
    )
    redis_ssl_keyfile: str | None = setting(None, "private key of ``redis_ssl_certfile``.")
    remote_url: str | None = setting(
        None,
        "base URL of a cachetier sidecar (``http://host:port``, ``https://`` with TLS), a tier "
        "shared by every process that names it; ``None`` leaves it out.",
    )
    remote_token: str | None = setting(
        None,
        "bearer token for the sidecar (it names the tenant there); ``None`` for a sidecar in "
        "open mode. Engine plugins take it from ``CACHETIER_REMOTE_TOKEN`` only.",
        secret=True,
    )
    remote_ca_file: str | None = setting(
        None,
        "CA bundle the sidecar's certificate is checked against (``https://`` only; ``None``: "
        "the system's CAs).",
    )
    compression: str = setting(
        "none", '``"none"`` or ``"lz4"`` for the records on disk and in Redis.'
    )
    policy: str = setting(
        "lru", f"eviction policy of the CPU and disk tiers: one of {', '.join(POLICIES)}."
    )
    write_queue_blocks: int = setting(
        4096,
        "most blocks queued for each lower tier (disk, Redis, the sidecar) before puts to it "
        "are dropped.",
    )
    write_queue_bytes: int | None = setting(
        1 * GiB,
        "most bytes queued for each lower tier before puts to it are dropped (the sidecar's "
        "with ``sync_puts`` off); ``None`` for no bound but ``write_queue_blocks``.",
    )
    fsync: bool = setting(
        True,
        "fsync each disk record before it is renamed into place (durable across power loss; a "
        "killed process loses nothing either way).",
    )
    writer_nice: int = setting(
        19,
        "CPU priority of the background writes to lower tiers, 0 (the process's) to 19 (the "
        "lowest: they use the cores the engine leaves idle).",
    )
    max_pinned_fraction: float = setting(
        0.5,
        "share of the CPU, disk and Redis (with ``redis_bytes``) tiers' capacity pinned blocks "
        "may hold, in [0, 1) (``TieredStore.pin_prefix``, the sidecar's ``POST /v1/pins``).",
    )
    pin_file: str | None = setting(
        None,
        "a JSON file that keeps the store's pins across restarts (``cachetier.pins.registry``); "
        "``None`` keeps them in memory only (the sidecar: ``<data_dir>/pins.json``).",
    )
    miss_tracked_keys: int = setting(
        1 << 20,
        "keys the store remembers to say why a miss missed: keys let go (evicted, refused, "
        "dropped, corrupt; 16.25 bytes each) and token-only keys of stored blocks "
        "(``namespace_mismatch``; 10.25 bytes each, kept in the disk folder across restarts).",
    )
    mismatch_alarm_share: float = setting(
        0.5,
        "share of recently missed blocks held under another namespace (model, dtype, block "
        "size, format, tenant) above which the store logs once what differs, in [0, 1).",
    )
    live_curve: bool = setting(
        True,
        "keep each tier's capacity curve live: the hit ratio the lookups would have at 0.5, "
        "1, 2 and 4 times its capacity (LRU ghosts on a hashed sample of keys; "
        "``cachetier_tier_hit_ratio_at_capacity``, ``GET /v1/stats``); tiers of unknown "
        "capacity have none. It costs under 1% of a sidecar's lookup, get and put throughput "
        "(``python -m benchmarks.live_curve``).",
    )
    live_curve_sample_keys: int = setting(
        DEFAULT_SAMPLE_KEYS,
        "most block keys the largest (4x) ghost of each tier holds (tiers sampled at one rate "
        "share them; about 260 bytes a key); keys are sampled at the rate that fits 4x the "
        "tier into it.",
    )
    admission: AdmissionConfig = nested(
        AdmissionConfig, "which blocks the tiers below the first write (``cachetier.admission``)."
    )

    def __repr__(self) -> str:
        return redacted_repr(self)

    def __post_init__(self) -> None:
        _check_sizes(self)
        check_mode("disk_file_mode", self.disk_file_mode, needs=0o600)
        check_mode("disk_dir_mode", self.disk_dir_mode, needs=0o700)
        if self.compression not in ("none", "lz4"):
            raise ValueError(f"compression must be 'none' or 'lz4', got {self.compression!r}")
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {sorted(POLICIES)}, got {self.policy!r}")
        fraction("max_pinned_fraction", self.max_pinned_fraction)
        fraction("mismatch_alarm_share", self.mismatch_alarm_share)
        positive_int("miss_tracked_keys", self.miss_tracked_keys)
        positive_int("live_curve_sample_keys", self.live_curve_sample_keys)
        if self.live_curve_sample_keys > MAX_SAMPLE_KEYS:
            raise ValueError(
                f"live_curve_sample_keys must be <= {MAX_SAMPLE_KEYS:,}, got "
                f"{self.live_curve_sample_keys:,}"
            )
        if not 0 <= self.writer_nice <= 19:
            raise ValueError(f"writer_nice must be in [0, 19], got {self.writer_nice}")
        if not (self.cpu_bytes or self.has_disk or self.redis_url or self.remote_url):
            raise ValueError(
                "a store needs at least one tier: set cpu_bytes, disk_path (and disk_bytes > 0), "
                "redis_url or remote_url"
            )
        _check_remote(self)
        _check_redis(self)

    @property
    def has_disk(self) -> bool:
        """Whether the store has a disk tier (a folder and a capacity)."""
        return bool(self.disk_path) and self.disk_bytes > 0

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **overrides: Any) -> StoreConfig:
        """Read ``CACHETIER_CPU_BYTES``, ``CACHETIER_DISK_PATH``, ... (one per setting).

        Args:
            env: the environment to read (default ``os.environ``).
            overrides: settings that win over the environment.

        Returns:
            The config.
        """
        values = env_values(cls, os.environ if env is None else env)
        values.update(parse_settings(cls, overrides, source="arguments"))
        return build(cls, values)


def _check_sizes(config: StoreConfig) -> None:
    if config.cpu_bytes < 0 or config.disk_bytes < 0:
        raise ValueError("cpu_bytes and disk_bytes must be >= 0 (0 leaves the tier out)")
    positive_int("write_queue_blocks", config.write_queue_blocks)
    if config.write_queue_bytes is not None:
        positive_int("write_queue_bytes", config.write_queue_bytes)
    if not config.redis_timeout_s > 0:
        raise ValueError(f"redis_timeout_s must be positive, got {config.redis_timeout_s!r}")


def _check_remote(config: StoreConfig) -> None:
    if not config.remote_url:
        for name in ("remote_token", "remote_ca_file"):
            if getattr(config, name):
                raise ValueError(f"{name} is set without remote_url: name the server too")
        return
    _remote_tier_config(config)  # raises ValueError on a bad URL or token (no I/O)


def _check_redis(config: StoreConfig) -> None:
    if not config.redis_url:
        if config.redis_bytes is not None:
            raise ValueError("redis_bytes is set without redis_url: name the Redis too")
        redis_tls = (config.redis_ssl_ca_certs, config.redis_ssl_certfile, config.redis_ssl_keyfile)
        if any(redis_tls):
            raise ValueError("redis_ssl_* settings are set without redis_url: name the Redis too")
        return
    _redis_tier_config(config)  # raises ValueError on a bad URL, prefix, TTL or TLS files


def _redis_tier_config(config: StoreConfig) -> Any:
    from cachetier.tiers.redis import RedisTierConfig

    return RedisTierConfig(
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


def _remote_tier_config(config: StoreConfig) -> Any:
    # Imported here: the remote tier needs aiohttp, which a store without one does not.
    from cachetier.tiers.remote import RemoteTierConfig

    return RemoteTierConfig(
        url=config.remote_url, token=config.remote_token, ca_file=config.remote_ca_file
    )


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
    if config.has_disk:
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
        from cachetier.tiers.redis import RedisTier

        tiers.append(RedisTier(_redis_tier_config(config)))
    if config.remote_url:
        from cachetier.tiers.remote import RemoteTier

        tiers.append(RemoteTier(_remote_tier_config(config)))
    return tiers


def _tier_bytes(config: StoreConfig) -> dict[str, int]:
    """Capacities of the tiers whose size is known, by the names the tiers report."""
    sizes = {"cpu": config.cpu_bytes, "disk": config.disk_bytes if config.has_disk else 0}
    if config.redis_url and config.redis_bytes:
        sizes["redis"] = config.redis_bytes
    return {name: size for name, size in sizes.items() if size}


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
        for tier in tiers:
            tier.probe()  # a Redis or sidecar that cannot be reached is said now, not at a request
        return TieredStore(
            tiers,
            write_queue_blocks=config.write_queue_blocks,
            write_queue_bytes=config.write_queue_bytes,
            writer_nice=config.writer_nice,
            pin_registry=registry,
            admission=make_admission_policy(
                config.admission,
                tier_bytes=_tier_bytes(config),
                # What adaptive admission learnt, kept in the disk folder for the next process.
                state_file=AdmissionStateFile(
                    Path(config.disk_path) / STATE_FILE_NAME, config.disk_file_mode
                )
                if config.has_disk
                else None,
            ),
            miss_tracked_keys=config.miss_tracked_keys,
            live_curve=LiveCurve(_tier_bytes(config), sample_keys=config.live_curve_sample_keys)
            if config.live_curve
            else None,
            namespaces=NamespaceWatch(
                config.miss_tracked_keys,
                config.mismatch_alarm_share,
                TokenFiles(Path(config.disk_path) / FOLDER_NAME, config.disk_file_mode)
                if config.has_disk
                else None,
            ),
            # The disk tier's measured speed, kept in its folder for the next process.
            rates_file=RatesFile(
                Path(config.disk_path) / RATES_FILE_NAME, "disk", config.disk_file_mode
            )
            if config.has_disk
            else None,
        )
    except BaseException:
        for tier in tiers:  # e.g. an unreadable pin registry: leave no tier open
            tier.close()
        raise
