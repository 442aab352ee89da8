"""``cachetier quarantine list`` and ``lift``: a sidecar's quarantines from the command line.

A quarantine is a namespace a tier no longer serves because a verified restore from it did not
match a recomputation (``cachetier.guard``). Listing shows the token's tenant's (an admin
tenant's token: every tenant's); lifting is for admin tenants. The token is read from
``$CACHETIER_REMOTE_TOKEN``, sent and never printed. Exit status 0 done, 1 refused or
unreachable, 2 bad arguments.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from cachetier.util.sidecar_http import TOKEN_ENV, call_sidecar


def add_quarantine(subparsers: argparse._SubParsersAction) -> None:
    """Declare ``cachetier quarantine {list,lift}``.

    Args:
        subparsers: the ``cachetier`` parser's subcommands.
    """
    p = subparsers.add_parser(
        "quarantine",
        help="list or lift a sidecar's quarantined namespaces",
        description="Namespaces a sidecar's tiers no longer serve, because a verified restore "
        f"did not match its recomputation. Token from ${TOKEN_ENV}.",
    )
    actions = p.add_subparsers(dest="action", required=True)
    listing = actions.add_parser("list", help="the quarantines the token may see")
    listing.add_argument("--url", required=True, help="the sidecar, http(s)://host:port")
    listing.add_argument("--json", action="store_true", help="print the server's JSON answer")
    listing.set_defaults(run=_run_list)
    lift = actions.add_parser("lift", help="end a namespace's quarantines (admin tenants)")
    lift.add_argument("--url", required=True, help="the sidecar, http(s)://host:port")
    lift.add_argument("--namespace", required=True, help="the namespace, as its clients name it")
    lift.add_argument("--tenant", help="whose namespace (default: the token's tenant)")
    lift.add_argument("--tier", help="one tier only (default: every tier)")
    lift.add_argument("--json", action="store_true", help="print the server's JSON answer")
    lift.set_defaults(run=_run_lift)


def _run_list(args: argparse.Namespace) -> int:
    status, answer = call_sidecar(args.url.rstrip("/") + "/v1/quarantines", "GET")
    if status != 200:
        return _refused("list", status, answer)
    if args.json:
        print(json.dumps(answer, indent=1))
    elif not answer["quarantines"]:
        print("no quarantines")
    for q in [] if args.json else answer["quarantines"]:
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(q["since_unix_s"]))
        print(f"{q['tenant']}/{q['namespace']} in {q['tier']} since {since} UTC: {q['reason']}")
    return 0


def _run_lift(args: argparse.Namespace) -> int:
    body: dict[str, Any] = {"namespace": args.namespace}
    for name in ("tenant", "tier"):
        if getattr(args, name):
            body[name] = getattr(args, name)
    url = args.url.rstrip("/") + "/v1/quarantines/lift"
    status, answer = call_sidecar(url, "POST", body)
    if status != 200:
        return _refused("lift", status, answer)
    if args.json:
        print(json.dumps(answer, indent=1))
    else:
        tiers = sorted(q["tier"] for q in answer["quarantines"])
        print(f"lifted {len(tiers)} quarantine(s): {', '.join(tiers) or 'none was held'}")
    return 0


def _refused(action: str, status: int, answer: Any) -> int:
    message = answer.get("message", answer) if isinstance(answer, dict) else answer
    print(f"cachetier quarantine {action}: {status or 'unreachable'}: {message}", file=sys.stderr)
    return 1
