"""``cachetier route``: the KV-aware router in front of engine replicas (``cachetier.router``).

Keys are read from the environment, never from flags (a flag shows in the process list):
``CACHETIER_ROUTER_API_KEY`` is what clients must send, ``CACHETIER_REPLICA_API_KEY`` what the
router sends to the replicas (their ``--api-key``).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import Any

ROUTER_KEY_ENV = "CACHETIER_ROUTER_API_KEY"
REPLICA_KEY_ENV = "CACHETIER_REPLICA_API_KEY"


def add_route(subparsers: argparse._SubParsersAction) -> None:
    """Declare ``cachetier route``.

    Args:
        subparsers: the ``cachetier`` parser's subcommands.
    """
    from cachetier.router.config import POLICIES

    p = subparsers.add_parser(
        "route",
        help="route OpenAI requests to the replica where their KV is cheapest",
        description="An OpenAI-compatible proxy in front of engine replicas (ours or vllm serve "
        "with the connector): each request goes to the replica with the smallest estimated "
        f"time to first token. Keys: ${ROUTER_KEY_ENV} (clients), ${REPLICA_KEY_ENV} (replicas).",
    )
    p.add_argument(
        "--replica",
        action="append",
        required=True,
        metavar="URL",
        help="a replica's base URL (http://host:port); repeat for each",
    )
    p.add_argument("--model", help="the model folder (its tokenizer and chat template)")
    p.add_argument("--policy", choices=POLICIES, default="tier_aware")
    p.add_argument("--max-imbalance", type=float, default=1.3, help="load bound, x the mean")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8480, help="0: any free port (printed)")
    p.add_argument("--ports-file", help="write the bound port there as JSON once listening")
    p.add_argument("--poll-interval-s", type=float, default=1.0)
    p.add_argument(
        "--reconcile-interval-s",
        type=float,
        default=5.0,
        help="how often the prefix index is checked against the replicas' digests",
    )
    p.add_argument("--shared-events", help="a sidecar's KV-event endpoint (its kv_events setting)")
    p.add_argument("--shared-events-replay", help="that sidecar's replay endpoint")
    p.add_argument(
        "--replica-events",
        action="append",
        default=[],
        metavar="NAME=ENDPOINT[,REPLAY]",
        help="a vllm serve replica's KV events (its --kv-events-config endpoints); NAME is "
        "r0 for the first --replica (repeatable)",
    )
    p.add_argument(
        "--keys-file",
        help="JSON of client keys by tenant and each replica's own key: "
        '{"clients": {"KEY": "TENANT"}, "replicas": {"r0": "KEY"}} (cachetier.router.keys)',
    )
    p.add_argument(
        "--events-curve-key",
        metavar="FILE",
        help="the router's CURVE certificate with its secret key (zmq.auth's .key_secret; "
        "cachetier kv-events-keys makes it), for publishers that take CURVE readers only",
    )
    p.add_argument(
        "--events-curve-server-key",
        metavar="FILE",
        help="the publishers' public CURVE certificate (.key); with --events-curve-key",
    )
    p.add_argument("--log-level", default="info")
    p.set_defaults(run=run_route)


def route_config(args: argparse.Namespace, env: dict[str, str] | None = None) -> Any:
    """The ``RouterConfig`` of the flags and the keys of ``env`` (default ``os.environ``)."""
    from cachetier.router.config import RouterConfig
    from cachetier.router.keys import load_keys_file

    env = dict(os.environ if env is None else env)
    keys_file = getattr(args, "keys_file", None)
    clients, replica_keys = load_keys_file(keys_file) if keys_file else ((), {})
    return RouterConfig(
        replicas=tuple(args.replica),
        model=args.model,
        policy=args.policy,
        max_imbalance=args.max_imbalance,
        host=args.host,
        port=args.port,
        api_key=env.get(ROUTER_KEY_ENV) or None,
        replica_api_key=env.get(REPLICA_KEY_ENV) or None,
        replica_api_keys=tuple(replica_keys.items()),
        client_keys=clients,
        poll_interval_s=args.poll_interval_s,
        reconcile_interval_s=args.reconcile_interval_s,
        shared_events=args.shared_events,
        shared_events_replay=args.shared_events_replay,
        replica_events=tuple(args.replica_events),
        events_curve_key=getattr(args, "events_curve_key", None),
        events_curve_server_key=getattr(args, "events_curve_server_key", None),
    )


def check_curve_files(config: Any) -> None:
    """Read the router's CURVE certificates now, so that a missing or placeholder file is a
    bad configuration at start rather than events silently not followed.

    Raises:
        ValueError: a file is missing, is not a certificate, or the first holds no secret key.
    """
    if config.events_curve_key is None:
        return
    import zmq

    from cachetier.kvevents.curve import make_client

    with zmq.Context() as ctx, ctx.socket(zmq.SUB) as sock:
        make_client(sock, config.events_curve_key, config.events_curve_server_key)


def run_route(args: argparse.Namespace) -> int:
    """Serve the router until SIGTERM/SIGINT.

    Returns:
        0 after a clean stop, 1 if it did not start, 2 for a bad configuration.
    """
    import uvicorn

    from cachetier.cli.ports import (
        bound_port,
        exit_cleanly_after_graceful_stop,
        run_reporting_ports,
    )
    from cachetier.kvindex import PrefixIndex
    from cachetier.router.app import create_app
    from cachetier.router.decide import FleetDecider

    try:
        config = route_config(args)
        check_curve_files(config)
        index = PrefixIndex()
        decide = FleetDecider(config.policy, index, config.max_imbalance)
        app = create_app(config, decide, index=index)
    except (OSError, ValueError) as exc:
        print(f"cachetier route: bad configuration: {exc}", file=sys.stderr)
        return 2
    print(f"cachetier route: {config!r}", file=sys.stderr)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(levelname)-9s %(name)s: %(message)s"
    )
    server = uvicorn.Server(
        uvicorn.Config(
            app,
            host=config.host,
            port=config.port,
            log_level=args.log_level,
            lifespan="on",
            server_header=False,
            timeout_graceful_shutdown=30,
        )
    )
    exit_cleanly_after_graceful_stop()
    try:
        run_reporting_ports(
            server, lambda: {"http": bound_port(server)}, args.ports_file, "cachetier route"
        )
    except KeyboardInterrupt:
        pass
    return 0 if server.started else 1
