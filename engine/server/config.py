"""``EngineServerConfig``: settings of the OpenAI engine server (the sidecar's are
``cachetier.server.config.ServerConfig``): model, address, engine and tier settings, limits."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from types import MappingProxyType
from typing import Any

from cachetier.engine.config import EngineConfig
from cachetier.kvevents.config import check_endpoint
from cachetier.store.config import StoreConfig

SMOLLM2 = "smollm2"
SMOLLM2_SERVED_NAME = "SmolLM2-135M-Instruct"
_ENGINE_FIELDS = {f.name for f in fields(EngineConfig)} - {"model"}


@dataclass(frozen=True, slots=True)
class EngineServerConfig:
    """Settings of the OpenAI-compatible engine server: model, address, engine, tiers, limits.

    Args:
        model: a local Hugging Face model folder, or ``smollm2`` for SmolLM2-135M-Instruct
            (converted on first use).
        served_model_name: the name clients pass as ``model`` and ``/v1/models`` lists; default:
            ``SmolLM2-135M-Instruct`` for ``smollm2``, else the folder's name.
        host: address to listen on.
        port: TCP port (0: the OS picks one).
        engine_args: any ``EngineConfig`` field but ``model`` (``kv_cache_bytes``, ``block_size``,
            ``max_num_seqs``, ``dtype``, ``tenant``, ``event_log``...).
        store: the tiers behind the engine's pool, ``None`` for none.
        api_key: when set, every ``/v1`` route needs ``Authorization: Bearer <api_key>``.
        max_prompt_tokens: longest prompt accepted; ``None`` takes what the engine can hold.
        max_request_bytes: largest request body (413 above it).
        max_concurrent_requests: generations in flight at once: a request that arrives with this
            many running gets 429 (requests arriving together may pass it by a few).
        log_level: uvicorn's log level.
        kv_events: publish the engine pool's and the tiers' blocks as KV events (vLLM's wire
            format, ZMQ PUB and replay on ports the OS picks, on ``host``), after announcing
            what the tiers hold; ``GET /v1/fleet/state`` says where.
        kv_events_queue: batches of events waiting for the publisher's thread at most; past
            it events are dropped and counted (a router's index heals by reconciling).
        kv_events_endpoint: where the events' PUB socket binds (``tcp://host:port``, for an
            indexer configured with a fixed address); ``None``: 127.0.0.1, a port the OS picks
            (a non-loopback address needs the CURVE settings).
        kv_events_replay_endpoint: where the replay socket binds; ``None`` as above.
        kv_events_curve_key: the publisher's CURVE certificate file with its secret key.
        kv_events_curve_clients: the folder of the certificates allowed to read the events.
        kv_events_token_ids: ``False`` publishes block hashes without token ids.
        kv_events_encoding: ``"map"`` (vLLM's decoder) or ``"array"`` (llm-d's indexer).
    """

    model: str = SMOLLM2
    served_model_name: str | None = None
    host: str = "127.0.0.1"
    port: int = 8000
    engine_args: Mapping[str, Any] = field(default_factory=dict)
    store: StoreConfig | None = None
    api_key: str | None = field(default=None, repr=False)
    max_prompt_tokens: int | None = None
    max_request_bytes: int = 1 << 20
    max_concurrent_requests: int = 256
    log_level: str = "info"
    kv_events: bool = False
    kv_events_queue: int = 10_000
    kv_events_endpoint: str | None = None
    kv_events_replay_endpoint: str | None = None
    kv_events_curve_key: str | None = None
    kv_events_curve_clients: str | None = None
    kv_events_token_ids: bool = True
    kv_events_encoding: str = "map"

    def __post_init__(self) -> None:
        if not self.model.strip():
            raise ValueError("model must be a model folder or 'smollm2'")
        if self.served_model_name is not None and not self.served_model_name.strip():
            raise ValueError("served_model_name must not be empty (or leave it unset)")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        unknown = set(self.engine_args) - _ENGINE_FIELDS
        if unknown:
            raise ValueError(
                f"unknown engine_args {sorted(unknown)}; EngineConfig takes "
                f"{sorted(_ENGINE_FIELDS)}"
            )
        # Checks the values now (EngineConfig does no I/O), not when the model loads.
        EngineConfig(model=self.model, **self.engine_args)
        # A read-only view: the config is frozen, its mapping must not change under it either.
        object.__setattr__(self, "engine_args", MappingProxyType(dict(self.engine_args)))
        if self.api_key is not None and not self.api_key.strip():
            raise ValueError("api_key must not be empty (or leave it unset for no auth)")
        for name in ("kv_events_endpoint", "kv_events_replay_endpoint"):
            if getattr(self, name) is not None:
                check_endpoint(name, getattr(self, name))
        for name in ("max_request_bytes", "max_concurrent_requests", "kv_events_queue"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.max_prompt_tokens is not None and self.max_prompt_tokens <= 0:
            raise ValueError(f"max_prompt_tokens must be positive, got {self.max_prompt_tokens}")

    @property
    def model_name(self) -> str:
        """What clients call the model."""
        if self.served_model_name is not None:
            return self.served_model_name
        return SMOLLM2_SERVED_NAME if self.model == SMOLLM2 else Path(self.model).name

    def engine_config(self, folder: Path) -> EngineConfig:
        """The engine's config for the model in ``folder`` (``model`` resolved to a folder)."""
        return EngineConfig(model=str(folder), **self.engine_args)
