"""Bounds request bodies for any of our ASGI apps: the sidecar and the engine's OpenAI server.

One mechanism, three knobs: the limit of a request (by its route), how its server words an
error, and, optionally, a ``ByteBudget`` that all bodies in flight share. The body streams
through: its bytes are counted as the app reads them, never buffered here. A Content-Length
is checked on the head, before the app runs; a body without one (chunked) is refused as soon
as it passes the limit. Lives at the HTTP edge of ``cachetier``, so ``engine`` may import it
and ``cachetier`` never imports ``engine``.
"""

from __future__ import annotations

from collections.abc import Callable

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from cachetier.server.budget import ByteBudget, Hold

LimitOf = Callable[[Scope], int]
Respond = Callable[["BodyRefused"], Response]
BudgetOf = Callable[[Scope], ByteBudget]


class BodyRefused(HTTPException):
    """A body refused by ``BodyLimit``; each server answers it in its own format (``Respond``).

    Args:
        status: 400 (a Content-Length that is not a number), 413 (over the limit) or 503
            (no room in the budget now; answered with ``Retry-After: 1``).
        message: what is wrong, for the error body.
    """

    REASONS = {400: "bad_request", 413: "too_large", 503: "busy"}

    def __init__(self, status: int, message: str) -> None:
        if status not in self.REASONS:
            raise ValueError(f"status must be one of {sorted(self.REASONS)}, got {status}")
        headers = {"Retry-After": "1"} if status == 503 else None
        super().__init__(status, detail=message, headers=headers)
        self.message = message

    @property
    def reason(self) -> str:
        """``bad_request``, ``too_large`` or ``busy``."""
        return self.REASONS[self.status_code]


class BodyLimit:
    """ASGI middleware that refuses a request body over its route's limit or the byte budget.

    The bytes a request has declared or sent are held in the budget (if any) until it is
    done. A refusal before the app runs is sent with ``respond``; one during the app's body
    read is raised as ``BodyRefused`` for the app's handler (``install_body_limit`` installs
    ``respond`` there too), so the app still hears a client that disconnects.

    Args:
        app: the app to wrap.
        limit_of: the largest body a request may send, from its scope.
        respond: the answer to a ``BodyRefused``, in the server's error format.
        budget_of: the budget a request's bytes are held in, from its scope; ``None`` for
            no budget.
    """

    def __init__(
        self,
        app: ASGIApp,
        limit_of: LimitOf,
        respond: Respond,
        budget_of: BudgetOf | None = None,
    ) -> None:
        self.app = app
        self.limit_of = limit_of
        self.respond = respond
        self.budget_of = budget_of

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.limit_of(scope)
        held = Hold(self.budget_of(scope)) if self.budget_of is not None else None
        try:
            declared = _declared_length(scope)
            if declared is not None:
                _check(declared, limit, held, f"body of {declared} bytes")
        except BodyRefused as refused:
            await self.respond(refused)(scope, receive, send)
            return
        seen = 0

        async def counted() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                # Without a Content-Length what is held grows with the body.
                _check(seen, limit, held, "body")
            return message

        try:
            await self.app(scope, counted, send)
        finally:
            if held is not None:
                held.release()


def install_body_limit(
    app: Starlette, limit_of: LimitOf, respond: Respond, budget_of: BudgetOf | None = None
) -> None:
    """Bound ``app``'s request bodies: ``BodyLimit`` as its next middleware, and ``respond``
    as its handler for a ``BodyRefused`` raised while a route reads its body.

    Args:
        app: the app.
        limit_of: the largest body a request may send, from its scope.
        respond: the answer to a refused body, in the app's error format.
        budget_of: the budget bodies in flight share, from a request's scope; ``None`` for none.
    """

    async def refused(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, BodyRefused), f"registered for BodyRefused, got {exc!r}"
        return respond(exc)

    app.add_exception_handler(BodyRefused, refused)
    app.add_middleware(BodyLimit, limit_of=limit_of, respond=respond, budget_of=budget_of)


def _declared_length(scope: Scope) -> int | None:
    """The request's Content-Length; ``None`` without one; ``BodyRefused`` (400) if not a number."""
    for key, value in scope.get("headers", ()):
        if key.lower() == b"content-length":
            length = value.decode("latin-1")
            if not length.isdigit():
                raise BodyRefused(400, f"Content-Length {length[:20]!r} is not a number")
            return int(length)
    return None


def _check(nbytes: int, limit: int, held: Hold | None, what: str) -> None:
    """Refuse ``nbytes`` over ``limit``, or hold them (those not held yet) in the budget."""
    if nbytes > limit:
        raise BodyRefused(413, f"{what} is over the limit of {limit} bytes for this endpoint")
    if held is not None and nbytes > held.nbytes and not held.take(nbytes - held.nbytes):
        raise BodyRefused(
            503,
            f"a body of {nbytes} bytes does not fit in the {held.budget.limit_bytes} bytes of"
            " uploads the server holds at once; retry shortly",
        )
