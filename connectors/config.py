"""A connector's settings, read from its engine's extra config, and its stores.

One config for every plugin point: vLLM's ``kv_connector_extra_config``, SGLang's
``--hicache-storage-backend-extra-config`` and LMCache's ``extra_config``. No engine import
here: the config is plain data, checked in ``__post_init__``.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from cachetier.guard import GuardConfig
from cachetier.primitives.fingerprint import model_fingerprint
from cachetier.store.config import StoreConfig, build_store
from cachetier.store.engine_settings import (
    check_kv_load_policy,
    guard_first_hits_setting,
    guard_fraction_setting,
    guard_setting,
    kv_load_policy_setting,
    record_check_setting,
    record_check_tokens_setting,
    record_tokens_setting,
    tenant_setting,
)
from cachetier.store.tiered import TieredStore
from cachetier.util.checks import positive_int
from cachetier.util.redact import redacted_repr, url_secrets
from cachetier.util.settings import (
    build,
    check_keys,
    flat_settings,
    nested,
    parse_settings,
    parse_value,
    setting,
)

log = logging.getLogger(__name__)

LOAD_ASYNC_CHOICES = ("network", "always", "never")


def check_load_async(value: str) -> None:
    """Raise ``ValueError`` unless ``value`` is one of ``LOAD_ASYNC_CHOICES``."""
    if value not in LOAD_ASYNC_CHOICES:
        raise ValueError(f"load_async must be one of {LOAD_ASYNC_CHOICES}, got {value!r}")


@dataclass(frozen=True, slots=True)
class ConnectorConfig:
    """What an engine's extra config may set for its cachetier plugin: the tiers (every store
    setting, by its own name) and the plugin's own settings.

    Each field's description is declared with it (``cachetier.util.settings.setting``).
    """

    store: StoreConfig = nested(
        StoreConfig,
        "the plugin's tiers: every store setting, given by its own name; the CPU tier is in "
        "each worker process.",
    )
    tenant: str = tenant_setting()
    model_fingerprint: str | None = setting(
        None,
        "identity of the weights; ``None`` hashes the engine's model folder "
        "(``model_folder_fingerprint``). Name it when pods load the weights from different "
        "paths.",
    )
    kv_load_policy: str = kv_load_policy_setting()
    load_async: str = setting(
        "network",
        "which of vLLM's loads run beside its forwards (vLLM keeps scheduling other requests "
        "while a request waits for its KV): ``network`` (those whose every block comes over a "
        "network, Redis or a sidecar: their reads wait on a link, not on the cores the forward "
        "uses), ``always`` or ``never``. Other engines ignore it.",
    )
    record_tokens: int = record_tokens_setting()
    fail_on_start_error: bool = setting(
        True,
        "what a plugin that cannot start (a bad key or value, a tier that cannot open, no "
        "model fingerprint) does after logging the error at ERROR: stop its engine (``True``), "
        "or let the engine serve without cachetier (``False``). LMCache and SGLang plugins "
        "only: vLLM cannot serve without a connector its ``kv_transfer_config`` names, so its "
        "connector always refuses to start.",
    )
    guard: bool = guard_setting()
    guard_first_hits: int = guard_first_hits_setting()
    guard_fraction: float = guard_fraction_setting()
    record_check: bool = record_check_setting()
    record_check_tokens: int = record_check_tokens_setting()

    def __post_init__(self) -> None:
        if not isinstance(self.store, StoreConfig):
            raise TypeError(f"store must be a StoreConfig, got {type(self.store).__name__}")
        positive_int("record_tokens", self.record_tokens)
        positive_int("record_check_tokens", self.record_check_tokens)
        check_kv_load_policy(self.kv_load_policy)
        check_load_async(self.load_async)
        if not isinstance(self.tenant, str):
            raise TypeError(f"tenant must be a str, got {type(self.tenant).__name__}")
        if self.model_fingerprint is not None and not self.model_fingerprint:
            raise ValueError("model_fingerprint must be None or a non-empty string")
        self.guard_config()  # checks the guard's settings

    def guard_config(self) -> GuardConfig:
        """The restore guard's sampling, from ``guard*`` (vLLM's connector runs it)."""
        return GuardConfig(self.guard, self.guard_first_hits, self.guard_fraction)

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
            extra: setting name -> value, as given to the engine (``None`` for all defaults).
            source: what the engine calls that dict, for error messages.
            accepted: the keys that may be given there; ``None`` for vLLM's
                (``VLLM_KEYS``).

        Returns:
            The config.

        Raises:
            ValueError: on a key not in ``accepted`` (the message lists only those) or a bad
                value (the message names its key).
        """
        extra = dict(extra or {})
        check_keys(extra, VLLM_KEYS if accepted is None else accepted, source=source)
        return build(cls, parse_settings(cls, extra, source=source))

    @property
    def has_shared_tier(self) -> bool:
        """Whether a tier outside the worker process (disk, Redis, a server) is configured."""
        return bool(self.store.has_disk or self.store.redis_url or self.store.remote_url)

    def store_config(self, *, with_cpu: bool = True) -> StoreConfig:
        """The ``StoreConfig`` of these tiers (the CPU tier left out if ``with_cpu`` is False)."""
        return self.store if with_cpu else replace(self.store, cpu_bytes=0)


SETTINGS = flat_settings(ConnectorConfig)
"""Every setting of a plugin by name, the store's among them (two of one name fail here)."""
ALL_KEYS = frozenset(SETTINGS)
# Secrets an engine would log with its plugin's settings (SGLang its server arguments, LMCache
# its config): a plugin takes them from these environment variables instead (``plugin_config``).
PLUGIN_SECRETS = {"remote_token": "CACHETIER_REMOTE_TOKEN"}
PLUGIN_KEYS = ALL_KEYS - set(PLUGIN_SECRETS)
"""The keys a plugin (LMCache's ``extra_config``, SGLang's extra config) accepts."""
VLLM_KEYS = ALL_KEYS - {"fail_on_start_error"}
"""The settings of vLLM's connector (vLLM cannot serve without its connector:
``fail_on_start_error`` would promise what it cannot do)."""
VLLM_PLUGIN_KEYS = VLLM_KEYS - set(PLUGIN_SECRETS)
"""The keys vLLM's ``kv_connector_extra_config`` accepts: not the secrets, which ``vllm serve``
would log with it (``plugin_config``)."""


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
    settings: Mapping[str, Any],
    env: Mapping[str, str],
    *,
    source: str,
    keys: Collection[str] = PLUGIN_KEYS,
) -> ConnectorConfig:
    """A plugin's settings from an engine config that the engine logs, secrets from the
    environment.

    SGLang logs its server arguments, LMCache its config and ``vllm serve`` its
    ``--kv-transfer-config`` (vLLM redacts only its own API key and tokens), the plugin's
    settings among them, and a command line is readable by every user of the node: the
    sidecar's token and a Redis password come from ``CACHETIER_REMOTE_TOKEN`` and
    ``CACHETIER_REDIS_URL`` instead.

    Args:
        settings: the plugin's keys of the engine's config (``keys``).
        env: the process environment.
        source: where the settings were given, for error messages.
        keys: the keys the engine's config may hold (``PLUGIN_KEYS``; vLLM's: ``VLLM_PLUGIN_KEYS``).

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
    check_keys(own, keys, source=source)
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
    value = settings.get("fail_on_start_error", True)
    try:
        return parse_value(SETTINGS["fail_on_start_error"], value, key="fail_on_start_error")
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
