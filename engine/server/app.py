"""The OpenAI engine server's app factory: a FastAPI app whose lifespan owns the store, the
engine and its thread, and the metrics registry."""

from __future__ import annotations

import logging
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from fastapi import FastAPI
from starlette.concurrency import run_in_threadpool

from cachetier.engine.llm import maybe_tokenizer
from cachetier.engine.llm_engine import LLMEngine
from cachetier.engine.server import routes, routes_fleet, routes_pins
from cachetier.engine.server.async_engine import AsyncEngine
from cachetier.engine.server.config import SMOLLM2, EngineServerConfig
from cachetier.engine.server.errors import body_refused_answer, install_error_handlers
from cachetier.engine.server.metrics import EngineMetrics
from cachetier.engine.server.serving import OpenAIServing
from cachetier.engine.smollm2 import smollm2_path
from cachetier.kvevents import KVEventPublisher, PublisherConfig, TierEvents
from cachetier.server.body_limit import install_body_limit
from cachetier.store.config import build_store
from cachetier.store.tiered import TieredStore

log = logging.getLogger("cachetier.engine.server")

_DESCRIPTION = """OpenAI-compatible completions over cachetier's paged engine.

`usage.prompt_tokens_details.cached_tokens` counts the prompt tokens served from the KV cache.
The `cachetier` object of an answer (an extension) says where they came from: `pool` (the
engine's own KV blocks) or a tier (`cpu`, `disk`, `redis`, `remote`).
"""


def model_folder(model: str) -> Path:
    """The folder of ``model`` (``smollm2`` is converted on first use, which takes a while)."""
    if model == SMOLLM2:
        return smollm2_path()
    folder = Path(model)
    if not (folder / "config.json").is_file():
        raise ValueError(f"{model!r} is not a model folder (no config.json): give one, or smollm2")
    return folder


def _open_engine(config: EngineServerConfig) -> tuple[LLMEngine, TieredStore | None, Any]:
    folder = model_folder(config.model)
    store = build_store(config.store) if config.store is not None else None
    try:
        engine = LLMEngine(config.engine_config(folder), store)
    except BaseException:
        if store is not None:
            store.close()
        raise
    return engine, store, maybe_tokenizer(folder)


def _publisher(config: EngineServerConfig, engine: LLMEngine) -> KVEventPublisher | None:
    """The pool's KV-event publisher: on loopback at ports the OS picks unless told where (its
    events carry prompts' token ids: beyond loopback only with CURVE keys)."""
    if not config.kv_events:
        return None
    publisher = KVEventPublisher(
        PublisherConfig(
            replica=f"{config.model_name}-{os.getpid()}".replace("@", "-"),
            model=config.model_name.replace("@", "-"),
            endpoint=config.kv_events_endpoint or "tcp://127.0.0.1:0",
            replay_endpoint=config.kv_events_replay_endpoint or "tcp://127.0.0.1:0",
            max_queue_batches=config.kv_events_queue,
            encoding=config.kv_events_encoding,
            publish_token_ids=config.kv_events_token_ids,
            curve_secret_key_file=config.kv_events_curve_key,
            curve_public_keys_dir=config.kv_events_curve_clients,
        )
    )
    engine.publish_events(TierEvents(publisher))
    return publisher


def create_app(config: EngineServerConfig) -> FastAPI:
    """Build the server's app.

    Args:
        config: the server's settings; the model loads and the store opens when the app starts
            (lifespan); on stop, the engine thread ends and the store is flushed and closed.

    Returns:
        The app, for uvicorn.
    """

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[dict[str, Any]]:
        # Loading weights and opening the disk tier block: not on the event loop.
        engine, store, tokenizer = await run_in_threadpool(_open_engine, config)
        publisher = _publisher(config, engine)
        engine_thread = AsyncEngine(engine)
        try:
            metrics = EngineMetrics(
                engine_thread.stats,
                config.model_name,
                store.stats if store is not None else None,
            )
            engine_thread.observer = metrics
            engine_thread.start()
            serving = OpenAIServing(
                config,
                engine_thread,
                tokenizer,
                metrics,
                engine.max_model_len,
                engine.spec.vocab_size,
                kv_events=publisher,
            )
            pool = engine.pool
            log.info(
                "serving %s: KV pool of %d blocks x %d tokens (%.1f MiB, %s), max_model_len %d, "
                "tiers %s, tokenizer %s",
                config.model_name,
                pool.num_blocks,
                engine.config.block_size,
                pool.num_blocks * (pool.block_bytes + pool.aux_bytes) / 2**20,
                pool.dtype_name,
                engine.max_model_len,
                [t.name for t in store.tiers] if store is not None else [],
                "yes" if tokenizer is not None else "none (token-id prompts only)",
            )
            yield {"serving": serving}
        finally:
            await run_in_threadpool(engine_thread.shutdown)
            engine.close()
            if publisher is not None:
                publisher.close()
            if store is not None:
                # Waits for every queued write to the lower tiers: a restart finds the blocks.
                await run_in_threadpool(store.close)
                log.info("store flushed and closed")

    app = FastAPI(
        title="cachetier engine", version="1", description=_DESCRIPTION, lifespan=lifespan
    )
    install_body_limit(app, lambda scope: config.max_request_bytes, body_refused_answer)
    app.include_router(routes.router)
    app.include_router(routes.v1)
    app.include_router(routes_pins.v1)
    app.include_router(routes_fleet.v1)
    install_error_handlers(app)
    return app
