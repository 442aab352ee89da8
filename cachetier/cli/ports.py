"""``--ports-file``: where a server started with ``--port 0`` really listens.

A parent process (a test, a supervisor) starts a server on port 0, so the OS picks a port no
one holds, and waits for the ports file: it is written once every listener is bound, in one
rename, so a reader sees the whole file or none. Reserving a port by binding and closing it
would race with every other program on the machine; this does not.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Protocol

# The ports a server reports: "http", "transfer" (TCP ports) and "unix" (a socket path), each
# ``None`` where the server has no such listener.
Ports = Mapping[str, int | str | None]

# How often the waiter looks whether the server has bound its listeners: uvicorn offers no
# hook between binding and serving, and this wait happens once, at start.
_STARTED_POLL_S = 0.005


class _Listening(Protocol):
    """What ``serve_reporting_ports`` needs of a server (``uvicorn.Server`` has it)."""

    started: bool
    should_exit: bool
    servers: list[Any]
    config: Any

    async def serve(self) -> None: ...


def write_ports_file(path: str | Path, ports: Ports) -> None:
    """Write ``ports`` as JSON to ``path`` atomically: a temporary file in the same folder,
    flushed to disk, then renamed over ``path``.

    Args:
        path: the file to write (its folder must exist).
        ports: what to write, e.g. ``{"http": 43121, "transfer": 40123, "unix": None}``.
    """
    target = Path(path)
    fd, temporary = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as out:
            json.dump(dict(ports), out, sort_keys=True)
            out.write("\n")
            out.flush()
            os.fsync(out.fileno())
        os.replace(temporary, target)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise


def bound_port(server: _Listening) -> int:
    """The TCP port a started uvicorn server listens on (the one port 0 became).

    Args:
        server: a ``uvicorn.Server`` whose ``started`` is true.

    Returns:
        The port.
    """
    # The sidecar's server accepts on its own loop and keeps the port it bound; a plain
    # uvicorn.Server has asyncio servers and their sockets.
    port = getattr(server, "port", None)
    if isinstance(port, int):
        return port
    return int(server.servers[0].sockets[0].getsockname()[1])


async def serve_reporting_ports(
    server: _Listening, ports_of: Callable[[], Ports], path: str | Path | None, name: str
) -> None:
    """Serve ``server`` until it stops; once it listens, print its ports on stderr and write
    them to ``path`` (when given).

    Args:
        server: a ``uvicorn.Server`` (not yet started).
        ports_of: the ports to report, called once the server has started.
        path: the ports file, or ``None`` for none.
        name: the program, as the printed line names it.
    """
    serving = asyncio.ensure_future(server.serve())
    while not (server.started or serving.done()):
        await asyncio.sleep(_STARTED_POLL_S)
    if server.started:
        try:
            ports = ports_of()
            listening = ", ".join(f"{kind} {where}" for kind, where in ports.items() if where)
            print(f"{name}: listening on {listening}", file=sys.stderr, flush=True)
            if path is not None:
                write_ports_file(path, ports)
        except BaseException:
            # A parent waits for the file: stop serving rather than serve unannounced.
            server.should_exit = True
            await asyncio.wait([serving])
            raise
    await serving


def run_reporting_ports(
    server: _Listening, ports_of: Callable[[], Ports], path: str | Path | None, name: str
) -> None:
    """``server.run()`` that reports its ports (``serve_reporting_ports``), on the event loop
    uvicorn would pick.

    Args:
        server: a ``uvicorn.Server`` (not yet started).
        ports_of: the ports to report, called once the server has started.
        path: the ports file, or ``None`` for none.
        name: the program, as the printed line names it.
    """
    factory = server.config.get_loop_factory()
    loop = factory() if factory is not None else asyncio.new_event_loop()
    try:
        loop.run_until_complete(serve_reporting_ports(server, ports_of, path, name))
    finally:
        loop.run_until_complete(loop.shutdown_asyncgens())
        loop.close()


def exit_cleanly_after_graceful_stop() -> None:
    """Make a SIGTERM or SIGINT that uvicorn has turned into a graceful stop end the process
    with status 0: uvicorn restores the handlers it found and raises the signal again once
    requests in flight finished and the lifespan ended, and supervisors and `docker compose
    stop` read a death by signal as a failure."""
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _exit_zero)


def _exit_zero(signum: int, frame: object) -> None:
    raise SystemExit(0)
