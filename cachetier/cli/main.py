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
from typing import Any

from cachetier.cli.kv_events_keys import add_kv_events_keys
from cachetier.cli.pins import add_pin, add_pins, add_unpin
from cachetier.cli.quarantine import add_quarantine
from cachetier.cli.route import add_route
from cachetier.util.settings import add_flags, flag_values


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
    p.add_argument("--config", help="a .toml or .json file of settings (docs/configuration.md)")
    p.add_argument(
        "--ports-file",
        help="once every listener is bound, write the ports there as JSON, in one rename "
        '(e.g. {"http": 43121, "transfer": 40123, "unix": null}): with --port 0, a parent '
        "process waits for this file",
    )
    from cachetier.server.config import ServerConfig

    settings = p.add_argument_group(
        "settings", "one flag per setting of the sidecar and its store (tokens excepted)"
    )
    add_flags(settings, ServerConfig, aliases={"open_mode": ["--open"]})
    p.set_defaults(run=run_serve)


def serve_config(args: argparse.Namespace) -> Any:
    """The sidecar's settings: the ``--config`` file, then ``CACHETIER_*`` variables, then the
    flags (a value that does not parse is an error naming its flag).

    Args:
        args: the parsed flags of ``serve``.

    Returns:
        The ``cachetier.server.config.ServerConfig``.
    """
    from cachetier.server.config import ServerConfig, load_config

    return load_config(args.config, **flag_values(ServerConfig, args))


def run_serve(args: argparse.Namespace) -> int:
    """Load the config, print it, and serve until SIGTERM/SIGINT (then flush and exit).

    Args:
        args: the parsed flags of ``serve``.

    Returns:
        The exit status: 0 after a clean stop, 1 if the server did not start, 2 for a bad
        configuration.
    """
    from cachetier.cli.ports import run_reporting_ports
    from cachetier.server.app import OPEN_MODE_WARNING, create_app
    from cachetier.server.config import secrets_of
    from cachetier.server.httpserver import http_server
    from cachetier.util.redact import install_log_redaction, redact
    from cachetier.util.tls import server_context

    try:
        config = serve_config(args)
        # Read the certificate now: a bad one is a bad configuration, not a failed start.
        tls = server_context(config.tls_cert, config.tls_key) if config.tls_cert else None
    except (OSError, ValueError, TypeError) as exc:
        # The messages redact what they show; redact() again in case one of them did not.
        print(f"cachetier serve: bad configuration: {redact(str(exc))}", file=sys.stderr)
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
    # Our TLS context (cachetier.util.tls), the one the transfer port serves too.
    server = http_server(create_app(config), config, ssl_context=tls)
    # After uvicorn.Config (it sets up its loggers): every handler masks the tokens and the
    # Redis password, whatever logs them.
    install_log_redaction(secrets_of(config))
    run_reporting_ports(server, lambda: serve_ports(server), args.ports_file, "cachetier serve")
    return 0 if server.started else 1


def serve_ports(server: Any) -> dict[str, int | str | None]:
    """Where a started sidecar server listens (what ``--ports-file`` holds).

    Args:
        server: the ``http_server`` of ``create_app``, started.

    Returns:
        ``{"http": port, "transfer": port or None, "unix": socket path or None}``: the HTTP
        port, and the transfer port and Unix socket its lifespan bound (the ``BlockService``
        it yields knows their address).
    """
    from cachetier.cli.ports import bound_port

    transfer = server.lifespan.state["service"].transfer
    return {
        "http": bound_port(server),
        "transfer": None if transfer is None else transfer.port,
        "unix": None if transfer is None else transfer.socket_path,
    }


def add_report(subparsers: argparse._SubParsersAction) -> None:
    """Declare ``cachetier report``: hit-rate reports as HTML, JSON and a terminal summary.

    Args:
        subparsers: the ``cachetier`` parser's subcommands.
    """
    from cachetier.report.config import PREFILL_TOKENS_PER_S

    p = subparsers.add_parser(
        "report",
        help="hit-rate report of an event log, server stats or a trace replay",
        description="Hit rate over time, per tier and per tenant, prefill saved, tokens lost to "
        "block alignment and (for a trace) the capacity curve, as a self-contained HTML page, "
        "JSON and a terminal summary. Exit status 2 for a missing or corrupt input.",
    )
    src = p.add_argument_group("inputs (--trace or --events, and/or --stats)")
    src.add_argument("--trace", help="a Mooncake-format .jsonl trace to replay through real tiers")
    src.add_argument("--events", help="an event log written by a running engine or server")
    src.add_argument(
        "--stats",
        help="tier counters: a GET /v1/stats JSON file, or a server URL http://host:port "
        "(token from $CACHETIER_REMOTE_TOKEN)",
    )
    out = p.add_argument_group("outputs")
    out.add_argument("--out", default="report.html", help="the HTML page (default report.html)")
    out.add_argument("--json-out", help="the same figures as JSON")
    out.add_argument("--png-out", help="every plot on one PNG (a picture of the report)")
    out.add_argument("--quiet", action="store_true", help="no progress bar")
    _add_replay_flags(p.add_argument_group("trace replay"))
    p.add_argument(
        "--prefill-tokens-per-s",
        type=float,
        default=PREFILL_TOKENS_PER_S,
        help=f"prefill speed for seconds saved (default {PREFILL_TOKENS_PER_S:.1f}: SmolLM2 "
        "in fp32 on two CPU cores; give your server's own)",
    )
    p.add_argument("--bin-s", type=float, help="seconds per time bin (default: about 60 bins)")
    p.set_defaults(run=run_report)


def _add_replay_flags(rep: argparse._ArgumentGroup) -> None:
    """The trace-replay flags of ``cachetier report``."""
    from cachetier.report.config import (
        CURVE_CAPACITIES,
        DEFAULT_NUM_WORKERS,
        DEFAULT_POLICY,
        TRACE_BLOCK_SIZE,
    )

    rep.add_argument("--cpu-blocks", type=int, default=10_000, help="fast tier (default 10000)")
    rep.add_argument("--disk-blocks", type=int, default=50_000, help="slow tier (default 50000)")
    rep.add_argument(
        "--block-size",
        type=int,
        default=TRACE_BLOCK_SIZE,
        help=f"tokens per hash id of the trace (default {TRACE_BLOCK_SIZE}, Mooncake's)",
    )
    rep.add_argument(
        "--pool-blocks",
        type=int,
        default=0,
        help="the engine's own KV pool above the tiers, in blocks (default 0: not modelled)",
    )
    rep.add_argument(
        "--guard-first-hits",
        type=int,
        default=0,
        help="model the restore guard: the first N hits of each tier are computed, not "
        "loaded (engines with the guard on: 1; default 0: not modelled)",
    )
    rep.add_argument(
        "--in-flight",
        type=int,
        default=1,
        help="with --pool-blocks: requests the engine serves at once, whose blocks it holds "
        "(default 1)",
    )
    rep.add_argument(
        "--policy",
        default=DEFAULT_POLICY,
        help=f"eviction policy of both tiers (default {DEFAULT_POLICY})",
    )
    rep.add_argument(
        "--tenants",
        type=int,
        default=1,
        help="synthetic tenants the conversations are spread over (default 1)",
    )
    rep.add_argument(
        "--capacities",
        type=_int_list,
        default=CURVE_CAPACITIES,
        help="capacity curve points in blocks, comma-separated (the tier sizes are added)",
    )
    rep.add_argument(
        "--curve-policies", type=_str_list, help="policies on the curve (default: all)"
    )
    rep.add_argument(
        "--admission-policies",
        type=_policy_list,
        help="admission policies replayed against store-all at each disk capacity of the curve "
        "from --cpu-blocks up, comma-separated (default: all of them; 'none' skips them)",
    )
    rep.add_argument(
        "--exact",
        action="store_true",
        help="replay the curve and the admission policies on every key (default: on a hashed "
        "sample of keys sized for half a point of error)",
    )
    rep.add_argument(
        "--jobs",
        type=int,
        default=DEFAULT_NUM_WORKERS,
        help=f"processes replaying the curve (default {DEFAULT_NUM_WORKERS})",
    )


def _int_list(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected integers like 1000,10000, got {text!r}"
        ) from None


def _str_list(text: str) -> tuple[str, ...]:
    return tuple(v.strip() for v in text.split(",") if v.strip())


def _policy_list(text: str) -> tuple[str, ...]:
    return () if text.strip().lower() == "none" else _str_list(text)


def run_report(args: argparse.Namespace) -> int:
    """Build the report, write the page (and JSON, PNG), print the summary.

    Args:
        args: the parsed flags of ``report``.

    Returns:
        The exit status: 0 written, 1 an output could not be written, 2 bad input.
    """
    import dataclasses
    import time
    from pathlib import Path

    start = time.perf_counter()

    try:
        from cachetier.report.build import build_report
        from cachetier.report.config import ReportConfig
        from cachetier.report.html import render_html
        from cachetier.report.plots import render_composite
        from cachetier.report.summary import render_summary
    except ImportError as exc:
        print(
            f"cachetier report: needs the report extra ({exc.name}): "
            "pip install 'cachetier[report]'",
            file=sys.stderr,
        )
        return 1

    if args.png_out and not (args.trace or args.events):
        print(
            "cachetier report: --png-out needs --trace or --events (stats alone are a table)",
            file=sys.stderr,
        )
        return 2
    fields = {f.name for f in dataclasses.fields(ReportConfig)}
    given = {k: v for k, v in vars(args).items() if k in fields and v is not None}
    given.update(num_tenants=args.tenants, num_workers=args.jobs)
    try:
        config = ReportConfig(**given)
        doc = build_report(config)
    except ValueError as exc:
        print(f"cachetier report: {exc}", file=sys.stderr)
        return 2
    written = []
    try:
        for path in (args.out, args.json_out, args.png_out):
            if path:
                Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(render_html(doc), encoding="utf-8")
        written.append(args.out)
        if args.json_out:
            Path(args.json_out).write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")
            written.append(args.json_out)
        if args.png_out:
            title = f"cachetier report: {Path(config.trace or config.events or '').name}"
            Path(args.png_out).write_bytes(render_composite(doc["figures"], title))
            written.append(args.png_out)
    except OSError as exc:
        print(f"cachetier report: cannot write {exc.filename}: {exc.strerror}", file=sys.stderr)
        return 1
    sys.stdout.write(render_summary(doc))
    print(f"  wrote {', '.join(written)} ({time.perf_counter() - start:.1f} s in all)")
    return 0


SUBCOMMANDS: Sequence[Callable[[argparse._SubParsersAction], None]] = (
    add_serve,
    add_report,
    add_pin,
    add_unpin,
    add_pins,
    add_quarantine,
    add_route,
    add_kv_events_keys,
)


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
