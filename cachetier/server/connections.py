"""Who holds an HTTP connection, and for how long: the HTTP port's ``limit_conn``.

Every accepted connection takes a place in a ``ConnectionTable`` until it ends. It is
*unauthenticated* until one of its requests shows a valid token, then *known*:

- all connections together are capped (``max_connections``); a new one past the cap takes the
  place of the oldest unauthenticated connection, or is closed at once when every connection is
  known;
- unauthenticated ones have a smaller cap; past it the oldest of them is closed, so connections
  that never say who they are cannot keep a client with a token out (refusing the newcomer
  would let whoever holds the places keep them);
- an unauthenticated connection is closed ``unauthenticated_timeout_s`` after its accept, kept
  alive or not: it may ask for health or limits, not hold a descriptor;
- TLS handshakes in progress have a cap of their own: each holds buffers until it ends.

Runs on the event loop's thread only (no lock).
"""

from __future__ import annotations

import asyncio
from collections import Counter, OrderedDict
from collections.abc import Callable

from cachetier.server.fdlimits import ConnectionCaps

Drop = Callable[[str], bool]
"""Closes a connection, given the reason (a metric label); returns whether it did. Only for
``unauthenticated_timeout`` may it decline: a request that showed a token meanwhile promotes
its connection instead."""


class Entry:
    """One connection's place in the table; ``drop`` is set once it has a transport."""

    __slots__ = ("drop", "known", "left", "timer")

    def __init__(self) -> None:
        self.drop: Drop | None = None
        self.known = False
        self.left = False
        self.timer: asyncio.TimerHandle | None = None


class ConnectionTable:
    """The HTTP port's connection caps and the unauthenticated deadline (module docstring).

    Args:
        caps: the caps.
        unauthenticated_timeout_s: seconds a connection may stay without a valid token.
        loop: the event loop the server runs on.
    """

    def __init__(
        self,
        caps: ConnectionCaps,
        unauthenticated_timeout_s: float,
        loop: asyncio.AbstractEventLoop,
    ) -> None:
        self.caps = caps
        self._timeout_s = unauthenticated_timeout_s
        self._loop = loop
        self._unknown: OrderedDict[Entry, None] = OrderedDict()  # oldest first
        self._handshakes: OrderedDict[Entry, None] = OrderedDict()
        self.num_known = 0
        self.num_shed: Counter[str] = Counter()  # connections closed by the table, by reason
        self.num_refused = 0  # connections closed at their accept: every place known

    @property
    def num_open(self) -> int:
        """Connections holding a place now."""
        return self.num_known + len(self._unknown)

    @property
    def num_handshakes(self) -> int:
        """TLS handshakes in progress."""
        return len(self._handshakes)

    @property
    def num_unauthenticated(self) -> int:
        """Connections without a valid token yet."""
        return len(self._unknown)

    def arrive(self) -> Entry | None:
        """A place for a connection just accepted, shedding the oldest unauthenticated one if
        a cap is reached.

        Returns:
            Its entry; ``None`` when every place is held by a known connection (close it).
        """
        if self.num_open >= self.caps.max_connections and not self.shed_oldest(1, "connection_cap"):
            self.num_refused += 1
            return None
        if len(self._unknown) >= self.caps.max_unauthenticated:
            self.shed_oldest(1, "unauthenticated_cap")
        entry = Entry()
        self._unknown[entry] = None
        entry.timer = self._loop.call_later(self._timeout_s, self._expire, entry)
        return entry

    def begin_handshake(self, entry: Entry) -> None:
        """Count a TLS handshake in progress, dropping the oldest if the cap is reached."""
        while len(self._handshakes) >= self.caps.max_tls_handshakes:
            oldest, _ = self._handshakes.popitem(last=False)
            self._shed(oldest, "tls_handshake_cap")
        self._handshakes[entry] = None

    def end_handshake(self, entry: Entry) -> None:
        """The handshake of ``entry`` is over (done or failed)."""
        self._handshakes.pop(entry, None)

    def promote(self, entry: Entry) -> None:
        """A request of this connection showed a valid token: it is known from now on."""
        if entry.known or entry.left:
            return
        entry.known = True
        self._unknown.pop(entry, None)
        self.num_known += 1
        if entry.timer is not None:
            entry.timer.cancel()
            entry.timer = None

    def leave(self, entry: Entry) -> None:
        """Give back a connection's place when it ends (any number of times)."""
        if entry.left:
            return
        entry.left = True
        if entry.timer is not None:
            entry.timer.cancel()
            entry.timer = None
        self._handshakes.pop(entry, None)
        if entry.known:
            self.num_known -= 1
        else:
            self._unknown.pop(entry, None)

    def shed_oldest(self, count: int, reason: str) -> int:
        """Close up to ``count`` of the oldest unauthenticated connections.

        Args:
            count: how many.
            reason: why (a metric label): e.g. ``descriptors`` when an accept ran out of them.

        Returns:
            How many were closed.
        """
        shed = 0
        while shed < count and self._unknown:
            oldest, _ = self._unknown.popitem(last=False)
            self._shed(oldest, reason)
            shed += 1
        return shed

    def _shed(self, entry: Entry, reason: str) -> None:
        drop = entry.drop
        self.leave(entry)
        self.num_shed[reason] += 1
        if drop is not None:
            drop(reason)

    def _expire(self, entry: Entry) -> None:
        entry.timer = None
        if entry.known or entry.left:
            return
        drop = entry.drop
        # The connection decides: one whose request in progress has shown a token is promoted
        # instead of closed.
        if drop is None or drop("unauthenticated_timeout"):
            self.leave(entry)
            self.num_shed["unauthenticated_timeout"] += 1
