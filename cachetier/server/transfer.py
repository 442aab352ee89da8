"""The sidecar's block transfer port: batch gets and puts without HTTP (``transfer_frames``).

It listens on a TCP port, a Unix socket (for engines on the same host), or both. One thread per
connection, blocking sockets; ``transfer_requests`` serves each request. Socket waits release
the GIL, so transfers on several connections overlap each other and the HTTP event loop.

Connections past their hello are bounded by ``max_connections``, those before it by
``max_unauthenticated`` (``admission``). A hello must arrive whole within ``hello_timeout_s``, a
request's head within ``head_timeout_s`` of its first byte, its records (and its answer go out)
within ``body_timeout_s`` after that: deadlines for the whole, kept by a ``watchdog`` that shuts
the connection down, not socket timeouts that a byte now and then renews. A connection idle
longer than ``idle_timeout_s`` is closed, and so is one that stalls for ``io_timeout_s`` in one
read or write.

TLS. Given a server context, the TCP port speaks only TLS (``/v1/limits`` says so, and a client
of an https URL never sends its token to a plaintext port); the Unix socket stays plaintext,
local and guarded by its folder's permissions. The handshake runs on the connection's thread
under one deadline (``sockets.accept_tls``), so a client that never completes it cannot hold up
the accept loop. ``BUSY`` is sent inside TLS too: a connection refused for want of a slot gets
its handshake (on a short-lived thread of its own, a few at a time) and then the answer, so its
client reports that the server is busy, not that the certificate failed.

Accepting. An accept loop survives every error: one that fails for want of descriptors or memory
(``EMFILE``, ``ENFILE``, ``ENOBUFS``, ``ENOMEM``, a ``dup`` included) asks the HTTP port to shed
its oldest unauthenticated connections (``on_descriptors_exhausted``) and waits a bounded,
doubling delay before it accepts again; any other error the same without the shedding. A
listener is *down* while it waits (``listener_status``; readiness says so).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import secrets
import socket
import ssl
import stat
import struct
import threading
import time
from collections.abc import Callable

from cachetier.protocol.sockets import UNIX_SEND_BUFFER_BYTES, BufferedSocket, accept_tls
from cachetier.protocol.transfer_frames import (
    HELLO,
    MAGIC,
    MAX_TENANT_BYTES,
    MAX_TOKEN_BYTES,
    REPLY,
    REQUEST,
    Status,
    TransferAddress,
    error_reply,
)
from cachetier.server.admission import Admission, Ticket
from cachetier.server.auth import AuthFailure
from cachetier.server.service import BlockService
from cachetier.server.transfer_requests import Refused, TransferRequests
from cachetier.server.watchdog import Deadline, Watchdog
from cachetier.util.backoff import ExponentialBackoff

logger = logging.getLogger("cachetier.server.transfer")

DESCRIPTOR_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})
ACCEPT_BACKOFF = ExponentialBackoff(base_s=0.01, cap_s=1.0)


class TransferServer:
    """Serves a ``BlockService`` on its own TCP port, Unix socket, or both.

    Args:
        service: the server's blocks, tenants and tokens.
        host: address of the TCP port.
        port: TCP port to listen on (0 picks a free one; ``port`` says which after
            ``start``), or ``None`` for none.
        socket_path: Unix socket to listen on (a stale one there is replaced), or ``None``.
        max_connections: most connections served at once past their hello; more are
            answered ``BUSY``.
        max_unauthenticated: most connections held before their hello (``admission``).
        hello_timeout_s: the whole hello, TLS handshake included, must arrive within this many
            seconds of the accept.
        head_timeout_s: a request's whole head (its keys or record lengths included) must
            arrive within this many seconds of its first byte.
        body_timeout_s: its records must arrive, and its answer be sent, within this many
            seconds of its head.
        idle_timeout_s: longest wait for the next request on a connection, in seconds.
        io_timeout_s: longest wait for one read or write inside a request, in seconds.
        tls: server context of the TCP port (``cachetier.util.tls.server_context``); ``None`` for
            plain TCP. The Unix socket is plaintext either way.
    """

    def __init__(
        self,
        service: BlockService,
        host: str,
        port: int | None,
        socket_path: str | None = None,
        *,
        max_connections: int = 64,
        max_unauthenticated: int = 8,
        hello_timeout_s: float = 5.0,
        head_timeout_s: float = 10.0,
        body_timeout_s: float = 60.0,
        idle_timeout_s: float = 75.0,
        io_timeout_s: float = 30.0,
        tls: ssl.SSLContext | None = None,
    ) -> None:
        self._service = service
        self._tls = tls
        if port is None and socket_path is None:
            raise ValueError("a transfer server needs a port, a socket path or both")
        self._host = host
        self.port = port
        self.socket_path = socket_path
        self.server_id = secrets.randbits(32)
        self._idle_timeout_s = idle_timeout_s
        self._io_timeout_s = io_timeout_s
        self._hello_timeout_s = hello_timeout_s
        self._head_timeout_s = head_timeout_s
        self._requests = TransferRequests(service, body_timeout_s)
        self.admission = Admission(
            max_connections, max_unauthenticated, service.tokens.shares.weights
        )
        # Deadlines for whole hellos and requests (a socket timeout bounds one read only).
        self._watchdog = Watchdog("cachetier-transfer-deadlines")
        self._listeners: list[socket.socket] = []
        self._accepting: list[threading.Thread] = []
        self._status: dict[int, list] = {}  # listener fd -> [name, up, failed accepts]
        # Refusals over TLS (a handshake, then BUSY) at once; more are closed unanswered.
        self._refusals = threading.BoundedSemaphore(max_unauthenticated)
        self.on_descriptors_exhausted: Callable[[], None] | None = None
        """Called (on an accept thread) when an accept ran out of descriptors: the HTTP port
        sheds its oldest unauthenticated connections (``httpserver.GuardedServer``)."""
        self._conns: set[socket.socket] = set()
        self._threads: set[threading.Thread] = set()
        self._lock = threading.Lock()
        self._stopping = threading.Event()

    def start(self) -> TransferAddress:
        """Listen, and accept in background threads; returns where."""
        try:
            if self.port is not None:
                tcp = socket.create_server((self._host, self.port), backlog=128)
                self._listeners.append(tcp)
                self.port = tcp.getsockname()[1]
            if self.socket_path is not None:
                self._listeners.append(_listen_unix(self.socket_path))
        except BaseException:
            for listener in self._listeners:
                listener.close()
            raise
        for listener in self._listeners:
            name = "transfer " + str(listener.getsockname() or self.socket_path)
            self._status[listener.fileno()] = [name, True, 0]
            thread = threading.Thread(
                target=self._accept_loop,
                args=(listener,),
                name="cachetier-transfer-accept",
                daemon=True,
            )
            thread.start()
            self._accepting.append(thread)
        where = [f"{self._host}:{self.port}" if self.port is not None else "", self.socket_path]
        logger.info("cachetier block transfer on %s", " and ".join(filter(None, where)))
        tls = self._tls is not None and self.port is not None
        return TransferAddress(self.port, self.socket_path, self.server_id, tls=tls)

    def stop(self, timeout_s: float = 30.0) -> None:
        """Stop accepting, close every connection, and wait for requests in flight (their
        stores complete; only their replies are lost)."""
        self._stopping.set()
        for listener in self._listeners:
            try:  # wakes its accepting thread: close() alone leaves it blocked, the port bound
                listener.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass  # not connected in some kernels' view; close() below still frees it
            listener.close()
        if self.socket_path is not None and self._listeners:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.socket_path)
        self._listeners = []
        with self._lock:
            conns, threads = list(self._conns), list(self._threads)
        for conn in conns:
            try:
                # socket.socket's shutdown, also for a TLS socket: SSLSocket.shutdown would drop
                # its TLS state under the thread still reading from it.
                socket.socket.shutdown(conn, socket.SHUT_RDWR)
            except OSError:
                pass  # already closed by its peer
        for thread in [*self._accepting, *threads]:
            thread.join(timeout_s)
        self._watchdog.stop()

    def listener_status(self) -> list[tuple[str, bool, int]]:
        """(name, accepting now, failed accepts so far) of each listener."""
        with self._lock:
            return [(name, up, errors) for name, up, errors in self._status.values()]

    def _accept_loop(self, listener: socket.socket) -> None:
        status = self._status[listener.fileno()]
        num_failures = 0
        while not self._stopping.is_set():
            try:
                self._accept_one(listener)
            except OSError as exc:
                if self._stopping.is_set():
                    return  # the listener was closed: stop() was called
                num_failures += 1
                with self._lock:
                    status[1] = False
                    status[2] += 1
                if exc.errno in DESCRIPTOR_ERRNOS and self.on_descriptors_exhausted is not None:
                    self.on_descriptors_exhausted()
                if num_failures == 1:
                    logger.warning("%s cannot accept (%s); backing off", status[0], exc)
                self._stopping.wait(ACCEPT_BACKOFF.delay_s(num_failures - 1))
                continue
            if num_failures:
                logger.warning("%s accepts again after %d failures", status[0], num_failures)
                num_failures = 0
                with self._lock:
                    status[1] = True

    def _accept_one(self, listener: socket.socket) -> None:
        """Accept one connection and start its thread; raises what an accept (or the dup of
        its admission ticket, or a thread's start) raised, the connection closed."""
        sock, _ = listener.accept()
        try:
            ticket = self.admission.arrive(sock)  # dups the socket: may run out of descriptors
        except BaseException:
            sock.close()
            raise
        if ticket is None:
            self._refuse_busy(sock)
            return
        thread = threading.Thread(
            target=self._serve, args=(sock, ticket), name="cachetier-transfer", daemon=True
        )
        with self._lock:
            self._conns.add(sock)
            self._threads.add(thread)
        try:
            thread.start()
        except BaseException:  # no thread to be had (RuntimeError): the connection ends
            with self._lock:
                self._conns.discard(sock)
                self._threads.discard(thread)
            self.admission.leave(ticket)
            sock.close()
            raise OSError(errno.ENOMEM, "cannot start a connection thread") from None

    def _refuse_busy(self, sock: socket.socket) -> None:
        """Answer ``BUSY`` and close: in plaintext, or inside TLS on a TLS port (on a thread
        of its own, since it waits for the handshake; closed unanswered when too many wait)."""
        reply = error_reply(Status.BUSY, "too many connections")
        if self._tls is None or sock.family == socket.AF_UNIX:
            _send_and_close(sock, reply)
            return
        if not self._refusals.acquire(blocking=False):
            sock.close()
            return
        thread = threading.Thread(
            target=self._refuse_in_tls,
            args=(sock, reply),
            name="cachetier-transfer-busy",
            daemon=True,
        )
        try:
            thread.start()
        except BaseException:
            self._refusals.release()
            sock.close()
            raise

    def _refuse_in_tls(self, sock: socket.socket, reply: bytes) -> None:
        assert self._tls is not None, "a TLS port"
        try:
            tls = accept_tls(sock, self._tls, time.monotonic() + self._hello_timeout_s)
        except (OSError, ValueError):
            return  # accept_tls closed it
        finally:
            self._refusals.release()
        _send_and_close(tls, reply, linger_s=1.0)

    def _serve(self, sock: socket.socket, ticket: Ticket) -> None:
        def shut() -> None:
            self.admission.shut(ticket)

        # One deadline for the whole hello, the TLS handshake included: not a timeout per read
        # that a byte now and then renews.
        hello_deadline = time.monotonic() + self._hello_timeout_s
        deadline = Deadline(self._watchdog, shut)
        deadline.start(self._hello_timeout_s)
        io = BufferedSocket(sock)
        try:
            # In the try: a client that reset its connection already fails these.
            if sock.family == socket.AF_UNIX:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, UNIX_SEND_BUFFER_BYTES)
            else:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.settimeout(self._io_timeout_s)
            if self._tls is not None and sock.family != socket.AF_UNIX:
                sock = self._start_tls(sock, hello_deadline)
                io = BufferedSocket(sock)
            tenant = self._hello(io, ticket)
            deadline.stop()
            while not self._stopping.is_set():
                sock.settimeout(self._idle_timeout_s)
                first = io.read_exactly(1)
                deadline.start(self._head_timeout_s)  # from the request's first byte
                sock.settimeout(self._io_timeout_s)
                head = first + io.read_exactly(REQUEST.size - 1)
                try:
                    io.send(self._requests.serve(io, deadline, tenant, *REQUEST.unpack(head)))
                except Refused as refused:
                    io.send([error_reply(refused.status, refused.message)])
                    if refused.close:
                        return
                    if refused.hold_s > 0 and self._stopping.wait(refused.hold_s):
                        return
                deadline.stop()
        except Refused as refused:  # at hello
            _send_quietly(io, error_reply(refused.status, refused.message))
        except (OSError, struct.error):
            pass  # the client went away or stalled: nothing to answer
        except Exception:
            logger.exception("block transfer connection failed")
            _send_quietly(io, error_reply(Status.FAILED, "the server failed; see its log"))
        finally:
            deadline.stop()
            io.close()
            self.admission.leave(ticket)
            with self._lock:
                self._conns.discard(sock)
                self._threads.discard(threading.current_thread())

    def _start_tls(self, sock: socket.socket, deadline: float) -> ssl.SSLSocket:
        """TLS on an accepted TCP connection (its thread): the TLS socket replaces the plain
        one in ``_conns``, so ``stop`` shuts the one in use down."""
        assert self._tls is not None, "TLS is configured"
        # The handshake is part of the hello: it gets the hello's time, not a second budget.
        with self._lock:
            self._conns.discard(sock)  # wrapping detaches it
        tls = accept_tls(sock, self._tls, deadline)  # closes the connection if it fails
        tls.settimeout(self._io_timeout_s)
        with self._lock:
            if not self._stopping.is_set():  # else stop() has run and did not see this one
                self._conns.add(tls)
                return tls
        tls.close()
        raise ConnectionAbortedError("the transfer server is stopping")

    def _hello(self, io: BufferedSocket, ticket: Ticket) -> str:
        magic, token_len, tenant_len = HELLO.unpack(io.read_exactly(HELLO.size))
        if magic != MAGIC:
            raise Refused(Status.BAD_REQUEST, f"expected {MAGIC!r}, this is not a transfer client")
        if token_len > MAX_TOKEN_BYTES or tenant_len > MAX_TENANT_BYTES:
            raise Refused(Status.BAD_REQUEST, "token or tenant too long")
        token = io.read_exactly(token_len).decode("utf-8", "surrogateescape") or None
        claimed = io.read_exactly(tenant_len).decode("utf-8", "replace") or None
        try:
            tenant = self._service.tokens.resolve(token, claimed)
        except AuthFailure as exc:
            status = Status.UNAUTHORIZED if exc.status == 401 else Status.FORBIDDEN
            raise Refused(status, exc.message) from None
        if not self.admission.promote(ticket, tenant):
            raise Refused(Status.BUSY, f"too many connections for tenant {tenant}")
        io.send([REPLY.pack(Status.OK, self.server_id)])
        return tenant


def _listen_unix(path: str) -> socket.socket:
    """A listening Unix socket at ``path``, replacing a stale socket file (never another file)."""
    if os.path.exists(path):
        if not stat.S_ISSOCK(os.stat(path).st_mode):
            raise FileExistsError(f"{path} exists and is not a socket")
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.connect(path)
        except OSError:
            os.unlink(path)  # nobody answers: left by a server that died
        else:
            raise OSError(errno.EADDRINUSE, f"a server already listens on {path}")
        finally:
            probe.close()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(path)
        sock.listen(128)
    except BaseException:
        sock.close()
        raise
    return sock


def _send_quietly(io: BufferedSocket, reply: bytes) -> None:
    try:
        io.send([reply])
    except OSError:
        pass  # the client is gone; it cannot be told


def _send_and_close(sock: socket.socket, reply: bytes, linger_s: float = 0.0) -> None:
    """Send a last reply and close; with ``linger_s``, first read (and drop) what the client
    sends until it closes, for at most that long: closing with its hello unread would reset
    the connection, and a reset may discard the reply before the client reads it."""
    try:
        sock.settimeout(1.0)
        sock.sendall(reply)
        if linger_s:
            sock.settimeout(linger_s)
            end = time.monotonic() + linger_s
            while time.monotonic() < end and sock.recv(4096):
                pass
    except OSError:
        pass  # the client is gone
    finally:
        sock.close()
