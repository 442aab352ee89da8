"""Who gets a connection on the transfer port: two budgets, one for clients that have said who
they are and a small one for connections that have not yet.

A connection is *unknown* from its accept until its hello names a tenant, then *known*. Only
known connections count against ``max_known`` (the port's ``transfer_connections``), so
sockets that connect and never speak, or trickle a hello, cannot take the slots that clients
with tokens need. Unknown connections have their own ``max_unknown`` slots; when all are taken,
a new connection drops the oldest unknown one rather than being refused:

- refusing the newcomer would let whoever holds the slots keep them: ``max_unknown`` silent
  sockets, renewed as each hello deadline passes, would turn every real client away;
- dropping the oldest means an attacker must open ``max_unknown`` connections within the time
  a real client takes for its hello (one round trip) to push it out, and each drop frees its
  thread at once.

Known slots are shared by tenant (``fairness.TenantWeights``): each tenant is guaranteed
``max_known`` times its weight's part of all weights (rounded down), and may borrow slots no one
holds. A tenant under its guarantee that finds every slot taken reclaims one from the tenant
furthest past its own (that tenant's oldest connection is shut; its client reconnects and is
answered ``BUSY`` while it is past its share). So a tenant holding every slot it can never
keeps another out, and past its share a tenant is answered ``BUSY``, never another tenant.

A connection is refused at once (``BUSY``) only when every known slot is taken and no tenant
could get one back (none is under its guarantee while another is past its own): then no hello
could get it one.
"""

from __future__ import annotations

import socket
import threading
from collections import OrderedDict

from cachetier.server.fairness import TenantWeights


class Ticket:
    """One accepted connection's place in the budgets.

    Args:
        handle: a duplicate of the connection's socket, to shut the connection down by (the
            serving thread may have wrapped its own in TLS meanwhile); closed when the
            connection leaves.
    """

    __slots__ = ("handle", "known", "tenant", "dropped", "left")

    def __init__(self, handle: socket.socket) -> None:
        self.handle = handle
        self.known = False
        self.tenant: str | None = None  # once known
        self.dropped = False
        self.left = False


class Admission:
    """The two connection budgets of a transfer server. Thread-safe.

    Args:
        max_known: most connections past their hello.
        max_unknown: most connections before it.
        weights: the tenants' weights the known slots are shared by; ``None``: one tenant's
            connections may take them all.
    """

    def __init__(
        self, max_known: int, max_unknown: int, weights: TenantWeights | None = None
    ) -> None:
        if max_known <= 0 or max_unknown <= 0:
            raise ValueError(f"budgets must be positive, got {max_known} and {max_unknown}")
        self._max_known = max_known
        self._max_unknown = max_unknown
        self._weights = weights
        self._num_known = 0
        self._known: dict[str, OrderedDict[Ticket, None]] = {}  # per tenant, oldest first
        self._unknown: OrderedDict[Ticket, None] = OrderedDict()  # oldest first
        self._lock = threading.Lock()
        self.num_dropped = 0  # unknown connections dropped for a newer one
        self.num_reclaimed = 0  # known connections shut to give their slot back to its share

    def arrive(self, sock: socket.socket) -> Ticket | None:
        """Take an unknown slot for a new connection, dropping the oldest unknown one if none
        is free.

        Args:
            sock: the accepted connection.

        Returns:
            Its ticket; ``None`` when every known slot is taken (answer ``BUSY`` and close).
        """
        with self._lock:
            if self._num_known >= self._max_known and not self._may_reclaim_locked():
                return None
            oldest = None
            if len(self._unknown) >= self._max_unknown:
                oldest, _ = self._unknown.popitem(last=False)
                oldest.dropped = True
                self.num_dropped += 1
                _shut(oldest.handle)  # its thread's read ends at once; it then leaves
            ticket = Ticket(sock.dup())
            self._unknown[ticket] = None
        return ticket

    def promote(self, ticket: Ticket, tenant: str) -> bool:
        """Move a connection whose hello named a tenant to a known slot, reclaiming one from a
        tenant past its share if ``tenant`` is under its own and none is free.

        Args:
            ticket: its ticket.
            tenant: the tenant its hello's token names.

        Returns:
            Whether it has one; ``False`` when it was dropped meanwhile, or every slot is taken
            and ``tenant`` holds its share (or no one is past theirs).
        """
        with self._lock:
            if ticket.dropped:
                return False
            if self._num_known >= self._max_known:
                held = len(self._known.get(tenant, ()))
                victim = self._over_share_locked()
                if victim is None or held >= self.guaranteed(tenant):
                    return False
                self._reclaim_locked(victim)
            del self._unknown[ticket]
            self._num_known += 1
            self._known.setdefault(tenant, OrderedDict())[ticket] = None
            ticket.known = True
            ticket.tenant = tenant
        return True

    def guaranteed(self, tenant: str) -> int:
        """Known slots ``tenant`` can always get: its weight's part of them, rounded down (none
        when there are fewer slots than such parts)."""
        if self._weights is None:
            return self._max_known
        return int(self._weights.share(tenant, self._max_known))

    def _may_reclaim_locked(self) -> bool:
        """Whether a hello could get a slot back: a tenant is under its guarantee and another
        past its own."""
        if self._weights is None or self._over_share_locked() is None:
            return False
        return any(
            len(self._known.get(tenant, ())) < self.guaranteed(tenant)
            for tenant in self._weights.weights
        )

    def num_known_of(self, tenant: str) -> int:
        """Known slots ``tenant`` holds now."""
        with self._lock:
            return len(self._known.get(tenant, ()))

    def _over_share_locked(self) -> str | None:
        """The tenant furthest past its guarantee (by slots over it per weight), or ``None``."""
        if self._weights is None:
            return None
        best, best_over = None, 0.0
        for tenant, tickets in self._known.items():
            over = (len(tickets) - self.guaranteed(tenant)) / self._weights.weights.get(tenant, 1.0)
            if over > best_over:
                best, best_over = tenant, over
        return best

    def _reclaim_locked(self, tenant: str) -> None:
        """Take the slot of ``tenant``'s oldest connection and shut that connection."""
        oldest, _ = self._known[tenant].popitem(last=False)
        oldest.known = False  # its slot is given back here, not when its thread leaves
        self._num_known -= 1
        self.num_reclaimed += 1
        _shut(oldest.handle)

    def shut(self, ticket: Ticket) -> None:
        """Shut a connection down (its deadline passed): its thread's blocked read or write
        ends, and the thread then leaves."""
        with self._lock:
            # Under the lock, like leave(): never the socket of a later connection that was
            # given the same file descriptor.
            if not ticket.left:
                _shut(ticket.handle)

    def leave(self, ticket: Ticket) -> None:
        """Give back a connection's slot when it ends, whatever happened to it."""
        with self._lock:
            if ticket.left:
                return
            ticket.left = True
            if ticket.known:
                self._num_known -= 1
                assert ticket.tenant is not None, "a known ticket has a tenant"
                self._known[ticket.tenant].pop(ticket, None)
            else:
                self._unknown.pop(ticket, None)
            ticket.handle.close()

    @property
    def num_unknown(self) -> int:
        """Connections holding an unknown slot now."""
        with self._lock:
            return len(self._unknown)


def _shut(handle: socket.socket) -> None:
    try:
        handle.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass  # its client closed it already
