"""The HTTP server: uvicorn, with a guard on every connection for what a client may hold.

uvicorn (httptools) times out only a keep-alive connection between requests: a client that
sends its head a byte a second, never sends a byte at all, or trickles its body keeps its
connection, and what it sent, for as long as it likes; and httptools puts no limit on a head's
size. ``GuardedHttpProtocol`` adds to uvicorn's protocol:

- a deadline for the whole head (from the connection's start for its first request, from its
  first byte for later ones) and a cap on its bytes (431 past it), for every head: the parser
  is fed one head at a time (``heads``), so one pipelined behind another in the same read is
  measured too;
- a deadline for the whole body, from the end of the head;
- a deadline for an answer a client does not read;
- no reads between a request's head and the moment its app asks for the body, and reads of at
  most ``HEAD_READ_BYTES`` until then: a request refused on its head (401, 413 by its
  Content-Length) has had at most that much of its body read, whatever it sends;
- after an answer given before the body was read (a refusal), what the client still sends is
  read and dropped unparsed for at most ``LINGER_S``, so a client that sends its whole body
  before it reads still sees the answer; then the connection is closed;
- at most ``MAX_PIPELINED`` requests waiting behind the one being answered: uvicorn parses all
  of a read, and 64 KiB of pipelined heads would otherwise become 1,800 queued requests.

``http_server`` builds the uvicorn server the CLI runs and the tests start. It accepts its
connections itself (``listener``) and holds them in a ``ConnectionTable`` (``connections``): caps
below the descriptor limit, a deadline for a connection without a valid token, TLS handshakes
under a deadline and a cap of their own.
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import Callable
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any

import uvicorn
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from cachetier.server.config import ServerConfig
from cachetier.server.connections import ConnectionTable, Entry
from cachetier.server.heads import HeadCap, body_length
from cachetier.server.listener import METRICS_STATE, GuardedServer
from cachetier.util.checks import positive_int

HEAD_READ_BYTES = 64 << 10  # one read, until the app asks for the body
BODY_READ_BYTES = 256 << 10  # one read while it streams one (what asyncio and uvloop read)
LINGER_S = 2.0  # reading and dropping the rest of a refused request's body
_CLOSE = (b"connection", b"close")
MAX_PIPELINED = 8  # requests queued behind the one being answered (clients we know send none)
CHUNKED_SLICE_BYTES = 1024  # a chunked body's bytes are fed this many at a time (``heads``)
_ABORT_AFTER_CLOSE_S = 1.0  # a closed connection whose client reads nothing is reset after it
GUARD_EVENTS = METRICS_STATE
"""The lifespan state entry told of what the guard does (``note_closed``,
``note_refused_body``): the app's ``ServerMetrics``; none, no counting."""


@dataclass(frozen=True, slots=True)
class ConnectionLimits:
    """Deadlines and size caps that the guarded HTTP server puts on every connection.

    Args:
        head_timeout_s: seconds for a whole request head.
        body_timeout_s: seconds for a whole body after its head, and for a stalled answer.
        idle_timeout_s: seconds a connection may wait between requests (uvicorn's keep-alive).
        max_head_bytes: largest request head.
    """

    head_timeout_s: float
    body_timeout_s: float
    idle_timeout_s: float
    max_head_bytes: int

    def __post_init__(self) -> None:
        for name in ("head_timeout_s", "body_timeout_s", "idle_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)!r}")
        positive_int("max_head_bytes", self.max_head_bytes)

    @classmethod
    def of(cls, config: ServerConfig) -> ConnectionLimits:
        """The limits a server's config sets."""
        return cls(
            head_timeout_s=config.head_timeout_s,
            body_timeout_s=config.body_timeout_s,
            idle_timeout_s=config.idle_timeout_s,
            max_head_bytes=config.max_head_bytes,
        )


class _TooManyPipelined(Exception):
    """A client pipelined more requests than the guard queues."""


class _Request:
    """What the guard tracks of one request."""

    __slots__ = ("body_bytes", "body_asked", "body_done", "body_length", "state")

    def __init__(self, body_length: int | None) -> None:
        self.body_length = body_length  # its Content-Length; None: chunked
        self.body_bytes = 0  # body bytes read so far
        self.body_asked = False  # its app has asked for its body
        self.body_done = False  # its whole body has been read
        self.state: dict[str, Any] = {}  # its scope's state: the caller, once authenticated


class GuardedHttpProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with deadlines, a head cap and reads held back until the
    app asks for a body (see the module docstring).

    Args:
        limits: the deadlines and the head cap.
        table: the connection caps the connection holds a place in (``None``: none).
        entry: its place there.
        args, kwargs: what uvicorn passes to its protocol.
    """

    def __init__(
        self,
        *args: Any,
        limits: ConnectionLimits,
        table: ConnectionTable | None = None,
        entry: Entry | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self._limits = limits
        self._table = table
        self._entry = entry
        self._plain_app = self.app
        self._request: _Request | None = None  # the request being read
        self._deadline: asyncio.TimerHandle | None = None  # of a head, a body or a linger
        self._send_deadline: asyncio.TimerHandle | None = None
        self._in_head = True  # reading a head, or waiting for the first byte of one
        self._head = HeadCap(limits.max_head_bytes)
        self._dropping = False  # reading and dropping all that comes, closing soon
        self._lost = False

    @property
    def read_bytes(self) -> int:
        """How much the next read may take: more only while a body the app asked for comes
        (a head, and the body behind it, are read in the small reads)."""
        asked = self._request is not None and self._request.body_asked
        return BODY_READ_BYTES if asked and not self._in_head else HEAD_READ_BYTES

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if self._entry is not None:
            if self._entry.left:  # shed while its transport was being made
                transport.abort()
                return
            self._entry.drop = self._drop
        # From the start: a connection that never sends a byte is closed like a slow head.
        self._arm(self._limits.head_timeout_s, "head_timeout")

    def connection_lost(self, exc: Exception | None) -> None:
        self._lost = True
        if self._table is not None and self._entry is not None:
            self._table.leave(self._entry)
        self._disarm()
        if self._send_deadline is not None:
            self._send_deadline.cancel()
            self._send_deadline = None
        # uvicorn cancels its keep-alive timer only for a connection that ended cleanly: one
        # reset by its client would stay in memory, protocol, parser and all, for the whole
        # idle timeout (a flood's thousands of them).
        self._unset_keepalive_if_required()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._dropping:
            return  # not even parsed: a refused client may not spend the server's CPU
        view = memoryview(data)
        at = 0
        # One head at a time, then its body: each head behind it in the same read is measured
        # from its own first byte.
        while at < len(view) and not self._dropping and not self.transport.is_closing():
            rest = view[at:]
            if self._in_head:
                if self._entry is not None:
                    self._entry.busy = True
                if self._deadline is None and (self.cycle is None or self.cycle.response_complete):
                    # The first byte of a later request (a request still being answered has
                    # its app's time: on_response_complete arms this then).
                    self._arm(self._limits.head_timeout_s, "head_timeout")
                size = self._head.take(rest)
                if size is None:
                    # Checked before parsing: a head that arrives in one read (with its body,
                    # or other requests, around it) is counted as surely as one that trickles in.
                    self._note_closed("head_too_large")
                    self._refuse(431, f"request head over {self._limits.max_head_bytes} bytes")
                    return
                super().data_received(rest[:size])  # type: ignore[arg-type]
            else:
                size = self._feed_body(rest)
            at += size

    def _feed_body(self, rest: memoryview) -> int:
        """Feed the parser the body bytes of ``rest`` (what follows is a head); returns how
        many bytes it was fed."""
        request = self._request
        length = None if request is None else request.body_length
        if length is not None and request is not None:
            size = max(1, min(len(rest), length - request.body_bytes))
            super().data_received(rest[:size])  # type: ignore[arg-type]
            return size
        # Chunked: where the body ends is the parser's to find. A small slice at a time, and
        # a slice it ended in counts whole against the next head.
        size = min(len(rest), CHUNKED_SLICE_BYTES, self._limits.max_head_bytes)
        super().data_received(rest[:size])  # type: ignore[arg-type]
        if self._in_head and not self._dropping:
            self._head.charge(rest[:size])
        return size

    def on_headers_complete(self) -> None:
        if len(self.pipeline) >= MAX_PIPELINED:
            # Raised through httptools, which then parses no further; uvicorn answers 400
            # (send_400_response: after the answer in progress) and closes.
            raise _TooManyPipelined(f"more than {MAX_PIPELINED} requests pipelined")
        request = _Request(body_length(self.headers))
        self._request = request
        # uvicorn starts the app of this request (now, or when the one before it is answered)
        # with self.app: each request's app is wrapped with what the guard watches of it.
        self.app = self._watched(request)
        super().on_headers_complete()
        self._in_head = False
        self._head.reset()
        # Nothing more is read until the app asks for the body (uvicorn's receive() resumes
        # reading): a request refused on its head has had at most one read of its body.
        self.flow.pause_reading()
        self._arm(self._limits.body_timeout_s, "body_timeout")

    def on_body(self, body: bytes) -> None:
        if self._request is not None:
            self._request.body_bytes += len(body)
        super().on_body(body)

    def on_message_complete(self) -> None:
        super().on_message_complete()
        if self._request is not None:
            self._request.body_done = True
        self._disarm()  # the body is in: what remains is the app's time
        self._in_head = True
        self._head.reset()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self.transport.is_closing():
            return
        request = self._request
        if request is not None and not request.body_done:
            # Answered before its body was read: what follows is dropped for a while, so that
            # a client sending all of it before it reads sees the answer (closing at once,
            # with bytes unread, resets the connection and may lose the answer); then closed.
            self._dropping = True
            self._arm(LINGER_S, "linger")
        elif self._in_head and self._head.num_bytes:
            self._arm(self._limits.head_timeout_s, "head_timeout")
        elif self._entry is not None and (self.cycle is None or self.cycle.response_complete):
            self._entry.busy = False  # idle until its next request: the one a share reclaims

    def send_400_response(self, msg: str) -> None:
        self._refuse(400, msg)

    def _refuse(self, status: int, msg: str) -> None:
        """Answer ``status`` with ``msg`` and close, reading nothing more."""
        # uvicorn writes its 400 at once, even while a request's app runs: the app's answer
        # would then go to a closed transport, or into the middle of the 400.
        self._dropping = True
        cycle = self.cycle
        if cycle is None or cycle.response_complete:
            self._write_refusal(status, msg)
        elif cycle.more_body and not cycle.response_started and not self.pipeline:
            # The bad bytes are in the body of the request being served: its app sees the
            # client go (receive() says so; its answer goes nowhere), the client sees the 400.
            cycle.disconnected = True
            cycle.message_event.set()
            self._write_refusal(status, msg)
        else:
            # A bad request pipelined behind one being answered: close after that answer,
            # parsing nothing more.
            cycle.keep_alive = False

    def _write_refusal(self, status: int, msg: str) -> None:
        body = msg.encode("ascii")
        head = (
            f"HTTP/1.1 {status} {HTTPStatus(status).phrase}\r\ncontent-type: text/plain; "
            f"charset=utf-8\r\ncontent-length: {len(body)}\r\nconnection: close\r\n\r\n"
        )
        self.transport.write(head.encode("ascii") + body)
        self.transport.close()
        # close() first sends what is queued; a client that reads nothing would hold it open.
        self.loop.call_later(_ABORT_AFTER_CLOSE_S, self._abort)

    def pause_writing(self) -> None:
        super().pause_writing()
        if self._send_deadline is None:
            self._send_deadline = self.loop.call_later(
                self._limits.body_timeout_s, self._expire, "send_timeout"
            )

    def resume_writing(self) -> None:
        super().resume_writing()
        if self._send_deadline is not None:
            self._send_deadline.cancel()
            self._send_deadline = None

    def _watched(self, request: _Request) -> ASGIApp:
        app, events = self._plain_app, self.app_state.get(GUARD_EVENTS)

        async def watched(scope: Scope, receive: Receive, send: Send) -> None:
            request.state = scope.setdefault("state", {})  # AuthEdge puts the caller there

            async def receive_watched() -> Message:
                request.body_asked = True  # reads may be larger from now on
                self._maybe_promote(request)  # a body is read only after a valid token
                return await receive()

            async def send_watched(message: Message) -> None:
                starts = message["type"] == "http.response.start"
                if starts:
                    self._maybe_promote(request)
                    if message["status"] in (401, 403) and events is not None:
                        events.note_refused_body(request.body_bytes)
                if not starts or request.body_done:
                    return await send(message)
                # Answered before its body was read: closed after the linger. Said, or a client
                # sends its next request into the linger and waits it out to find the close.
                await send({**message, "headers": [*message.get("headers", ()), _CLOSE]})
                if self.cycle is not None:
                    self.cycle.keep_alive = True  # uvicorn would close at once, bytes unread

            await app(scope, receive_watched, send_watched)

        return watched

    def _maybe_promote(self, request: _Request) -> bool:
        """Make the connection known if ``request`` showed a valid token."""
        caller = request.state.get("caller")
        if self._table is None or self._entry is None or caller is None:
            return False
        self._table.promote(self._entry, caller.tenant)
        return True

    def _drop(self, reason: str) -> bool:
        """Close the connection for the ``ConnectionTable`` (``connections.Drop``)."""
        if self._lost or self.transport.is_closing():
            return True
        if reason == "unauthenticated_timeout":
            request = self._request
            if request is not None and self._maybe_promote(request):
                return False  # its request in progress has a valid token
        if reason in ("unauthenticated_timeout", "tenant_share"):
            # Its place is given back now; an answer in progress still goes out.
            self._note_closed(reason)
            answering = self.cycle is not None and not self.cycle.response_complete
            if answering and self.cycle is not None:
                self.cycle.keep_alive = False  # the answer goes out, then the connection ends
                return True
            self.transport.close()
            self.loop.call_later(_ABORT_AFTER_CLOSE_S, self._abort)
            return True
        # A cap or the descriptors: the place is needed now.
        self._note_closed(reason)
        self.transport.abort()
        return True

    def _arm(self, seconds: float, reason: str) -> None:
        self._disarm()
        self._deadline = self.loop.call_later(seconds, self._expire, reason)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _expire(self, reason: str) -> None:
        if reason != "send_timeout":
            self._deadline = None
        else:
            self._send_deadline = None
        if self.transport.is_closing():
            return
        self._note_closed(reason)
        answered = self.cycle is None or self.cycle.response_complete
        if reason == "head_timeout" and self._head.num_bytes and answered:
            # Part of a head came: say why the connection ends (a proxy or a person sees it).
            self.transport.write(
                b"HTTP/1.1 408 Request Timeout\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"
            )
        self.transport.close()
        # close() first sends what is queued; a client that reads nothing would hold it open.
        self.loop.call_later(_ABORT_AFTER_CLOSE_S, self._abort)

    def _abort(self) -> None:
        if not self._lost:
            self.transport.abort()

    def _note_closed(self, reason: str) -> None:
        events = self.app_state.get(GUARD_EVENTS)
        if events is not None and reason != "linger":
            events.note_closed(reason)


class _BoundedReads(asyncio.BufferedProtocol):
    """Hands the transport a buffer of the size the guarded protocol allows for its next read.

    A separate object, not a mixin: uvloop reads through ``get_buffer`` only for protocols
    that are not also an ``asyncio.Protocol``, which uvicorn's is. The buffer is shared by
    every connection of a server: the event loop hands each read to ``buffer_updated`` and
    the parser has copied what it keeps before the loop reads again.
    """

    def __init__(self, inner: GuardedHttpProtocol, buffer: memoryview) -> None:
        self._inner = inner
        self._buffer = buffer

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._inner.connection_made(transport)  # type: ignore[arg-type]

    def connection_lost(self, exc: Exception | None) -> None:
        self._inner.connection_lost(exc)

    def get_buffer(self, sizehint: int) -> memoryview:
        return self._buffer[: self._inner.read_bytes]

    def buffer_updated(self, nbytes: int) -> None:
        self._inner.data_received(self._buffer[:nbytes])  # type: ignore[arg-type]

    def eof_received(self) -> bool | None:
        return self._inner.eof_received()

    def pause_writing(self) -> None:
        self._inner.pause_writing()

    def resume_writing(self) -> None:
        self._inner.resume_writing()


def guarded_protocol(limits: ConnectionLimits) -> Callable[..., asyncio.BaseProtocol]:
    """The protocol factory to give uvicorn (``uvicorn.Config(http=...)``).

    Args:
        limits: the deadlines and head cap of every connection.

    Returns:
        A callable taking uvicorn's protocol arguments (and ``table`` and ``entry``, the
        connection's place in a ``ConnectionTable``).
    """
    buffer = memoryview(bytearray(BODY_READ_BYTES))

    def make(**kwargs: Any) -> asyncio.BaseProtocol:
        return _BoundedReads(GuardedHttpProtocol(limits=limits, **kwargs), buffer)

    return make


def http_server(
    app: ASGIApp,
    config: ServerConfig,
    *,
    ssl_context: ssl.SSLContext | None = None,
    **uvicorn_options: Any,
) -> GuardedServer:
    """The sidecar's HTTP server: uvicorn with ``GuardedHttpProtocol`` on every connection,
    accepted by ``HttpAcceptor`` under the caps of a ``ConnectionTable``.

    With TLS, the handshake runs before uvicorn's protocol sees the connection, under
    ``tls_handshake_timeout_s`` and the ``max_tls_handshakes`` cap.

    Args:
        app: the ASGI app (``create_app``).
        config: host, port, log level, the connection limits and caps.
        ssl_context: serve HTTPS with this server context; ``None`` for plain HTTP.
        uvicorn_options: further ``uvicorn.Config`` settings (they win over these).

    Returns:
        The server; ``run()`` it (or ``serve()`` in a loop of your own).
    """
    settings: dict[str, Any] = dict(
        host=config.host,
        port=config.port,
        log_level=config.log_level,
        lifespan="on",
        http=guarded_protocol(ConnectionLimits.of(config)),
        # No WebSockets: an upgrade would hand the connection to a protocol without the guard.
        ws="none",
        # 75 s by default: longer than the remote tier keeps idle connections (30 s), so a
        # client never reuses a connection the server has just closed.
        timeout_keep_alive=config.idle_timeout_s,
        # Requests in flight get this long to finish on SIGTERM; then the lifespan flushes
        # the write queues.
        timeout_graceful_shutdown=30,
        server_header=False,
    )
    settings.update(uvicorn_options)
    return GuardedServer(uvicorn.Config(app, **settings), config, ssl_context)
