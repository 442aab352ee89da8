"""A Redis protocol (RESP2) client for block records: pipelined GETs and SETs, few copies.

redis-py turns every reply into a fresh ``bytes`` (its parser buffers it once more on the way)
and, with hiredis, packs every command into one ``bytes`` that copies the value: for blocks of
megabytes those copies cost more than Redis itself. This module does only what the hot path
needs, without them:

- ``RespClient.get_records``: pipelined ``GET``s whose records are read from the socket straight
  into the caller's buffers (a KV pool block) or recycled ones, checksummed chunk by chunk while
  each chunk is still in the CPU cache (``record.read_record``);
- ``RespClient.set_records``: pipelined ``SET``s sent from a record's parts (``encode_parts``) in
  vectored writes, without joining them.

A large batch is spread over a few connections, one thread each: Redis writes a big reply in
64 KiB steps of its event loop, so one connection leaves both Redis and us idle part of the
time; socket waits release the GIL, so the streams overlap. Everything else (scripts, scans,
deletes, Redis Cluster) stays on redis-py. Over ``rediss://`` the connections speak TLS with
the tier's client context (``cachetier.util.tls``: chain and host name verified), never plaintext.

Errors: socket failures and timeouts raise ``OSError`` (``TimeoutError``, ``ConnectionError``);
bytes that are not the reply expected raise ``RespProtocolError``, and a Redis that refuses
our credentials (a refused ``AUTH``, or ``NOAUTH`` / ``WRONGPASS`` in place of a reply) raises
``RespAuthError``. Either way the connection is dropped, never reused out of step. Any other
error reply to one command (``-OOM ...``) is not raised: it comes back as an ``ErrorReply`` in
that command's place.
"""

from __future__ import annotations

import ssl
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import TypeVar

from redis.connection import SSLConnection, UnixDomainSocketConnection, parse_url

from cachetier.errors import CorruptBlockError, TierUnavailableError
from cachetier.protocol.sockets import RECV_BYTES, BoundedReader, BufferedSocket, SocketPool
from cachetier.record import Buffer, KVBlock, read_record
from cachetier.util.landing import Destination
from cachetier.util.redact import redacted_repr

_T = TypeVar("_T")
_CRLF = b"\r\n"
# Replies one connection asks for at once: this many bytes (when the sizes are known from
# the destinations) or this many keys.
_WINDOW_BYTES = 16 * 1024 * 1024
_WINDOW_KEYS = 8
# A bulk reply longer than this is not a record of ours: refuse it instead of reading it.
MAX_BULK_BYTES = 512 * 1024 * 1024


class RespProtocolError(TierUnavailableError):
    """Redis sent bytes that are not the reply expected; the connection is dropped."""


class RespAuthError(RespProtocolError):
    """Redis refused our credentials: ``AUTH`` failed, or it answered ``NOAUTH`` / ``WRONGPASS``
    (a password it wants and we do not send, or one it no longer takes)."""


# Error replies that mean every command on the connection will fail the same way.
_AUTH_REPLIES = (b"NOAUTH", b"WRONGPASS")


@dataclass(frozen=True, slots=True)
class ErrorReply:
    """Redis answered one command with an error (e.g. ``OOM`` over ``maxmemory``)."""

    message: str


class Corrupt:
    """A record that failed its checks (``CORRUPT``): the caller counts and removes it."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "CORRUPT"


CORRUPT = Corrupt()


@dataclass(frozen=True, slots=True)
class Hit:
    """A record that passed its checks: its block, and its length in Redis (for counters)."""

    block: KVBlock
    nbytes: int


GetResult = Hit | None | ErrorReply | Corrupt


@dataclass(frozen=True, slots=True)
class Endpoint:
    """Where a Redis listens and how to log in.

    Args:
        host: TCP host, or ``None`` for a Unix socket.
        port: TCP port.
        path: Unix socket path, or ``None`` for TCP.
        username: ACL user name (``None``: the default user).
        password: password (``None``: no ``AUTH``); never in the repr.
        db: database number (``SELECT`` when not 0).
        connect_timeout_s: longest wait for a connection (and its TLS handshake), in seconds.
        timeout_s: longest wait for one read or write, in seconds.
        tls: client context of a ``rediss://`` endpoint (``cachetier.util.tls.client_context``),
            ``None`` for plaintext.
    """

    host: str | None
    port: int
    path: str | None
    username: str | None
    password: str | None = field(repr=False)
    db: int
    connect_timeout_s: float
    timeout_s: float
    tls: ssl.SSLContext | None = field(default=None, repr=False)

    def __repr__(self) -> str:
        return redacted_repr(self)

    @classmethod
    def from_url(
        cls,
        url: str,
        connect_timeout_s: float,
        timeout_s: float,
        tls: ssl.SSLContext | None = None,
    ) -> Endpoint:
        """The endpoint of a ``redis://``, ``rediss://`` or ``unix://`` url.

        Args:
            url: the url.
            connect_timeout_s: see the class.
            timeout_s: see the class.
            tls: the client context; required for ``rediss://``, refused otherwise.
        """
        options = parse_url(url)
        is_tls = options.get("connection_class") is SSLConnection
        if is_tls != (tls is not None):
            raise ValueError(
                "a rediss:// url needs a TLS context" if is_tls else "TLS needs a rediss:// url"
            )
        if options.get("connection_class") not in (None, UnixDomainSocketConnection, SSLConnection):
            raise ValueError(f"unknown Redis connection {options.get('connection_class')!r}")
        path = options.get("path")
        return cls(
            host=None if path else options.get("host", "localhost"),
            port=int(options.get("port", 6379)),
            path=path,
            username=options.get("username"),
            password=options.get("password"),
            db=int(options.get("db", 0)),
            connect_timeout_s=connect_timeout_s,
            timeout_s=timeout_s,
            tls=tls,
        )


def command(*args: bytes | str | int) -> bytes:
    """One RESP command (small arguments only: values are sent as parts, see ``set_records``)."""
    out = [b"*%d\r\n" % len(args)]
    for arg in args:
        data = arg if isinstance(arg, bytes) else str(arg).encode()
        out.append(b"$%d\r\n%s\r\n" % (len(data), data))
    return b"".join(out)


class RespConnection:
    """One connection, logged in and on its database (a ``BufferedSocket`` that speaks RESP).

    Args:
        endpoint: where to connect.

    Raises:
        OSError: the connection could not be made (``ssl.SSLError`` included: a failed TLS
            handshake or a certificate that does not verify).
        RespAuthError: ``AUTH`` was refused.
        RespProtocolError: ``SELECT`` was refused.
    """

    def __init__(self, endpoint: Endpoint) -> None:
        if endpoint.path is not None:
            io = BufferedSocket.connect_unix(
                endpoint.path, endpoint.connect_timeout_s, endpoint.timeout_s
            )
        else:
            assert endpoint.host is not None
            io = BufferedSocket.connect_tcp(
                endpoint.host,
                endpoint.port,
                endpoint.connect_timeout_s,
                endpoint.timeout_s,
                tls=endpoint.tls,
            )
        self.io = io
        try:
            self._log_in(endpoint)
        except BaseException:
            io.close()
            raise

    def _log_in(self, endpoint: Endpoint) -> None:
        commands = []
        if endpoint.password is not None:
            user = () if endpoint.username is None else (endpoint.username,)
            commands.append(command("AUTH", *user, endpoint.password))
        if endpoint.db:
            commands.append(command("SELECT", endpoint.db))
        if not commands:
            return
        self.io.send([b"".join(commands)])
        for i in range(len(commands)):
            line = self.read_line()
            if line[:1] != b"+":
                # The AUTH goes first: its refusal is a credentials problem, whatever the words.
                is_auth = endpoint.password is not None and i == 0
                error = RespAuthError if is_auth or _is_auth_error(line[1:]) else RespProtocolError
                raise error(f"Redis refused the login: {_text(line)}")

    def read_line(self) -> bytes:
        """The next reply line, without its CRLF."""
        line = self.io.read_line()
        if line is None:
            raise RespProtocolError(f"Redis sent a line longer than {RECV_BYTES} bytes")
        return line

    def expect_crlf(self) -> None:
        """Read the CRLF that ends a bulk string."""
        if self.io.read_exactly(2) != _CRLF:
            raise RespProtocolError("a bulk string does not end with CRLF")

    def is_stale(self) -> bool:
        return self.io.is_stale()

    def close(self) -> None:
        self.io.close()


def read_bulk_record(
    conn: RespConnection, key: bytes, payload_into: Destination | None
) -> GetResult:
    """Read one ``GET`` reply as a record of ``key``.

    Args:
        conn: a connection whose next reply is that of a ``GET``.
        key: the key the record must carry.
        payload_into: where an uncompressed payload of exactly its size is read to, or ``None``.

    Returns:
        The checked block as a ``Hit``, ``None`` for a missing key, ``CORRUPT`` for a record
        that failed a check (its bytes are read to the end, so the connection stays in step),
        or the ``ErrorReply``.
    """
    line = conn.read_line()
    kind = line[:1]
    if kind == b"-":
        return _error_reply(line[1:])
    if kind != b"$":
        raise RespProtocolError(f"expected a bulk string, got {_text(line)}")
    try:
        size = int(line[1:])
    except ValueError:
        raise RespProtocolError(f"bad bulk length {_text(line)}") from None
    if size == -1:
        return None
    if not 0 <= size <= MAX_BULK_BYTES:
        raise RespProtocolError(f"bulk length {size} is out of range")
    body = BoundedReader(conn.io, size)
    result: GetResult
    try:
        result = Hit(read_record(body.readinto, size, key=key, payload_into=payload_into), size)
    except CorruptBlockError:
        result = CORRUPT
    conn.io.skip(body.left)
    conn.expect_crlf()
    return result


def read_status(conn: RespConnection) -> bool | ErrorReply:
    """Read a ``+OK``-style reply: ``True``, or the ``ErrorReply``."""
    line = conn.read_line()
    if line[:1] == b"+":
        return True
    if line[:1] == b"-":
        return _error_reply(line[1:])
    raise RespProtocolError(f"expected a status reply, got {_text(line)}")


def _error_reply(message: bytes) -> ErrorReply:
    """The ``ErrorReply`` of an error line; raises ``RespAuthError`` for a refusal of our
    credentials (the commands after it would all be refused too: drop the connection)."""
    if _is_auth_error(message):
        raise RespAuthError(f"Redis refused our credentials: {_text(message)}")
    return ErrorReply(_text(message))


def _is_auth_error(message: bytes) -> bool:
    return message.startswith(_AUTH_REPLIES)


def _text(line: bytes) -> str:
    return line[:200].decode("utf-8", "replace")


class RespClient:
    """A Redis protocol client for block records: GETs and SETs spread over a few connections.

    Connections are made on demand; a batch is spread over them by threads of its own.

    Args:
        endpoint: where Redis is.
        max_connections: most connections open at once; a call waits up to
            ``endpoint.timeout_s`` for one, then raises ``TimeoutError``.
        streams: most connections one batch is spread over.
    """

    def __init__(self, endpoint: Endpoint, max_connections: int, streams: int) -> None:
        self.endpoint = endpoint
        self._streams = max(1, min(streams, max_connections))
        self._pool: SocketPool[RespConnection] = SocketPool(
            lambda: RespConnection(endpoint), max_connections, endpoint.timeout_s
        )
        self._lock = threading.Lock()
        self._threads: ThreadPoolExecutor | None = None

    @property
    def num_idle(self) -> int:
        """Connections open and waiting for use."""
        return self._pool.num_idle

    def connection(self) -> AbstractContextManager[RespConnection]:
        """A connection for one exchange; dropped, not reused, if the exchange raises."""
        return self._pool.connection()

    def get_records(
        self,
        skeys: Sequence[bytes],
        keys: Sequence[bytes],
        dests: Sequence[Destination | None] | None = None,
    ) -> list[GetResult]:
        """``GET`` each storage key and read its reply as a record of the matching block key.

        Args:
            skeys: Redis keys.
            keys: the block key each record must carry.
            dests: per key, where its payload should land (see ``read_bulk_record``).

        Returns:
            One ``GetResult`` per key, in order.
        """
        targets = dests if dests is not None else [None] * len(skeys)
        sizes = [d.nbytes for d in dests if d is not None] if dests is not None else []
        # GETs go out a window at a time, the next one sent before this one's replies are read:
        # Redis copies every reply of what it has read before it writes any, so an unbounded
        # pipeline of 188 MB kept the first byte back longer than the socket timeout.
        per_window = max(1, min(64, _WINDOW_BYTES // max(sizes))) if sizes else _WINDOW_KEYS

        def fetch(lo: int, hi: int) -> list[GetResult]:
            windows = [range(a, min(a + per_window, hi)) for a in range(lo, hi, per_window)]
            out: list[GetResult] = []
            with self.connection() as conn:

                def ask(window: range) -> None:
                    conn.io.send([b"".join(command(b"GET", skeys[i]) for i in window)])

                ask(windows[0])
                for n, window in enumerate(windows):
                    if n + 1 < len(windows):
                        ask(windows[n + 1])  # Redis works on it while we read this one
                    out += [read_bulk_record(conn, keys[i], targets[i]) for i in window]
            return out

        return self._spread(len(skeys), fetch)

    def set_records(
        self,
        skeys: Sequence[bytes],
        record_of: Callable[[int], Sequence[Buffer]],
        px_ms: int | None,
    ) -> list[bool | ErrorReply]:
        """``SET`` each storage key to a record given as parts, with an optional expiry.

        Args:
            skeys: Redis keys.
            record_of: the parts (``encode_parts``) of key ``i``'s record, sent without a
                join. Called on the thread that sends it, just before: one stream's encoding
                (Python steps under the GIL; xxh3 lets go of it for pieces over 64 KiB)
                overlaps the others' sends (which release it).
            px_ms: expiry in milliseconds, or ``None``.

        Returns:
            Per key, ``True`` when stored or the ``ErrorReply``.
        """
        expiry = b"" if px_ms is None else b"$2\r\nPX\r\n$%d\r\n%d\r\n" % (len(str(px_ms)), px_ms)
        arity = b"*3\r\n" if px_ms is None else b"*5\r\n"

        def store(lo: int, hi: int) -> list[bool | ErrorReply]:
            with self.connection() as conn:
                for i in range(lo, hi):
                    parts = record_of(i)
                    size = sum(memoryview(p).nbytes for p in parts)
                    head = b"%s$3\r\nSET\r\n$%d\r\n%s\r\n$%d\r\n" % (
                        arity,
                        len(skeys[i]),
                        skeys[i],
                        size,
                    )
                    conn.io.send([head, *parts, _CRLF + expiry])
                return [read_status(conn) for _ in range(lo, hi)]

        return self._spread(len(skeys), store)

    def _spread(self, count: int, run: Callable[[int, int], list[_T]]) -> list[_T]:
        """``run`` over contiguous ranges of ``count`` items, one per stream, in parallel (on
        threads of this pool's own: they wait on Redis, so more of them than cores pay off,
        unlike ``cachetier.util.parallel``'s)."""
        streams = min(self._streams, count // 2) if count >= 4 else 1
        if streams <= 1:
            return run(0, count)
        bounds = [count * i // streams for i in range(streams + 1)]
        with self._lock:
            if self._threads is None:
                self._threads = ThreadPoolExecutor(
                    self._streams - 1, thread_name_prefix="cachetier-redis"
                )
            threads = self._threads
        futures = [threads.submit(run, bounds[i], bounds[i + 1]) for i in range(1, streams)]
        out: list[_T] = []
        error: BaseException | None = None
        try:
            out.extend(run(bounds[0], bounds[1]))
        except BaseException as exc:  # still wait for the others: they use our buffers
            error = exc
        for future in futures:
            try:
                out.extend(future.result())
            except BaseException as exc:
                error = error or exc
        if error is not None:
            raise error
        return out

    def close(self) -> None:
        """Close idle connections (busy ones close when returned) and stop the threads."""
        self._pool.close()
        with self._lock:
            threads, self._threads = self._threads, None
        if threads is not None:
            threads.shutdown(wait=False)
