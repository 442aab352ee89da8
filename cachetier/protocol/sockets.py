"""Blocking sockets for bulk transfers: vectored sends, reads straight into the caller's memory,
and a small pool of connections. Shared by the Redis tier's RESP path and the sidecar's block
transfer protocol (client and server).

Why not asyncio streams: every chunk they read becomes a fresh ``bytes`` that is then copied
again into its destination; a blocking ``recv_into`` puts the bytes where they belong in one
step, and releases the GIL while it waits, so a few threads overlap their transfers.

TLS. A ``BufferedSocket`` may wrap an ``ssl.SSLSocket`` (``connect_tcp(tls=...)``, or one the
server wrapped): reads are the same ``recv_into``; sends join small buffers (an SSL socket has
no vectored send, and a TLS record per tiny buffer would cost more than the copy).
"""

from __future__ import annotations

import select
import socket
import ssl
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Generic, Protocol, TypeVar

from cachetier.record import Buffer

RECV_BYTES = 64 * 1024  # reads smaller than this go through the connection's own buffer
# A Unix socket's send buffer defaults to ~208 KiB: a 90 MB transfer then takes ~450 sends and
# as many wakeups (twice the time of the copy itself). The kernel caps this at wmem_max.
UNIX_SEND_BUFFER_BYTES = 4 * 1024 * 1024
_MAX_IOV = 512  # buffers per sendmsg (Linux allows 1024)


class BufferedSocket:
    """A connected socket with a small read buffer.

    Not thread-safe: one user at a time. Every read raises ``ConnectionResetError`` when the
    peer closes the connection and ``TimeoutError`` when the socket's timeout passes without a
    byte.

    Args:
        sock: a connected stream socket (its timeout is the timeout of every read and write).
    """

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self._buf = bytearray(RECV_BYTES)
        self._view = memoryview(self._buf)
        self._start = self._end = 0  # unread bytes are _buf[_start:_end]

    @classmethod
    def connect_tcp(
        cls,
        host: str,
        port: int,
        connect_timeout_s: float,
        timeout_s: float,
        tls: ssl.SSLContext | None = None,
    ) -> BufferedSocket:
        """Connect over TCP with Nagle off (requests are written whole, then waited on).

        Args:
            host: host name or address.
            port: TCP port.
            connect_timeout_s: longest wait for the connection, and for the TLS handshake.
            timeout_s: longest wait for each read and write after that.
            tls: when given, the connection speaks TLS with this client context; the server
                certificate is checked against ``host`` when the context checks host names.

        Raises:
            OSError: no connection (``ssl.SSLError``, an ``OSError``, for a failed handshake or
                a certificate that does not verify).
        """
        sock = socket.create_connection((host, port), timeout=connect_timeout_s)
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if tls is not None:
                # The handshake runs here, under connect_timeout_s (the socket's timeout now).
                sock = tls.wrap_socket(sock, server_hostname=host)
        except BaseException:
            sock.close()
            raise
        sock.settimeout(timeout_s)
        return cls(sock)

    @classmethod
    def connect_unix(cls, path: str, connect_timeout_s: float, timeout_s: float) -> BufferedSocket:
        """Connect to a Unix socket (with a large send buffer, ``UNIX_SEND_BUFFER_BYTES``)."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, UNIX_SEND_BUFFER_BYTES)
        sock.settimeout(connect_timeout_s)
        try:
            sock.connect(path)
        except OSError:
            sock.close()
            raise
        sock.settimeout(timeout_s)
        return cls(sock)

    def send(self, buffers: Sequence[Buffer]) -> None:
        """Send every byte of ``buffers``, in order, in vectored writes (no join)."""
        views = [memoryview(b).cast("B") for b in buffers if memoryview(b).nbytes]
        if isinstance(self.sock, ssl.SSLSocket):
            self._send_tls(views)
            return
        i = 0
        while i < len(views):
            sent = self.sock.sendmsg(views[i : i + _MAX_IOV])
            while sent:  # drop what went out; a partly sent buffer keeps its tail
                n = views[i].nbytes
                if sent >= n:
                    sent -= n
                    i += 1
                else:
                    views[i] = views[i][sent:]
                    sent = 0

    def _send_tls(self, views: list[memoryview]) -> None:
        """``send`` over TLS: runs of small buffers joined (one TLS record each, not one per
        buffer), large ones sent as they are."""
        pending = bytearray()
        for view in views:
            if view.nbytes >= RECV_BYTES:
                if pending:
                    self.sock.sendall(pending)
                    pending.clear()
                self.sock.sendall(view)
                continue
            pending += view
            if len(pending) >= RECV_BYTES:
                self.sock.sendall(pending)
                pending.clear()
        if pending:
            self.sock.sendall(pending)

    def _fill(self) -> None:
        """Read more into the buffer (compacting it first when its tail is full)."""
        if self._start == self._end:
            self._start = self._end = 0
        elif self._end == len(self._buf):
            self._buf[: self._end - self._start] = self._buf[self._start : self._end]
            self._end -= self._start
            self._start = 0
        n = self.sock.recv_into(self._view[self._end :])
        if n == 0:
            raise ConnectionResetError("the peer closed the connection")
        self._end += n

    def read_line(self) -> bytes | None:
        """The next CRLF-terminated line without its CRLF; ``None`` if none ends within
        ``RECV_BYTES`` (the buffer's size)."""
        while True:  # lines are short: searching again from their start costs nothing
            at = self._buf.find(b"\r\n", self._start, self._end)
            if at >= 0:
                line = bytes(self._buf[self._start : at])
                self._start = at + 2
                return line
            if self._end - self._start >= RECV_BYTES:
                return None
            self._fill()

    def readinto(self, dest: memoryview) -> int:
        """Read up to ``dest.nbytes`` (> 0) bytes into ``dest``; large reads skip the buffer."""
        if self._start < self._end:
            n = min(dest.nbytes, self._end - self._start)
            dest[:n] = self._view[self._start : self._start + n]
            self._start += n
            return n
        if dest.nbytes >= RECV_BYTES:
            n = self.sock.recv_into(dest)
            if n == 0:
                raise ConnectionResetError("the peer closed the connection")
            return n
        self._fill()
        return self.readinto(dest)

    def read_exactly(self, nbytes: int) -> bytes:
        """The next ``nbytes`` bytes (for small headers: they are copied into a ``bytes``)."""
        out = bytearray(nbytes)
        view = memoryview(out)
        got = 0
        while got < nbytes:
            got += self.readinto(view[got:])
        return bytes(out)

    def skip(self, nbytes: int) -> None:
        """Read and drop ``nbytes`` bytes."""
        while nbytes:
            if self._start == self._end:
                self._fill()
            n = min(nbytes, self._end - self._start)
            self._start += n
            nbytes -= n

    @property
    def has_unread(self) -> bool:
        """Whether bytes are buffered that no read has taken yet."""
        return self._start != self._end

    def is_stale(self) -> bool:
        """Whether an idle connection cannot be used: the peer closed it (it restarted, or
        timed the connection out) or it holds unread bytes. One poll, no round trip."""
        if self.has_unread:
            return True
        tls = isinstance(self.sock, ssl.SSLSocket)
        if tls and self.sock.pending():  # decrypted bytes nobody asked for
            return True
        # poll, not a MSG_DONTWAIT peek: a socket with a timeout waits out the timeout on it.
        poller = select.poll()
        poller.register(self.sock, select.POLLIN)
        # Readable means closed by the peer or bytes nobody asked for; either way, not usable.
        if not poller.poll(0):
            return False
        # Over TLS it may also be records that carry no data: TLS 1.3 servers send session
        # tickets after the handshake, and a connection that sent nothing since has not read
        # them. Read without waiting: only those came if the read finds no data.
        return not tls or self._tls_stale()

    def _tls_stale(self) -> bool:
        timeout = self.sock.gettimeout()
        self.sock.settimeout(0.0)
        try:
            self.sock.recv_into(self._view)  # the buffer is empty: has_unread was False
        except ssl.SSLWantReadError:
            return False  # no data: the records read were TLS's own
        except OSError:
            return True
        finally:
            self.sock.settimeout(timeout)
        return True  # closed (0 bytes), or bytes nobody asked for

    def close(self) -> None:
        self.sock.close()


def accept_tls(sock: socket.socket, context: ssl.SSLContext, deadline: float) -> ssl.SSLSocket:
    """The server side of a TLS handshake on an accepted connection, all of it by ``deadline``.

    One deadline for the whole handshake, not a timeout per read: a client that sends a byte
    now and then cannot stretch it. Run it on the connection's own thread, never the accept
    loop, so a client that never completes its handshake holds only its own thread.

    Args:
        sock: the accepted connection (detached by this call: use the returned socket).
        context: the server context (``cachetier.util.tls.server_context``).
        deadline: ``time.monotonic()`` by which the handshake must be done.

    Returns:
        The TLS socket, blocking again; the caller sets its timeout.

    Raises:
        TimeoutError: the handshake was not done by ``deadline``.
        ssl.SSLError: the handshake failed (not TLS, no common version, ...).
    """
    tls = context.wrap_socket(sock, server_side=True, do_handshake_on_connect=False)
    try:
        tls.setblocking(False)
        while True:
            try:
                tls.do_handshake()
                break
            except ssl.SSLWantReadError:
                wanted = select.POLLIN
            except ssl.SSLWantWriteError:
                wanted = select.POLLOUT
            left_s = deadline - time.monotonic()
            poller = select.poll()
            poller.register(tls, wanted)
            if left_s <= 0 or not poller.poll(left_s * 1000):
                raise TimeoutError("the client did not complete its TLS handshake in time")
        tls.setblocking(True)
    except BaseException:
        tls.close()
        raise
    return tls


class BoundedReader:
    """Reads of one length-prefixed item (a record), never past its end.

    A bad item then cannot run into what follows it on the stream; ``left`` bytes remain to
    ``skip``.

    Args:
        io: the connection.
        nbytes: the item's length.
    """

    def __init__(self, io: BufferedSocket, nbytes: int) -> None:
        self._io = io
        self.left = nbytes

    def readinto(self, dest: memoryview) -> int:
        """As ``BufferedSocket.readinto``, but 0 once the item's bytes are all read."""
        if self.left == 0:
            return 0
        n = self._io.readinto(dest[: self.left] if dest.nbytes > self.left else dest)
        self.left -= n
        return n


class Closable(Protocol):
    """What a ``SocketPool`` holds: a connection it can test for staleness and close."""

    def is_stale(self) -> bool: ...

    def close(self) -> None: ...


C = TypeVar("C", bound=Closable)


class SocketPool(Generic[C]):
    """Connections made on demand and reused, LIFO; one user per connection at a time.

    Args:
        connect: makes a new connection (raises ``OSError`` or a protocol error if it cannot).
        max_connections: most connections open at once.
        wait_s: longest wait for a free one; then ``TimeoutError``.
    """

    def __init__(self, connect: Callable[[], C], max_connections: int, wait_s: float) -> None:
        self._connect = connect
        self._wait_s = wait_s
        self._slots = threading.BoundedSemaphore(max_connections)
        self._idle: list[C] = []
        self._lock = threading.Lock()
        self._closed = False

    @property
    def num_idle(self) -> int:
        with self._lock:
            return len(self._idle)

    @contextmanager
    def connection(self) -> Iterator[C]:
        """A connection for one exchange; dropped, not reused, if the exchange raises (it may
        have stopped between a request and its reply)."""
        if not self._slots.acquire(timeout=self._wait_s):
            raise TimeoutError(f"no free connection within {self._wait_s} s")
        conn: C | None = None
        try:
            with self._lock:
                if self._closed:
                    raise ConnectionAbortedError("the connection pool is closed")
                conn = self._idle.pop() if self._idle else None
            if conn is not None and conn.is_stale():
                conn.close()
                conn = None
            if conn is None:
                conn = self._connect()
            yield conn
        except BaseException:
            if conn is not None:
                conn.close()
                conn = None
            raise
        finally:
            if conn is not None:
                with self._lock:
                    if self._closed:
                        conn.close()
                    else:
                        self._idle.append(conn)
            self._slots.release()

    def close(self) -> None:
        """Close the idle connections; busy ones are closed when they come back."""
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()
