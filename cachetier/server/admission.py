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

A connection is refused at once (``BUSY``) only when every known slot is taken: then no hello
could get it one.
"""

from __future__ import annotations

import socket
import threading
from collections import OrderedDict


class Ticket:
    """One accepted connection's place in the budgets.

    Args:
        handle: a duplicate of the connection's socket, to shut the connection down by (the
            serving thread may have wrapped its own in TLS meanwhile); closed when the
            connection leaves.
    """

    __slots__ = ("handle", "known", "dropped", "left")

    def __init__(self, handle: socket.socket) -> None:
        self.handle = handle
        self.known = False
        self.dropped = False
        self.left = False


class Admission:
    """The two connection budgets of a transfer server. Thread-safe.

    Args:
        max_known: most connections past their hello.
        max_unknown: most connections before it.
    """

    def __init__(self, max_known: int, max_unknown: int) -> None:
        if max_known <= 0 or max_unknown <= 0:
            raise ValueError(f"budgets must be positive, got {max_known} and {max_unknown}")
        self._max_known = max_known
        self._max_unknown = max_unknown
        self._num_known = 0
        self._unknown: OrderedDict[Ticket, None] = OrderedDict()  # oldest first
        self._lock = threading.Lock()
        self.num_dropped = 0  # unknown connections dropped for a newer one

    def arrive(self, sock: socket.socket) -> Ticket | None:
        """Take an unknown slot for a new connection, dropping the oldest unknown one if none
        is free.

        Args:
            sock: the accepted connection.

        Returns:
            Its ticket; ``None`` when every known slot is taken (answer ``BUSY`` and close).
        """
        with self._lock:
            if self._num_known >= self._max_known:
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

    def promote(self, ticket: Ticket) -> bool:
        """Move a connection whose hello named a tenant to a known slot.

        Args:
            ticket: its ticket.

        Returns:
            Whether it has one; ``False`` when all are taken or it was dropped meanwhile.
        """
        with self._lock:
            if ticket.dropped or self._num_known >= self._max_known:
                return False
            del self._unknown[ticket]
            self._num_known += 1
            ticket.known = True
        return True

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
