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

Known connections are shared by tenant (``fairness.TenantWeights``), as the transfer port shares
its slots (``admission``): each tenant is guaranteed ``max_connections`` times its weight's part
of all weights (rounded down) and may borrow places no one holds. When every place is taken, a
new connection gets the place of the tenant furthest past its guarantee: that tenant's oldest
idle connection is closed (its oldest one when none is idle, once its answer is out). So a
tenant holding every place it can never keeps another out; past its share it loses its own
places, never another tenant's. Only when no tenant is past its share does a newcomer take the
place of the oldest unauthenticated connection, or, with none, get closed at once.

Runs on the event loop's thread only (no lock).
"""

from __future__ import annotations

import asyncio
from collections import Counter, OrderedDict
from collections.abc import Callable

from cachetier.server.fairness import TenantWeights
from cachetier.server.fdlimits import ConnectionCaps

Drop = Callable[[str], bool]
"""Closes a connection, given the reason (a metric label); returns whether it did. Only for
``unauthenticated_timeout`` may it decline: a request that showed a token meanwhile promotes
its connection instead."""
_IDLE_SCAN = 64  # of a tenant's oldest connections, how many are looked at for an idle one


class Entry:
    """One connection's place in the table; ``drop`` is set once it has a transport, ``busy``
    by its protocol while a request is read or answered."""

    __slots__ = ("busy", "drop", "known", "left", "tenant", "timer")

    def __init__(self) -> None:
        self.drop: Drop | None = None
        self.known = False
        self.left = False
        self.busy = False
        self.tenant: str | None = None  # once known
        self.timer: asyncio.TimerHandle | None = None


class ConnectionTable:
    """The HTTP port's connection caps and the unauthenticated deadline (module docstring).

    Args:
        caps: the caps.
        unauthenticated_timeout_s: seconds a connection may stay without a valid token.
        loop: the event loop the server runs on.
        weights: the tenants' weights known places are shared by; ``None``: one tenant's
            connections may take them all.
    """

    def __init__(
        self,
        caps: ConnectionCaps,
        unauthenticated_timeout_s: float,
        loop: asyncio.AbstractEventLoop,
        weights: TenantWeights | None = None,
    ) -> None:
        self.caps = caps
        self._timeout_s = unauthenticated_timeout_s
        self._loop = loop
        self._weights = weights
        self._unknown: OrderedDict[Entry, None] = OrderedDict()  # oldest first
        self._known: dict[str, OrderedDict[Entry, None]] = {}  # per tenant, oldest first
        self._handshakes: OrderedDict[Entry, None] = OrderedDict()
        self.on_leave: Callable[[], None] | None = None  # told of every connection that ends
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

    def num_known_of(self, tenant: str) -> int:
        """Places ``tenant``'s known connections hold now."""
        return len(self._known.get(tenant, ()))

    def guaranteed(self, tenant: str) -> int:
        """Places ``tenant`` can always get: its weight's part of ``max_connections``, rounded
        down (all of them without weights)."""
        if self._weights is None:
            return self.caps.max_connections
        return int(self._weights.share(tenant, self.caps.max_connections))

    def arrive(self) -> Entry | None:
        """A place for a connection just accepted. When every place is taken it is one of the
        tenant furthest past its share, else the oldest unauthenticated connection's; past the
        unauthenticated cap the oldest of those is closed.

        Returns:
            Its entry; ``None`` when every place is held by known connections of tenants within
            their shares (close it).
        """
        if self.num_open >= self.caps.max_connections and not self._make_room():
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

    def promote(self, entry: Entry, tenant: str) -> None:
        """A request of this connection showed a valid token of ``tenant``: it is known, and
        that tenant's, from now on."""
        if entry.known or entry.left:
            return
        entry.known = True
        entry.tenant = tenant
        self._unknown.pop(entry, None)
        self._known.setdefault(tenant, OrderedDict())[entry] = None
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
            assert entry.tenant is not None, "a known entry has a tenant"
            self._known[entry.tenant].pop(entry, None)
        else:
            self._unknown.pop(entry, None)
        if self.on_leave is not None:
            self.on_leave()

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

    def _make_room(self) -> bool:
        """Free one place when all are taken: the tenant furthest past its share gives one
        back, else the oldest unauthenticated connection does. Returns whether one was freed."""
        tenant = self._over_share()
        if tenant is None:
            return bool(self.shed_oldest(1, "connection_cap"))
        held = self._known[tenant]
        victim = next((e for _, e in zip(range(_IDLE_SCAN), held) if not e.busy), None)
        self._shed(victim or next(iter(held)), "tenant_share")
        return True

    def _over_share(self) -> str | None:
        """The tenant furthest past its guarantee (by places over it per weight), or ``None``."""
        if self._weights is None:
            return None
        best, best_over = None, 0.0
        for tenant, held in self._known.items():
            weight = self._weights.weights.get(tenant, 1.0)
            over = (len(held) - self.guaranteed(tenant)) / weight
            if over > best_over:
                best, best_over = tenant, over
        return best

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
