"""The HTTP side of ``scheduling``: every authenticated request works in a slot of its
tenant's fair share (``FairEdge``), or is answered 429 past it.

A request holds its slot from its route's start to the start of its answer, except while it
waits for its body: a client that trickles its body holds no slot meanwhile, and each chunk
read queues the request again behind the tenants served less. Sending the answer holds none
either (a client that does not read it is the connection guard's to end).
"""

from __future__ import annotations

import asyncio

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from cachetier.server.auth import Caller
from cachetier.server.edge import error_answer, over_share
from cachetier.server.fairness import MAX_HOLD_S
from cachetier.server.scheduling import FairScheduler, Held
from cachetier.server.service import BlockService


class FairEdge:
    """Runs each request of a known tenant in a ``FairScheduler`` slot (after ``AuthEdge``
    put the caller in its state); past the tenant's share, 429 with ``Retry-After``.

    Args:
        app: the app to wrap.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        caller = scope.get("state", {}).get("caller") if scope["type"] == "http" else None
        if not isinstance(caller, Caller):  # public paths, refusals: no slot
            await self.app(scope, receive, send)
            return
        service: BlockService = scope["state"]["service"]
        slots = _RequestSlot(service.scheduler, caller.tenant)
        got = await service.scheduler.acquire(caller.tenant)
        if not isinstance(got, Held):
            message = f"tenant {caller.tenant} is past its share of the server's capacity"
            # Answered once its wait is (mostly) over, as AuthEdge does: a tenant that asks
            # again at once would spend on refusals the CPU the others need.
            await asyncio.sleep(min(got, MAX_HOLD_S))
            await error_answer(over_share(message, got))(scope, receive, send)
            return
        slots.held = got
        try:
            await self.app(scope, slots.wrap_receive(receive), slots.wrap_send(send))
        finally:
            slots.give_back(done=True)


class _RequestSlot:
    """The slot one request holds, given back while it waits for its body and at its answer."""

    def __init__(self, scheduler: FairScheduler, tenant: str) -> None:
        self.scheduler = scheduler
        self.tenant = tenant
        self.held: Held | None = None
        self.spent = 0.0  # slot seconds of the slots given back before
        self.answered = False

    def give_back(self, done: bool) -> None:
        if self.held is not None:
            held, self.held = self.held, None
            held.spent = self.spent
            self.spent = self.scheduler.release(held, done=done)

    def wrap_receive(self, receive: Receive) -> Receive:
        async def fair_receive() -> Message:
            self.give_back(done=False)
            message = await receive()
            if message["type"] == "http.request" and not self.answered:
                got = await self.scheduler.acquire(self.tenant, may_refuse=False)
                assert isinstance(got, Held), "a request under way is never refused"
                self.held = got
            return message

        return fair_receive

    def wrap_send(self, send: Send) -> Send:
        async def fair_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                self.answered = True
                self.give_back(done=True)
            await send(message)

        return fair_send
