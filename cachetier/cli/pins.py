"""``cachetier pin``, ``unpin`` and ``pins``: a sidecar's pins from the command line.

They talk to a running sidecar (``--url``) with the bearer token in ``$CACHETIER_REMOTE_TOKEN``
(the variable the remote tier and ``cachetier report --stats`` read); the token is sent, never
printed. Exit status 0 done, 1 refused or unreachable (the server's message is printed), 2 bad
arguments.
"""

from __future__ import annotations

import argparse
import json
import sys
import urllib.parse
from typing import Any

from cachetier.util.sidecar_http import TOKEN_ENV, call_sidecar


def add_pin(subparsers: argparse._SubParsersAction) -> None:
    """Declare ``cachetier pin``: keep blocks of a sidecar from eviction.

    Args:
        subparsers: the ``cachetier`` parser's subcommands.
    """
    p = subparsers.add_parser(
        "pin",
        help="pin blocks (a prompt's chain or keys) in a sidecar",
        description="Pin the chain of blocks of a token prefix, or blocks by key, in a running "
        "sidecar: they are never evicted (stored ones at once, the others once they arrive). "
        f"Token from ${TOKEN_ENV}.",
    )
    _block_args(p)
    p.set_defaults(run=lambda args: _run_change(args, "/v1/pins"))


def add_unpin(subparsers: argparse._SubParsersAction) -> None:
    """Declare ``cachetier unpin``: let pinned blocks of a sidecar be evicted again.

    Args:
        subparsers: the ``cachetier`` parser's subcommands.
    """
    p = subparsers.add_parser(
        "unpin",
        help="unpin blocks in a sidecar",
        description=f"Unpin blocks in a running sidecar. Token from ${TOKEN_ENV}.",
    )
    _block_args(p)
    p.set_defaults(run=lambda args: _run_change(args, "/v1/pins/delete"))


def add_pins(subparsers: argparse._SubParsersAction) -> None:
    """Declare ``cachetier pins``: list a sidecar's pins.

    Args:
        subparsers: the ``cachetier`` parser's subcommands.
    """
    p = subparsers.add_parser(
        "pins",
        help="list the pins of a sidecar",
        description="The pinned keys of the token's tenant (an admin tenant's token: every "
        f"tenant's, and each tier's pinned bytes). Token from ${TOKEN_ENV}.",
    )
    p.add_argument("--url", required=True, help="the sidecar, http(s)://host:port")
    p.add_argument("--tenant", help="one tenant's pins (admin tenants)")
    p.add_argument("--json", action="store_true", help="print the server's JSON answer")
    p.set_defaults(run=_run_list)


def _block_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", required=True, help="the sidecar, http(s)://host:port")
    p.add_argument(
        "--namespace",
        required=True,
        help="the namespace the engines store under (Namespace.id for --token-ids)",
    )
    p.add_argument("--tenant", help="another tenant's namespace (admin tenants only)")
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--keys", nargs="+", help="block keys, 64 hex digits each")
    what.add_argument("--token-ids", help="a token prefix: comma-separated ids, or @file")
    p.add_argument("--block-size", type=int, help="tokens per block (with --token-ids)")
    p.add_argument("--json", action="store_true", help="print the server's JSON answer")


def _token_ids(text: str) -> list[int]:
    if text.startswith("@"):
        with open(text[1:], encoding="utf-8") as f:
            text = f.read()
    try:
        return [int(v) for v in text.replace("\n", ",").split(",") if v.strip()]
    except ValueError:
        raise ValueError("--token-ids must be comma-separated integers") from None


def _run_change(args: argparse.Namespace, path: str) -> int:
    body: dict[str, Any] = {"namespace": args.namespace}
    if args.tenant:
        body["tenant"] = args.tenant
    if args.keys:
        body["keys"] = args.keys
    else:
        if args.block_size is None:
            print(f"cachetier {args.command}: --token-ids needs --block-size", file=sys.stderr)
            return 2
        try:
            body["token_ids"] = _token_ids(args.token_ids)
        except (OSError, ValueError) as exc:
            print(f"cachetier {args.command}: {exc}", file=sys.stderr)
            return 2
        body["block_size"] = args.block_size
    status, answer = call_sidecar(args.url.rstrip("/") + path, "POST", body)
    if status != 200:
        return _refused(args.command, status, answer)
    if args.json:
        print(json.dumps(answer, indent=1))
    elif "num_unpinned" in answer:
        print(f"unpinned {answer['num_unpinned']} block(s)")
    else:
        held = ", ".join(f"{tier} {n}" for tier, n in answer["protected"].items())
        print(
            f"pinned {len(answer['keys'])} block(s) of {answer['tenant']}/{answer['namespace']}"
            f" ({answer['num_new']} new); held and protected now: {held or 'no tier pins'}"
        )
    return 0


def _run_list(args: argparse.Namespace) -> int:
    path = "/v1/pins" + (
        f"?{urllib.parse.urlencode({'tenant': args.tenant})}" if args.tenant else ""
    )
    status, answer = call_sidecar(args.url.rstrip("/") + path, "GET")
    if status != 200:
        return _refused(args.command, status, answer)
    if args.json:
        print(json.dumps(answer, indent=1))
        return 0
    for entry in answer["pins"]:
        print(f"{entry['tenant']}/{entry['namespace']}: {len(entry['keys'])} pinned key(s)")
    for tier, figures in (answer.get("tiers") or {}).items():
        print(
            f"tier {tier}: {figures['pinned_blocks']} block(s), {figures['pinned_bytes']} of "
            f"{figures['max_pinned_bytes']} pinned bytes, {figures['pinned_waiting']} waiting"
        )
    return 0


def _refused(command: str, status: int, answer: Any) -> int:
    message = answer.get("message", answer) if isinstance(answer, dict) else answer
    print(f"cachetier {command}: {status or 'unreachable'}: {message}", file=sys.stderr)
    return 1
