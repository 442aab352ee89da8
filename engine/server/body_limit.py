"""Refuses request bodies over a size limit before the app parses them (413, OpenAI error body).

Plain ASGI: the body is read here (a JSON API reads all of it anyway), then replayed to the app;
later ``receive()`` calls go to the server, so the app still hears a client that disconnects.
"""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from engine.server.errors import APIError, error_response


class BodyLimitMiddleware:
    """ASGI middleware that answers 413 to a request whose body is over ``max_bytes``.

    Args:
        app: the app.
        max_bytes: largest body accepted.
    """

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD"):
            await self.app(scope, receive, send)
            return
        too_large = APIError(
            413, f"the request body is larger than {self.max_bytes} bytes", code="body_too_large"
        )
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await error_response(too_large)(scope, receive, send)
            return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client left before it finished sending
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_bytes:
                await error_response(too_large)(scope, receive, send)
                return
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": b"".join(chunks), "more_body": False}

        await self.app(scope, replay, send)
