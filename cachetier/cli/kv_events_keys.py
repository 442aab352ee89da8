"""``cachetier kv-events-keys``: the CURVE certificates that let chosen readers follow KV events.

It writes what ``zmq.auth.create_certificates`` writes, one pair per name, into a folder:
``publisher.key`` / ``publisher.key_secret`` for the publishers (engines, a sidecar), and
``<client>.key`` / ``<client>.key_secret`` per reader (``router`` unless told), with a copy
of each reader's public certificate in ``clients/``, the folder a publisher allows. Secret
files are mode 0600; an existing file is never overwritten (exit status 1, nothing written).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

PUBLISHER = "publisher"
CLIENTS_DIR = "clients"
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")


def add_kv_events_keys(subparsers: argparse._SubParsersAction) -> None:
    """Declare ``cachetier kv-events-keys``.

    Args:
        subparsers: the ``cachetier`` parser's subcommands.
    """
    p = subparsers.add_parser(
        "kv-events-keys",
        help="make the CURVE certificates of KV events (publisher and readers)",
        description="Write a publisher certificate and one per reader into DIR, and the "
        "readers' public certificates into DIR/clients. Publisher: --kv-events-curve-key "
        "DIR/publisher.key_secret --kv-events-curve-clients DIR/clients (the sidecar: "
        "kv_events_curve_key, kv_events_curve_clients). Router: --events-curve-key "
        "DIR/router.key_secret --events-curve-server-key DIR/publisher.key. Existing files are "
        "never overwritten.",
    )
    p.add_argument("dir", metavar="DIR", help="the folder to write into (made if missing)")
    p.add_argument(
        "--clients",
        nargs="+",
        default=["router"],
        metavar="NAME",
        help="the readers to make certificates for (default: router)",
    )
    p.set_defaults(run=run_kv_events_keys)


def check_names(clients: Sequence[str]) -> tuple[str, ...]:
    """The readers' names, checked.

    Args:
        clients: one name per reader.

    Returns:
        The names, as a tuple.

    Raises:
        ValueError: a name is not 1-64 of ``[A-Za-z0-9_-]``, is ``publisher``, or is repeated.
    """
    names = tuple(clients)
    for name in names:
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise ValueError(f"client name {name!r} must be 1-64 of [A-Za-z0-9_-]")
    if PUBLISHER in names:
        raise ValueError(f"{PUBLISHER!r} names the publisher's certificate: pick another name")
    if len(set(names)) != len(names):
        raise ValueError(f"client names must differ, got {list(names)}")
    return names


def planned_files(folder: Path, clients: Sequence[str]) -> list[Path]:
    """Every file ``write_keys`` writes into ``folder``."""
    out = []
    for name in (PUBLISHER, *clients):
        out += [folder / f"{name}.key", folder / f"{name}.key_secret"]
    out += [folder / CLIENTS_DIR / f"{name}.key" for name in clients]
    return out


def write_keys(folder: str | os.PathLike[str], clients: Sequence[str]) -> list[Path]:
    """Make the publisher's certificate and one per reader in ``folder``.

    Args:
        folder: where to write (made, mode 0700, if missing).
        clients: the readers' names (``check_names``).

    Returns:
        The files written.

    Raises:
        ValueError: a bad name.
        FileExistsError: one of the files exists (then nothing is written).
    """
    import zmq.auth

    names = check_names(clients)
    root = Path(folder)
    wanted = planned_files(root, names)
    taken = [str(p) for p in wanted if p.exists() or p.is_symlink()]
    if taken:
        raise FileExistsError(f"refusing to overwrite {', '.join(taken)}")
    (root / CLIENTS_DIR).mkdir(mode=0o700, parents=True, exist_ok=True)
    # Made in a private folder beside the targets, then linked into place: a secret is never
    # readable by others, and a file that appeared meanwhile is not replaced (link refuses).
    staging = Path(tempfile.mkdtemp(prefix=".kv-events-keys-", dir=root))
    written: list[Path] = []
    try:
        for name in (PUBLISHER, *names):
            public, secret = (Path(p) for p in zmq.auth.create_certificates(staging, name))
            os.chmod(secret, 0o600)
            os.chmod(public, 0o644)
            written += _link(public, root / public.name)
            written += _link(secret, root / secret.name)
            if name != PUBLISHER:
                written += _link(public, root / CLIENTS_DIR / public.name)
    except BaseException:
        for path in written:
            path.unlink(missing_ok=True)
        raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return written


def _link(source: Path, target: Path) -> list[Path]:
    os.link(source, target)
    return [target]


def run_kv_events_keys(args: argparse.Namespace) -> int:
    """Write the certificates and say which file goes where.

    Returns:
        0 written, 1 a file exists or cannot be written, 2 a bad name.
    """
    try:
        written = write_keys(args.dir, args.clients)
    except ValueError as exc:
        print(f"cachetier kv-events-keys: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"cachetier kv-events-keys: {exc}", file=sys.stderr)
        return 1
    root = Path(args.dir)
    for path in written:
        print(path)
    print(
        f"publisher: --kv-events-curve-key {root / (PUBLISHER + '.key_secret')} "
        f"--kv-events-curve-clients {root / CLIENTS_DIR}",
        file=sys.stderr,
    )
    for name in args.clients:
        print(
            f"{name}: --events-curve-key {root / (name + '.key_secret')} "
            f"--events-curve-server-key {root / (PUBLISHER + '.key')}",
            file=sys.stderr,
        )
    return 0
