"""Command line: ``python -m cachetier.engine.server`` serves a model over the OpenAI API.

    python -m cachetier.engine.server --port 8000 --disk-path ./kv
    python -m cachetier.engine.server --model ./my-llama --served-model-name llama --api-key secret

Tiers come from ``CACHETIER_*`` variables (``CACHETIER_CPU_BYTES``, ``CACHETIER_DISK_PATH``,
``CACHETIER_REDIS_URL``, ``CACHETIER_REMOTE_URL``, ``CACHETIER_REMOTE_TOKEN``...), and the
flags below win over them. SIGTERM or Ctrl-C stops it gracefully: requests in flight finish
(up to --graceful-timeout), then the store is flushed so a restart finds the blocks.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Mapping

import uvicorn

from cachetier.cli.ports import (
    bound_port,
    exit_cleanly_after_graceful_stop,
    run_reporting_ports,
)
from cachetier.engine.config import KV_LOAD_POLICIES, MODEL_DTYPES
from cachetier.engine.server.app import create_app
from cachetier.engine.server.config import SMOLLM2, EngineServerConfig
from cachetier.store.config import StoreConfig, env_values
from cachetier.store.engine_settings import (
    guard_first_hits_setting,
    guard_fraction_setting,
    guard_setting,
)
from cachetier.util.settings import add_flags, build, flag_values

API_KEY_ENV = "CACHETIER_ENGINE_API_KEY"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m cachetier.engine.server",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--model", default=SMOLLM2, help="HF model folder, or smollm2 (the default)")
    p.add_argument("--served-model-name", default=None, help="the name clients pass as model")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000, help="0: a free one (see --ports-file)")
    p.add_argument(
        "--ports-file",
        default=None,
        help='once listening, write {"http": PORT} there as JSON, in one rename: with --port 0, '
        "a parent process waits for this file",
    )
    p.add_argument(
        "--api-key",
        default=os.environ.get(API_KEY_ENV),
        help=f"require 'Authorization: Bearer KEY' on /v1 (default: ${API_KEY_ENV})",
    )
    _add_engine_args(p.add_argument_group("engine"))
    # Every store setting, from its one declaration (secrets only from CACHETIER_*).
    add_flags(p.add_argument_group("tiers (override CACHETIER_* variables)"), StoreConfig)
    limits = p.add_argument_group("limits")
    limits.add_argument("--max-prompt-tokens", type=int, default=None)
    limits.add_argument("--max-request-bytes", type=int, default=1 << 20)
    limits.add_argument("--max-concurrent-requests", type=int, default=256)
    limits.add_argument(
        "--kv-events",
        action="store_true",
        help="publish the pool's and tiers' blocks as KV events for a router "
        "(GET /v1/fleet/state: where)",
    )
    limits.add_argument(
        "--kv-events-queue",
        type=int,
        default=10_000,
        help="event batches queued for the publisher at most (past it: dropped, counted)",
    )
    limits.add_argument(
        "--kv-events-endpoint",
        help="where the events' PUB socket binds (tcp://host:port); default: 127.0.0.1, any "
        "port (beyond loopback: give the CURVE keys)",
    )
    limits.add_argument(
        "--kv-events-replay-endpoint", help="where the replay socket binds; default as above"
    )
    limits.add_argument(
        "--kv-events-curve-key",
        help="the publisher's CURVE certificate with its secret key (zmq.auth's .key_secret)",
    )
    limits.add_argument(
        "--kv-events-curve-clients",
        help="folder of the public certificates (*.key) allowed to read the KV events",
    )
    limits.add_argument(
        "--kv-events-hashes-only",
        action="store_true",
        help="publish block hashes without token ids",
    )
    limits.add_argument(
        "--kv-events-encoding",
        choices=("map", "array"),
        default="map",
        help="events as vLLM's decoder reads them (map) or as llm-d's indexer does (array)",
    )
    limits.add_argument(
        "--graceful-timeout",
        type=float,
        default=30.0,
        help="seconds requests in flight get to finish on SIGTERM",
    )
    p.add_argument(
        "--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"]
    )
    return p


def _add_engine_args(engine: argparse._ArgumentGroup) -> None:
    """The engine's own flags (``EngineConfig``'s)."""
    engine.add_argument("--dtype", default="float32", choices=MODEL_DTYPES)
    engine.add_argument("--kv-cache-bytes", type=int, default=1 << 30)
    engine.add_argument("--kv-cache-dtype", default="auto")
    engine.add_argument("--block-size", type=int, default=16)
    engine.add_argument("--max-num-seqs", type=int, default=64)
    engine.add_argument("--max-num-batched-tokens", type=int, default=2048)
    engine.add_argument("--max-model-len", type=int, default=None)
    engine.add_argument("--tenant", default="", help="tenant / cache salt of every block key")
    engine.add_argument("--num-threads", type=int, default=None, help="torch threads")
    engine.add_argument(
        "--event-log",
        default=None,
        help="append one JSON line per prefix lookup here (cachetier report)",
    )
    engine.add_argument(
        "--kv-load-policy",
        default="cost",
        choices=KV_LOAD_POLICIES,
        help="cost: load a tier hit only where that beats recomputing it; always: load every hit",
    )
    engine.add_argument(
        "--device",
        default="cpu",
        help="cpu, cuda or cuda:N: where the weights, the KV pool and the forward live",
    )
    engine.add_argument(
        "--guard",
        action=argparse.BooleanOptionalAction,
        default=guard_setting().default,
        help="verify sampled tier hits by computing them (the restore guard; on by default)",
    )
    engine.add_argument(
        "--guard-first-hits",
        type=int,
        default=guard_first_hits_setting().default,
        help="hits verified per tier and namespace",
    )
    engine.add_argument(
        "--guard-fraction",
        type=float,
        default=guard_fraction_setting().default,
        help="share of later hits verified",
    )


def store_config(args: argparse.Namespace, env: Mapping[str, str]) -> StoreConfig | None:
    """The tiers of the environment and the flags; ``None`` if they name none."""
    values = env_values(StoreConfig, env)
    values.update(flag_values(StoreConfig, args))
    cpu_bytes = values.get("cpu_bytes", StoreConfig.cpu_bytes)
    if not (
        cpu_bytes or values.get("disk_path") or values.get("redis_url") or values.get("remote_url")
    ):
        return None
    return build(StoreConfig, values)  # nested settings (admission) into their configs


def server_config(
    argv: list[str] | None = None, env: Mapping[str, str] | None = None
) -> tuple[EngineServerConfig, float]:
    """The server's config from the command line and the environment (and the graceful
    timeout); exits with a usage message on a bad value."""
    parser = _parser()
    return _config_of(parser, parser.parse_args(argv), env)


def _config_of(
    parser: argparse.ArgumentParser, args: argparse.Namespace, env: Mapping[str, str] | None
) -> tuple[EngineServerConfig, float]:
    engine_args = {
        "dtype": args.dtype,
        "kv_cache_bytes": args.kv_cache_bytes,
        "kv_cache_dtype": args.kv_cache_dtype,
        "block_size": args.block_size,
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "max_model_len": args.max_model_len,
        "tenant": args.tenant,
        "num_threads": args.num_threads,
        "event_log": args.event_log,
        "kv_load_policy": args.kv_load_policy,
        "device": args.device,
        "guard": args.guard,
        "guard_first_hits": args.guard_first_hits,
        "guard_fraction": args.guard_fraction,
    }
    try:
        config = EngineServerConfig(
            model=args.model,
            served_model_name=args.served_model_name,
            host=args.host,
            port=args.port,
            engine_args=engine_args,
            store=store_config(args, os.environ if env is None else env),
            api_key=args.api_key,
            max_prompt_tokens=args.max_prompt_tokens,
            max_request_bytes=args.max_request_bytes,
            max_concurrent_requests=args.max_concurrent_requests,
            kv_events=args.kv_events,
            kv_events_queue=args.kv_events_queue,
            kv_events_endpoint=args.kv_events_endpoint,
            kv_events_replay_endpoint=args.kv_events_replay_endpoint,
            kv_events_curve_key=args.kv_events_curve_key,
            kv_events_curve_clients=args.kv_events_curve_clients,
            kv_events_token_ids=not args.kv_events_hashes_only,
            kv_events_encoding=args.kv_events_encoding,
            log_level=args.log_level,
        )
    except ValueError as exc:
        parser.error(str(exc))
    return config, args.graceful_timeout


def main(argv: list[str] | None = None) -> None:
    parser = _parser()
    args = parser.parse_args(argv)
    config, graceful_timeout = _config_of(parser, args, None)
    logging.basicConfig(
        level=config.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    print(f"engine server config: {config}", file=sys.stderr, flush=True)
    if config.api_key is None and config.host not in ("127.0.0.1", "localhost", "::1"):
        logging.getLogger("cachetier.engine.server").warning(
            "no API key and listening on %s: anyone who reaches the port can use the model",
            config.host,
        )
    # uvicorn turns SIGTERM / SIGINT into a graceful stop: no new connections, requests in
    # flight finish, then the lifespan's shutdown stops the engine and flushes the store.
    exit_cleanly_after_graceful_stop()
    server = uvicorn.Server(
        uvicorn.Config(
            create_app(config),
            host=config.host,
            port=config.port,
            log_level=config.log_level,
            timeout_graceful_shutdown=graceful_timeout,
        )
    )
    try:
        run_reporting_ports(
            server, lambda: {"http": bound_port(server)}, args.ports_file, "engine server"
        )
    except KeyboardInterrupt:
        pass
    if not server.started:
        sys.exit(1)  # what uvicorn.run does when the model or the port fails at start


if __name__ == "__main__":
    main()
