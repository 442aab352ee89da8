"""Who the server works for next: weighted fair queuing of requests by tenant.

The server's CPU is one interpreter's: a tenant that sends requests as fast as it can would
otherwise fill the event loop and the worker threads, and every other tenant's request would
wait behind its backlog. Here a request holds one of ``num_slots`` *slots* while it works (not
while it waits for its body or for its client to read the answer). When every slot is held, a
request waits in its tenant's own queue, and a slot that frees goes to the waiting tenant with
the least service so far per weight (seconds a slot was held, over its weight; a tenant that
turns active starts at the least of the active ones, so idle time earns no credit to spend
later). A tenant sending more than its share therefore waits behind its own requests, not the
others'.

While another tenant that asked within ``RESERVE_S`` holds no slot, one slot is kept free for
it (with two slots or more): a tenant that sends a request now and then would otherwise find
every slot taken by a flooding one at each request, and wait out the rest of a flood request's
work every time. A tenant alone gets every slot; the kept slot goes back to the others at the
first slot given back ``RESERVE_S`` after the other tenant's last request.

Past its share a tenant is refused rather than queued without end: the capacity is measured
(slots over the mean time a request holds one), and once a tenant's oldest queued request has
waited ``MAX_QUEUE_S``, a request whose tenant's queue would wait longer than that at the
tenant's share of the capacity is refused (HTTP 429 with ``Retry-After``, ``BUSY`` on the
transfer port), with the wait the queue needs to drain.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from cachetier.server.fairness import TenantWeights
from cachetier.util.backoff import Clock

MAX_QUEUE_S = 1.0  # longest a tenant's queued requests may wait, at its share, before refusal
_FIRST_SERVICE_S = 1e-3  # the mean before any request was measured
_EWMA = 0.02  # weight of each new request's time in the measured mean
RESERVE_S = 0.5  # how long a tenant's last request keeps a slot free for its next one


@dataclass(slots=True)
class Held:
    """One slot a request of ``tenant`` holds since ``since`` (the scheduler's clock).

    ``charged``: the seconds its tenant was charged when it was given (the measured mean; the
    difference is settled when it is given back); ``spent``: seconds the same request held
    slots before this one.
    """

    tenant: str
    since: float
    charged: float
    spent: float = 0.0


class _Waiter:
    __slots__ = ("tenant", "wake", "since", "held")

    def __init__(self, tenant: str, wake: Callable[[], None], since: float) -> None:
        self.tenant = tenant
        self.wake = wake
        self.since = since  # when it began to wait
        self.held: Held | None = None  # set when a slot is given to it


class FairScheduler:
    """Slots for request work, given out by weighted fair queuing. Thread-safe: the event
    loop and the transfer port's threads share one.

    Args:
        weights: the tenants' weights.
        num_slots: requests that work at once.
        clock: time source in seconds.
    """

    def __init__(self, weights: TenantWeights, num_slots: int, clock: Clock = time.perf_counter):
        if num_slots <= 0:
            raise ValueError(f"num_slots must be positive, got {num_slots}")
        self.num_slots = num_slots
        self._weights = weights
        self._clock = clock
        self._lock = threading.Lock()
        self._free = num_slots
        self._queues: dict[str, deque[_Waiter]] = {}
        self._running: dict[str, int] = {}
        self._served: dict[str, float] = {}  # tenant -> slot seconds over its weight
        self._vtime = 0.0  # the served mark of the last tenant given a slot
        self._asked: dict[str, float] = {}  # tenant -> when it last asked for a slot
        self._mean_s = _FIRST_SERVICE_S
        self.num_refused: dict[str, int] = {}
        self.num_queued = 0  # requests that waited for a slot

    def capacity_per_s(self) -> float:
        """Requests per second the server serves, as measured: slots over the mean time a
        request holds one."""
        return self.num_slots / self._mean_s

    def _weight(self, tenant: str) -> float:
        return self._weights.weights.get(tenant, 1.0)

    def _active_locked(self, tenant: str) -> bool:
        return bool(self._queues.get(tenant)) or self._running.get(tenant, 0) > 0

    def _reserved_locked(self, tenant: str, now: float) -> bool:
        """Whether the one free slot is kept for another tenant that asked lately and holds
        none (so ``tenant`` may not take it)."""
        if self._free > 1 or self.num_slots < 2:
            return False  # more free than the at most num_slots - 1 kept
        for other, asked in list(self._asked.items()):
            if now - asked >= RESERVE_S:
                del self._asked[other]
            elif other != tenant and not self._running.get(other, 0):
                return True
        return False

    def _enter(
        self, tenant: str, make_wake: Callable[[], Callable[[], None]], may_refuse: bool
    ) -> Held | _Waiter | float:
        """A slot now, a place in ``tenant``'s queue, or (``may_refuse``) the seconds its
        queue needs before it may ask again."""
        with self._lock:
            now = self._clock()
            self._asked[tenant] = now
            if not self._active_locked(tenant):  # idle time earns no credit
                self._served[tenant] = max(self._served.get(tenant, 0.0), self._vtime)
            if self._free > 0 and not any(self._queues.values()):
                if not self._reserved_locked(tenant, now):
                    return self._grant_locked(tenant)
            queue = self._queues.setdefault(tenant, deque())
            # Refused on evidence and estimate both: its oldest request has waited past the
            # bound, and its queue would take longer still at its share of the capacity
            # (the estimate alone errs after a run of large requests: requests vary in size).
            if may_refuse and queue and now - queue[0].since > MAX_QUEUE_S:
                wait_s = self._queue_wait_locked(tenant, len(queue) + 1)
                if wait_s > MAX_QUEUE_S:
                    self.num_refused[tenant] = self.num_refused.get(tenant, 0) + 1
                    return wait_s - MAX_QUEUE_S
            waiter = _Waiter(tenant, make_wake(), now)
            queue.append(waiter)
            self.num_queued += 1
            wake = self._dispatch_locked()
        for call in wake:  # a slot kept free for this tenant, or one it may take
            call()
        return waiter

    def _queue_wait_locked(self, tenant: str, num_queued: int) -> float:
        """Seconds ``num_queued`` requests of ``tenant`` wait at its share of the measured
        capacity, shared with the tenants active now."""
        active = {t for t in (*self._queues, *self._running) if self._active_locked(t)}
        weight = self._weight(tenant)
        share = weight / (weight + sum(self._weight(t) for t in active if t != tenant))
        return num_queued / (self.capacity_per_s() * share)

    def _grant_locked(self, tenant: str) -> Held:
        self._free -= 1
        self._running[tenant] = self._running.get(tenant, 0) + 1
        self._vtime = max(self._vtime, self._served.get(tenant, 0.0))
        # Charged now, settled at release: slots given out before any comes back must count
        # already, or one tenant would win every slot that frees meanwhile.
        self._served[tenant] = self._served.get(tenant, 0.0) + self._mean_s / self._weight(tenant)
        return Held(tenant, self._clock(), self._mean_s)

    def release(self, held: Held, done: bool = True) -> float:
        """Give back a slot, charging its tenant the time it was held, and give it to the
        next waiting request.

        Args:
            held: the slot.
            done: whether its request is over: its slot time (``spent`` and this one's) then
                counts in the measured capacity (not for a slot given back mid-request, e.g.
                while the request waits for its body).

        Returns:
            The request's slot seconds so far (``spent`` and this slot's).
        """
        with self._lock:
            elapsed = max(0.0, self._clock() - held.since)
            tenant = held.tenant
            self._served[tenant] += (elapsed - held.charged) / self._weight(tenant)
            if done:
                self._mean_s += _EWMA * (max(held.spent + elapsed, 1e-6) - self._mean_s)
            self._running[tenant] -= 1
            self._free += 1
            wake = self._dispatch_locked()
        for call in wake:
            call()
        return held.spent + elapsed

    def _dispatch_locked(self) -> list[Callable[[], None]]:
        """Give free slots to waiting requests, the least served tenant first, past those
        whose free slots are kept for others; returns the wake-ups to call."""
        wake = []
        now = self._clock()
        while self._free > 0:
            waiting = [t for t, q in self._queues.items() if q]
            waiting = [t for t in waiting if not self._reserved_locked(t, now)]
            if not waiting:
                break
            chosen = min(waiting, key=lambda t: (self._served[t], self._running.get(t, 0)))
            waiter = self._queues[chosen].popleft()
            waiter.held = self._grant_locked(chosen)
            wake.append(waiter.wake)
        return wake

    def _withdraw(self, waiter: _Waiter) -> Held | None:
        """Take a waiter out of its queue; returns the slot it was given meanwhile, if any."""
        with self._lock:
            if waiter.held is None:
                self._queues[waiter.tenant].remove(waiter)
            return waiter.held

    async def acquire(self, tenant: str, may_refuse: bool = True) -> Held | float:
        """Wait for a slot for a request of ``tenant`` (on the event loop).

        Args:
            tenant: whose request.
            may_refuse: whether it may be refused past its share (a request already under
                way that gave its slot back meanwhile is not).

        Returns:
            The slot (give it back with ``release``), or the seconds to wait before asking
            again when ``tenant`` is past its share.
        """
        loop = asyncio.get_running_loop()
        done: asyncio.Future[None] = loop.create_future()

        loop_thread = threading.get_ident()

        def wake() -> None:
            # From the loop's own thread (an HTTP request's release) no wake-up write is needed.
            if threading.get_ident() == loop_thread:
                loop.call_soon(_settle, done)
            else:
                loop.call_soon_threadsafe(_settle, done)

        def make_wake() -> Callable[[], None]:
            return wake

        got = self._enter(tenant, make_wake, may_refuse)
        if not isinstance(got, _Waiter):
            return got
        try:
            await done
        except BaseException:
            given = self._withdraw(got)
            if given is not None:
                self.release(given, done=False)
            raise
        assert got.held is not None, "a waiter is woken once it holds a slot"
        return got.held

    def acquire_blocking(self, tenant: str) -> Held | float:
        """``acquire`` for a thread (the transfer port's): blocks until a slot is free."""
        event = threading.Event()
        got = self._enter(tenant, lambda: event.set, True)
        if not isinstance(got, _Waiter):
            return got
        event.wait()
        assert got.held is not None, "a waiter is woken once it holds a slot"
        return got.held


def _settle(done: asyncio.Future[None]) -> None:
    if not done.done():  # cancelled meanwhile: _withdraw gives the slot back
        done.set_result(None)
