"""Deadlines for blocking connections: one thread that acts when a deadline passes.

The transfer port serves each connection on a thread of its own with blocking sockets; a
socket timeout bounds one read, and a client that sends a byte now and then renews it for as
long as it likes. A deadline kept here bounds a whole hello, request head or body instead:
when it passes, its callback shuts the connection down, which ends whatever read or write
its thread is blocked in (a TLS handshake and a record's read included), wherever it is.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import threading
import time
from collections.abc import Callable

logger = logging.getLogger("cachetier.server.watchdog")


class Watch:
    """One armed deadline (``Watchdog.arm``); ``Watchdog.disarm`` it when the work is done."""

    __slots__ = ("deadline", "action", "cancelled")

    def __init__(self, deadline: float, action: Callable[[], None]) -> None:
        self.deadline = deadline
        self.action = action
        self.cancelled = False


class Watchdog:
    """Runs each armed action once its deadline passes, unless it was disarmed first.

    Args:
        name: the name of its thread.
    """

    def __init__(self, name: str = "cachetier-watchdog") -> None:
        self._heap: list[tuple[float, int, Watch]] = []  # earliest deadline first
        self._order = itertools.count()  # ties: first armed, first run
        self._num_cancelled = 0
        self._cond = threading.Condition()
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def arm(self, seconds: float, action: Callable[[], None]) -> Watch:
        """Run ``action`` in ``seconds`` unless disarmed.

        Args:
            seconds: from now.
            action: what to do then (quick and non-blocking: e.g. shut a socket down).

        Returns:
            The watch, to disarm.
        """
        watch = Watch(time.monotonic() + seconds, action)
        with self._cond:
            heapq.heappush(self._heap, (watch.deadline, next(self._order), watch))
            if self._heap[0][2] is watch:
                self._cond.notify()
        return watch

    def disarm(self, watch: Watch | None) -> None:
        """Cancel a watch (one that already ran, or ``None``, is fine)."""
        if watch is None:
            return
        with self._cond:
            if watch.cancelled:
                return
            watch.cancelled = True
            self._num_cancelled += 1
            # Cancelled watches stay in the heap until their time; many requests a second
            # would pile them up for a whole deadline, so the heap is rebuilt without them.
            if self._num_cancelled > 1024 and self._num_cancelled > len(self._heap) // 2:
                self._heap = [item for item in self._heap if not item[2].cancelled]
                heapq.heapify(self._heap)
                self._num_cancelled = 0

    def stop(self) -> None:
        """Stop the thread; actions not yet run never run."""
        with self._cond:
            self._stopped = True
            self._cond.notify()
        self._thread.join(5)

    def _run(self) -> None:
        with self._cond:
            while not self._stopped:
                now = time.monotonic()
                while self._heap and self._heap[0][0] <= now:
                    _, _, watch = heapq.heappop(self._heap)
                    if watch.cancelled:
                        self._num_cancelled -= 1
                        continue
                    watch.cancelled = True  # ran: a later disarm does nothing
                    try:
                        watch.action()
                    except Exception:  # noqa: BLE001 - one bad action must not end the thread
                        logger.exception("a deadline's action failed")
                self._cond.wait(self._heap[0][0] - now if self._heap else None)


class Deadline:
    """The one deadline a connection is under at a time (its hello, a request's head, its
    body), restarted as it moves from one to the next.

    Args:
        watchdog: whose thread keeps it.
        action: what to do if it passes (shut the connection down).
    """

    def __init__(self, watchdog: Watchdog, action: Callable[[], None]) -> None:
        self._watchdog = watchdog
        self._action = action
        self._watch: Watch | None = None

    def start(self, seconds: float) -> None:
        """From now, ``seconds`` (replacing the deadline before, if any)."""
        self.stop()
        self._watch = self._watchdog.arm(seconds, self._action)

    def stop(self) -> None:
        """No deadline until the next ``start``."""
        self._watchdog.disarm(self._watch)
        self._watch = None
