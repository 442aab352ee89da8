"""The HTTP port's accept loop: it outlives every error an ``accept()`` can raise.

uvicorn leaves accepting to the event loop. uvloop closes a listening socket for good on an
error its accept callback reports (``ENOBUFS``, ``ENOMEM``, ``EMFILE`` when libuv's spare
descriptor is gone), without a line in the log; asyncio pauses it for a second. Here the server
accepts itself, on the event loop:

- a connection gets a place in the ``ConnectionTable`` first (caps, unauthenticated deadline),
  then its protocol; with TLS, its handshake runs under its own deadline and cap before uvicorn's
  protocol sees it;
- an accept that fails for want of descriptors or memory sheds the oldest unauthenticated
  connections and stops accepting for a bounded, doubling delay; any other error the same
  without the shedding. The listener is *down* until an accept works again (readiness says so);
- once a burst of connections has ended (a flood, TLS or plain), the memory it freed is given
  back to the system (``heap``).
"""

from __future__ import annotations

import asyncio
import errno
import logging
import socket
import ssl
import sys
from collections.abc import Callable

import uvicorn
from uvicorn.config import STARTUP_FAILURE

from cachetier.server.config import ServerConfig
from cachetier.server.connections import ConnectionTable, Entry
from cachetier.server.fairness import TenantWeights
from cachetier.server.fdlimits import ConnectionCaps, raise_nofile_limit
from cachetier.server.heap import HeapTrimmer
from cachetier.util.backoff import ExponentialBackoff

logger = logging.getLogger("cachetier.server.listener")
_uvicorn_logger = logging.getLogger("uvicorn.error")  # where uvicorn says where it listens
METRICS_STATE = "metrics"
"""The lifespan state entry of the app's ``ServerMetrics`` (told of the HTTP connections)."""
LISTENERS = "listeners"
"""The lifespan state entry ``GuardedServer`` puts its ``HttpAcceptor``s under (readiness)."""

DESCRIPTOR_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})
ACCEPT_BACKOFF = ExponentialBackoff(base_s=0.01, cap_s=1.0)
SHED_ON_EXHAUSTION = 16  # unauthenticated connections closed per accept out of descriptors
# Then the loop serves the connections it has. Small, so that connections shed to make room
# are closed before many more are accepted: a place freed in the table is a descriptor freed
# only once the connection's transport closes, a loop turn later.
_ACCEPTS_PER_WAKEUP = 16


class HttpAcceptor:
    """Accepts on one listening socket for the HTTP server (module docstring).

    Args:
        sock: the listening socket (made non-blocking here; closed by ``close``).
        table: the connection caps.
        make_protocol: the protocol of a connection, given its entry in ``table``.
        ssl_context: the server context for HTTPS; ``None`` for plain HTTP.
        tls_handshake_timeout_s: the whole TLS handshake must be done within this many seconds.
    """

    def __init__(
        self,
        sock: socket.socket,
        table: ConnectionTable,
        make_protocol: Callable[[Entry], asyncio.BaseProtocol],
        ssl_context: ssl.SSLContext | None,
        tls_handshake_timeout_s: float,
    ) -> None:
        self.sock = sock
        self.name = "http " + ":".join(str(part) for part in sock.getsockname()[:2])
        self._table = table
        self._make_protocol = make_protocol
        self._ssl = ssl_context
        self._handshake_timeout_s = tls_handshake_timeout_s
        self._loop = asyncio.get_running_loop()
        self._tasks: set[asyncio.Task[None]] = set()
        self._retry: asyncio.TimerHandle | None = None
        # Every connection that ends counts towards a burst; never trimmed mid-handshakes.
        self._heap = HeapTrimmer(self._loop, busy=lambda: table.num_handshakes > 0)
        table.on_leave = self._heap.note_ended
        self._num_failures = 0  # in a row
        self._closed = False
        self.up = True
        self.num_accept_errors = 0
        sock.setblocking(False)

    def start(self) -> None:
        """Accept from now on."""
        self._loop.add_reader(self.sock.fileno(), self._accept_some)

    def close(self) -> None:
        """Stop accepting and close the listening socket (uvicorn calls it at shutdown)."""
        if self._closed:
            return
        self._closed = True
        if self._retry is not None:
            self._retry.cancel()
        self._heap.close()
        self._loop.remove_reader(self.sock.fileno())
        self.sock.close()

    async def wait_closed(self) -> None:
        """What uvicorn awaits at shutdown: connections end through their protocols."""

    def _accept_some(self) -> None:
        for _ in range(_ACCEPTS_PER_WAKEUP):
            try:
                conn, _ = self.sock.accept()
            except (BlockingIOError, InterruptedError):
                self._working()
                return
            except ConnectionAbortedError:
                continue  # the client gave up before its accept: nothing to serve
            except OSError as exc:
                self._failed(exc)
                return
            self._working()
            self._admit(conn)

    def _working(self) -> None:
        if not self.up:
            logger.warning(
                "%s accepts again after %d failed accepts", self.name, self._num_failures
            )
        self.up = True
        self._num_failures = 0

    def _failed(self, exc: OSError) -> None:
        self.num_accept_errors += 1
        shed = 0
        if exc.errno in DESCRIPTOR_ERRNOS:
            # Out of descriptors: the ones of connections that have not said who they are
            # are the ones to give back first.
            shed = self._table.shed_oldest(SHED_ON_EXHAUSTION, "descriptors")
        if self.up:
            logger.warning("%s cannot accept (%s); shed %d unauthenticated", self.name, exc, shed)
        self.up = False
        self._loop.remove_reader(self.sock.fileno())
        delay_s = ACCEPT_BACKOFF.delay_s(self._num_failures)
        self._num_failures += 1
        self._retry = self._loop.call_later(delay_s, self._resume)

    def _resume(self) -> None:
        self._retry = None
        if self._closed:
            return
        self._loop.add_reader(self.sock.fileno(), self._accept_some)
        self._accept_some()  # nothing pending says it works again, as much as a connection

    def _admit(self, conn: socket.socket) -> None:
        entry = self._table.arrive()
        if entry is None:
            conn.close()  # every place is held by a client with a token
            return
        conn.setblocking(False)
        task = self._loop.create_task(self._connect(conn, entry))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

        def drop_unstarted(_reason: str) -> bool:
            # Shed before its task ran: nothing but this socket holds the connection, so its
            # descriptor goes back now (a flood's accepts would otherwise outrun the shedding).
            task.cancel()
            conn.close()
            return True

        entry.drop = drop_unstarted

    async def _connect(self, conn: socket.socket, entry: Entry) -> None:
        # Started: from here the socket is the transport's, which the handshake's drop or the
        # protocol's closes; a shed meanwhile leaves the entry, which the protocol checks.
        entry.drop = None
        protocol = self._make_protocol(entry)
        try:
            if self._ssl is None:
                await self._loop.connect_accepted_socket(lambda: protocol, conn)
                return
            task = asyncio.current_task()
            assert task is not None, "runs in a task"

            def drop(_reason: str) -> bool:
                # Cancelled, the handshake's transport is closed and its SSL state freed.
                task.cancel()
                return True

            entry.drop = drop
            self._table.begin_handshake(entry)
            try:
                # The protocol's connection_made runs once the handshake is done.
                await self._loop.connect_accepted_socket(
                    lambda: protocol,
                    conn,
                    ssl=self._ssl,
                    ssl_handshake_timeout=self._handshake_timeout_s,
                )
            finally:
                self._table.end_handshake(entry)
        except (OSError, ssl.SSLError, asyncio.TimeoutError, asyncio.CancelledError):
            # A failed or late handshake, a client gone, a shed connection: not an error of
            # the server's.
            conn.close()
            self._table.leave(entry)


class GuardedServer(uvicorn.Server):
    """uvicorn's server with its own accept loop (``HttpAcceptor``) and connection caps.

    Args:
        config: uvicorn's settings.
        settings: the sidecar's settings (address, caps, deadlines).
        ssl_context: serve HTTPS with this server context; ``None`` for plain HTTP.
    """

    def __init__(
        self, config: uvicorn.Config, settings: ServerConfig, ssl_context: ssl.SSLContext | None
    ) -> None:
        super().__init__(config)
        self.settings = settings
        self.ssl_context = ssl_context
        self.table: ConnectionTable | None = None
        self.port: int | None = None  # bound, once started

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await self.lifespan.startup()
        if self.lifespan.should_exit:
            sys.exit(STARTUP_FAILURE)
        settings, loop = self.settings, asyncio.get_running_loop()
        caps = ConnectionCaps.of(settings, raise_nofile_limit())
        weights = TenantWeights.of(settings)
        table = ConnectionTable(caps, settings.unauthenticated_timeout_s, loop, weights)
        self.table = table
        try:
            listen = (
                sockets[0]
                if sockets
                else socket.create_server(
                    (settings.host, settings.port), backlog=self.config.backlog
                )
            )
        except OSError as exc:
            _uvicorn_logger.error(exc)
            await self.lifespan.shutdown()
            sys.exit(STARTUP_FAILURE)
        state = self.lifespan.state

        def make_protocol(entry: Entry) -> asyncio.BaseProtocol:
            return self.config.http_protocol_class(  # type: ignore[call-arg]
                config=self.config,
                server_state=self.server_state,
                app_state=state,
                _loop=loop,
                table=table,
                entry=entry,
            )

        acceptor = HttpAcceptor(
            listen, table, make_protocol, self.ssl_context, settings.tls_handshake_timeout_s
        )
        self.servers = [acceptor]  # type: ignore[list-item]  # uvicorn close()s them
        state[LISTENERS] = [acceptor]
        metrics = state.get(METRICS_STATE)
        if metrics is not None:
            metrics.watch_http(table, [acceptor])
            if metrics.transfer is not None:
                # Its accept threads ask for descriptors back: shed on this loop's thread.
                def shed() -> None:
                    loop.call_soon_threadsafe(table.shed_oldest, SHED_ON_EXHAUSTION, "descriptors")

                metrics.transfer.on_descriptors_exhausted = shed
        acceptor.start()
        self.port = listen.getsockname()[1]
        _uvicorn_logger.info(
            "Uvicorn running on %s://%s:%d (Press CTRL+C to quit); at most %d connections, "
            "%d without a token",
            "https" if self.ssl_context is not None else "http",
            settings.host,
            self.port,
            caps.max_connections,
            caps.max_unauthenticated,
        )
        self.started = True
