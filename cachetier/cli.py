"""The ``cachetier`` command.

Each subcommand is one ``add_<name>(subparsers)`` function that declares its flags and sets
``run`` to the function doing the work; to add one, write that function and list it in
``SUBCOMMANDS``. Heavy imports (uvicorn, FastAPI) happen inside ``run``, so one subcommand
never pays for another's.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Callable, Sequence


def add_serve(subparsers: argparse._SubParsersAction) -> None:
    """Declare ``cachetier serve``: the sidecar (uvicorn + FastAPI over a TieredStore).

    Args:
        subparsers: the ``cachetier`` parser's subcommands.
    """
    p = subparsers.add_parser(
        "serve",
        help="serve the tiers over HTTP",
        description="Serve a TieredStore (CPU + disk under --data-dir, + Redis with --redis-url) "
        "over HTTP. Settings: a --config file, then CACHETIER_* variables, then these flags.",
    )
    p.add_argument("--config", help="a .toml or .json file of ServerConfig settings")
    p.add_argument("--host", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, help="port to listen on (default 8470)")
    p.add_argument("--data-dir", help="folder of the disk tier")
    p.add_argument("--redis-url", help="a Redis behind the server, redis://host:port/db")
    p.add_argument(
        "--open",
        action="store_true",
        default=None,
        dest="open_mode",
        help="accept requests without a token (local development only)",
    )
    p.add_argument("--log-level", choices=["critical", "error", "warning", "info", "debug"])
    p.set_defaults(run=run_serve)


def run_serve(args: argparse.Namespace) -> int:
    """Load the config, print it, and serve until SIGTERM/SIGINT (then flush and exit).

    Args:
        args: the parsed flags of ``serve``.

    Returns:
        The exit status: 0 after a clean stop, 1 if the server did not start, 2 for a bad
        configuration.
    """
    import uvicorn

    from cachetier.server.app import OPEN_MODE_WARNING, create_app
    from cachetier.server.config import load_config

    try:
        config = load_config(
            args.config,
            host=args.host,
            port=args.port,
            data_dir=args.data_dir,
            redis_url=args.redis_url,
            open_mode=args.open_mode,
            log_level=args.log_level,
        )
    except (OSError, ValueError, TypeError) as exc:
        print(f"cachetier serve: bad configuration: {exc}", file=sys.stderr)
        return 2
    print("cachetier serve: configuration (tokens hidden):", file=sys.stderr)
    print(json.dumps(config.describe(), indent=2, sort_keys=True), file=sys.stderr)
    if config.open_mode:
        banner = "!" * 78
        print(f"{banner}\n{OPEN_MODE_WARNING}\n{banner}", file=sys.stderr)
    sys.stderr.flush()
    # uvicorn sets up its own loggers only; ours (open-mode warning, flush at shutdown) too.
    logging.basicConfig(
        level=config.log_level.upper(), format="%(levelname)-9s %(name)s: %(message)s"
    )
    server = uvicorn.Server(
        uvicorn.Config(
            create_app(config),
            host=config.host,
            port=config.port,
            log_level=config.log_level,
            lifespan="on",
            # Requests in flight get this long to finish on SIGTERM; then the lifespan
            # flushes the write queues.
            timeout_graceful_shutdown=30,
            # Longer than the remote tier keeps idle connections (30 s), so a client never
            # reuses a connection the server has just closed.
            timeout_keep_alive=75,
            server_header=False,
        )
    )
    server.run()
    return 0 if server.started else 1


SUBCOMMANDS: Sequence[Callable[[argparse._SubParsersAction], None]] = (add_serve,)


def build_parser() -> argparse.ArgumentParser:
    """The ``cachetier`` parser with every subcommand of ``SUBCOMMANDS``."""
    parser = argparse.ArgumentParser(prog="cachetier", description="persistent KV-cache tiers")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add in SUBCOMMANDS:
        add(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``cachetier`` console script.

    Args:
        argv: the arguments (default ``sys.argv[1:]``).

    Returns:
        The exit status.
    """
    args = build_parser().parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
