"""A connector's settings, read from its engine's extra config, and its stores.

One config for every plugin point: vLLM's ``kv_connector_extra_config``, SGLang's
``--hicache-storage-backend-extra-config`` and LMCache's ``extra_config``. No engine import
here: the config is plain data, checked in ``__post_init__``.
"""

from __future__ import annotations

import dataclasses
import difflib
import logging
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cachetier.primitives.fingerprint import model_fingerprint
from cachetier.primitives.kv_format import DEFAULT_RECORD_TOKENS
from cachetier.store.config import StoreConfig, build_store
from cachetier.store.tiered import TieredStore
from cachetier.util.checks import positive_int
from cachetier.util.redact import redacted_repr, url_secrets

log = logging.getLogger(__name__)

_STORE_DEFAULTS = StoreConfig()  # the defaults of the fields both configs have live there
_REDIS_PREFIX_DEFAULT = "cachetier"


LOAD_ASYNC_CHOICES = ("network", "always", "never")


def check_load_async(value: str) -> None:
    """Raise ``ValueError`` unless ``value`` is one of ``LOAD_ASYNC_CHOICES``."""
    if value not in LOAD_ASYNC_CHOICES:
        raise ValueError(f"load_async must be one of {LOAD_ASYNC_CHOICES}, got {value!r}")


@dataclass(frozen=True, slots=True)
class ConnectorConfig:
    """What an engine's extra config may set for its cachetier plugin.

    Args:
        cpu_bytes: capacity of the worker's in-process CPU tier; 0 leaves it out.
        disk_path: folder of the disk tier; ``None`` leaves it out. Survives restarts.
        disk_bytes: capacity of the disk tier.
        redis_url: ``redis://host:port/db`` of a Redis tier; ``None`` leaves it out.
        redis_key_prefix: first part of every Redis key (engines with the same prefix share
            blocks).
        redis_ttl_s: expiry of blocks in Redis, ``None`` for none.
        redis_timeout_s: longest wait for Redis to answer one read or write (seconds); a read
            that waits longer is a miss. Raise it for a Redis across a thin link.
        remote_url: base URL of a cachetier server (``http://host:port``), a tier shared by
            every engine that names it; ``None`` leaves it out.
        remote_token: bearer token for that server (it names the server-side tenant).
        tenant: tenant name; engines of different tenants never share blocks. A request's
            ``cache_salt`` is appended to it.
        compression: ``"none"`` or ``"lz4"`` for records on disk and in Redis.
        model_fingerprint: identity of the weights; ``None`` hashes the engine's model folder
            (``model_folder_fingerprint``).
        fsync: fsync disk records before they are renamed into place.
        write_queue_blocks: most blocks queued per lower tier (disk, Redis) before saves to it
            are dropped; queued blocks hold memory (1.5 MB each for SmolLM2 in fp32).
        writer_nice: CPU priority of those background writes, 0 (the engine's) to 19 (the
            lowest, the default: they use the cores the engine leaves idle).
        kv_load_policy: ``cost`` reports (and loads) only the part of a hit that the measured
            tier speeds load faster than the engine recomputes it (``cachetier.store.costmodel``);
            ``always`` loads every hit.
        load_async: which of vLLM's loads run beside its forwards (vLLM keeps scheduling other
            requests while a request waits for its KV): ``network`` (those whose every block
            comes over a network, Redis or a sidecar: their reads wait on a link, not on the
            cores the forward uses), ``always`` or ``never``. Other engines ignore it.
        record_tokens: tokens per stored record, the same in every engine that shares the
            cache (``cachetier.primitives.kv_format.DEFAULT_RECORD_TOKENS``); the engine's block
            size must be a multiple of it, and each block is stored as several records.
        fail_on_start_error: what a plugin that cannot start (a bad key or value, a tier that
            cannot open, no model fingerprint) does after logging the error at ERROR: stop
            its engine (``True``), or let the engine serve without cachetier (``False``).
            LMCache and SGLang plugins only: vLLM cannot serve without a connector its
            ``kv_transfer_config`` names, so its connector always refuses to start.
    """

    cpu_bytes: int = _STORE_DEFAULTS.cpu_bytes
    disk_path: str | None = None
    disk_bytes: int = _STORE_DEFAULTS.disk_bytes
    redis_url: str | None = None
    redis_key_prefix: str = _REDIS_PREFIX_DEFAULT
    redis_ttl_s: float | None = None
    redis_timeout_s: float = _STORE_DEFAULTS.redis_timeout_s
    remote_url: str | None = None
    remote_token: str | None = dataclasses.field(default=None, repr=False)
    tenant: str = ""
    compression: str = "none"
    model_fingerprint: str | None = None
    fsync: bool = True
    write_queue_blocks: int = _STORE_DEFAULTS.write_queue_blocks
    writer_nice: int = _STORE_DEFAULTS.writer_nice
    kv_load_policy: str = "cost"
    load_async: str = "network"
    record_tokens: int = DEFAULT_RECORD_TOKENS
    fail_on_start_error: bool = True

    def __post_init__(self) -> None:
        positive_int("record_tokens", self.record_tokens)
        if self.kv_load_policy not in ("cost", "always"):
            raise ValueError(
                f"kv_load_policy must be 'cost' or 'always', got {self.kv_load_policy!r}"
            )
        check_load_async(self.load_async)
        if not isinstance(self.tenant, str):
            raise TypeError(f"tenant must be a str, got {type(self.tenant).__name__}")
        if self.model_fingerprint is not None and not self.model_fingerprint:
            raise ValueError("model_fingerprint must be None or a non-empty string")
        self.store_config()  # raises ValueError on bad sizes, compression or no tier at all
        if self.redis_url:
            from cachetier.tiers.redis import RedisTierConfig

            RedisTierConfig(  # raises ValueError on a bad URL, prefix or TTL (no I/O)
                url=self.redis_url, key_prefix=self.redis_key_prefix, ttl_s=self.redis_ttl_s
            )
        if self.remote_url:
            from cachetier.tiers.remote import RemoteTierConfig

            RemoteTierConfig(url=self.remote_url, token=self.remote_token)  # raises on a bad URL

    def __repr__(self) -> str:
        # vLLM logs its kv_transfer_config; the Redis URL's password must not go with it.
        return redacted_repr(self)

    @classmethod
    def from_extra_config(
        cls,
        extra: Mapping[str, Any] | None,
        *,
        source: str = "kv_connector_extra_config",
        accepted: Collection[str] | None = None,
    ) -> ConnectorConfig:
        """Build the config from an engine's extra config.

        Args:
            extra: the dict given to the engine (``None`` for all defaults).
            source: what the engine calls that dict, for error messages.
            accepted: the keys that may be given there; ``None`` for vLLM's
                (``VLLM_KEYS``).

        Returns:
            The config.

        Raises:
            ValueError: on a key not in ``accepted`` (the message lists only those) or a bad
                value.
        """
        extra = dict(extra or {})
        check_keys(extra, VLLM_KEYS if accepted is None else accepted, source=source)
        for name in (
            "cpu_bytes",
            "disk_bytes",
            "write_queue_blocks",
            "writer_nice",
            "record_tokens",
        ):
            if name in extra:
                extra[name] = _as_int(name, extra[name])
        for name in ("redis_ttl_s", "redis_timeout_s"):
            if extra.get(name) is not None:
                extra[name] = float(extra[name])
        for name in ("fsync", "fail_on_start_error"):
            if name in extra:
                extra[name] = _as_bool(name, extra[name])
        for name in ("disk_path", "redis_url", "remote_url", "remote_token"):
            if extra.get(name) == "":
                extra[name] = None
        return cls(**extra)

    @property
    def has_shared_tier(self) -> bool:
        """Whether a tier outside the worker process (disk, Redis, a server) is configured."""
        return bool(self.disk_path or self.redis_url or self.remote_url)

    def store_config(self, *, with_cpu: bool = True) -> StoreConfig:
        """The ``StoreConfig`` of these tiers (the CPU tier left out if ``with_cpu`` is False)."""
        return StoreConfig(
            cpu_bytes=self.cpu_bytes if with_cpu else 0,
            disk_path=self.disk_path,
            disk_bytes=self.disk_bytes,
            redis_url=self.redis_url,
            redis_ttl_s=self.redis_ttl_s,
            redis_timeout_s=self.redis_timeout_s,
            redis_key_prefix=self.redis_key_prefix,
            compression=self.compression,
            fsync=self.fsync,
            write_queue_blocks=self.write_queue_blocks,
            writer_nice=self.writer_nice,
            remote_url=self.remote_url,
            remote_token=self.remote_token,
        )


ALL_KEYS = frozenset(f.name for f in dataclasses.fields(ConnectorConfig))
# Secrets an engine would log with its plugin's settings (SGLang its server arguments, LMCache
# its config): a plugin takes them from these environment variables instead (``plugin_config``).
PLUGIN_SECRETS = {"remote_token": "CACHETIER_REMOTE_TOKEN"}
PLUGIN_KEYS = ALL_KEYS - set(PLUGIN_SECRETS)
"""The keys a plugin (LMCache's ``extra_config``, SGLang's extra config) accepts."""
VLLM_KEYS = ALL_KEYS - {"fail_on_start_error"}
"""The keys vLLM's ``kv_connector_extra_config`` accepts (vLLM redacts what it logs, and
cannot serve without its connector: ``fail_on_start_error`` would promise what it cannot do)."""


def check_keys(given: Collection[str], accepted: Collection[str], *, source: str) -> None:
    """Refuse keys not in ``accepted``, naming the closest accepted one.

    Args:
        given: the keys the user gave.
        accepted: the keys accepted where they were given.
        source: where they were given, for the message.

    Raises:
        ValueError: a key not accepted; the message lists only the accepted keys.
    """
    unknown = sorted(set(given) - set(accepted))
    if not unknown:
        return
    hints = [
        f"{key!r} -> {close[0]!r}"
        for key in unknown
        if (close := difflib.get_close_matches(key, sorted(accepted), n=1))
    ]
    hint = f" (did you mean {', '.join(hints)}?)" if hints else ""
    raise ValueError(f"unknown {source} keys {unknown}{hint}; accepted: {sorted(accepted)}")


def open_store(config: ConnectorConfig, *, with_cpu: bool) -> TieredStore:
    """Open the tiers ``config`` names, fastest first.

    Args:
        config: the connector's config.
        with_cpu: include the in-process CPU tier (the worker does; the scheduler, which only
            asks what is stored, looks at the shared tiers).

    Returns:
        The store; the caller closes it.
    """
    return build_store(config.store_config(with_cpu=with_cpu))


def plugin_config(
    settings: Mapping[str, Any], env: Mapping[str, str], *, source: str
) -> ConnectorConfig:
    """A plugin's settings from an engine config that the engine logs, secrets from the
    environment.

    SGLang logs its server arguments and LMCache its config, the plugin's settings among
    them, and a command line is readable by every user of the node: the sidecar's token and a
    Redis password come from ``CACHETIER_REMOTE_TOKEN`` and ``CACHETIER_REDIS_URL`` instead.

    Args:
        settings: the plugin's keys of the engine's config (``PLUGIN_KEYS``).
        env: the process environment.
        source: where the settings were given, for error messages.

    Returns:
        The config.

    Raises:
        ValueError: an unknown key, a bad value, or a secret in ``settings``.
    """
    own = dict(settings)
    for key, variable in PLUGIN_SECRETS.items():
        if key in own:
            raise ValueError(
                f"{key} in {source} would be logged by the engine: set {variable} in its "
                "environment instead"
            )
    check_keys(own, PLUGIN_KEYS, source=source)
    if url_secrets(own.get("redis_url")):
        raise ValueError(
            f"a redis_url with a password in {source} would be logged by the engine: set "
            "CACHETIER_REDIS_URL in its environment instead"
        )
    if own.get("remote_url") and env.get("CACHETIER_REMOTE_TOKEN"):
        own["remote_token"] = env["CACHETIER_REMOTE_TOKEN"]
    if not own.get("redis_url") and env.get("CACHETIER_REDIS_URL"):
        own["redis_url"] = env["CACHETIER_REDIS_URL"]
    return ConnectorConfig.from_extra_config(own, source=source, accepted=ALL_KEYS)


def fails_on_start_error(settings: Mapping[str, Any]) -> bool:
    """Whether a plugin with these settings that cannot start stops its engine.

    Read alone, before the rest of the settings are checked (they may be what failed); a
    value that is not a boolean keeps the default, fatal.

    Args:
        settings: the plugin's keys of the engine's config.

    Returns:
        ``ConnectorConfig.fail_on_start_error`` as given, ``True`` by default.
    """
    try:
        return _as_bool("fail_on_start_error", settings.get("fail_on_start_error", True))
    except ValueError:
        return True


def log_start_failure(error: BaseException, *, engine: str, fatal: bool) -> str:
    """Log at ERROR that a plugin could not start, and what its engine does now.

    Args:
        error: why it could not start.
        engine: the engine's name, for the message.
        fatal: whether the engine is stopped (``fail_on_start_error``).

    Returns:
        The message logged (a fatal exit repeats it).
    """
    if fatal:
        message = (
            f"cachetier could not start in {engine}: {error}. {engine} is not started without "
            "it (set fail_on_start_error: false to run without cachetier instead)"
        )
    else:
        message = (
            f"cachetier could not start in {engine}: {error}. {engine} is running WITHOUT "
            "cachetier (fail_on_start_error is false): nothing is stored or restored"
        )
    # A bad setting needs no traceback; anything else (a tier that failed to open) does.
    trace = None if isinstance(error, (ValueError, TypeError)) else error
    log.error("%s", message, exc_info=trace)
    return message


def model_folder_fingerprint(model: str, revision: str | None = None, *, key: str) -> str:
    """Fingerprint of the weights an engine loads as ``model`` (hashed once, then cached).

    Args:
        model: a local folder, or a Hugging Face model id already in the local cache (nothing
            is downloaded).
        revision: the model's revision, for a model id.
        key: where the user would pass the fingerprint instead, for the error message (e.g.
            ``kv_connector_extra_config['model_fingerprint']``).

    Returns:
        ``cachetier.primitives.fingerprint.model_fingerprint`` of that folder.

    Raises:
        ValueError: no local folder holds the model.
    """
    folder = Path(model)
    if not folder.is_dir():
        from huggingface_hub import snapshot_download

        try:
            folder = Path(snapshot_download(model, revision=revision, local_files_only=True))
        except Exception as exc:  # noqa: BLE001 - any failure means: no local folder to hash
            raise ValueError(
                f"cannot find a local folder for model {model!r} to fingerprint ({exc}); pass {key}"
            ) from None
    return model_fingerprint(folder)


def _as_int(name: str, value: object) -> int:
    if isinstance(value, bool):
        raise TypeError(f"{name} must be an int, got {value!r}")
    try:
        return int(value)  # type: ignore[call-overload]
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be an int, got {value!r}") from None


def _as_bool(name: str, value: object) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"{name} must be true or false, got {value!r}")
