"""How many connections the server may hold, from the process's descriptor limit.

Every connection costs a descriptor (a transfer connection two: its socket and the duplicate its
admission ticket shuts it down by), and so do the disk tier's files, Redis and the listeners. A
server whose connections take every descriptor can accept nothing more, not even from a client
with a token, and its disk tier cannot open a record. So the caps sit below the limit with room
to spare, and the connections that have not said who they are get a small part of them.
"""

from __future__ import annotations

import resource
from dataclasses import dataclass

from cachetier.server.config import ServerConfig
from cachetier.util.checks import positive_int

MIN_RESERVED_FDS = 64  # disk records, Redis, listeners, logs: never given to connections


def raise_nofile_limit() -> int:
    """Raise the soft ``RLIMIT_NOFILE`` to the hard one (a process may, unprivileged).

    Returns:
        The soft limit now in force.
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft == resource.RLIM_INFINITY:
        return soft if soft != resource.RLIM_INFINITY else 1 << 20
    if soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (OSError, ValueError):
            pass  # a container that forbids it: serve within the soft limit
    return soft


@dataclass(frozen=True, slots=True)
class ConnectionCaps:
    """The HTTP port's connection caps.

    Args:
        max_connections: most HTTP connections open at once; past it a new one takes the place
            of the oldest unauthenticated one, or is closed at once.
        max_unauthenticated: most HTTP connections open that have not yet shown a valid token
            (TLS handshakes included); past it the oldest of them is closed.
        max_tls_handshakes: most TLS handshakes in progress at once; past it the oldest is
            dropped (each holds buffers of a few hundred KiB until it ends).
    """

    max_connections: int
    max_unauthenticated: int
    max_tls_handshakes: int

    def __post_init__(self) -> None:
        for name in ("max_connections", "max_unauthenticated", "max_tls_handshakes"):
            positive_int(name, getattr(self, name))
        if self.max_unauthenticated > self.max_connections:
            raise ValueError("max_unauthenticated must be at most max_connections")

    @classmethod
    def of(cls, config: ServerConfig, nofile: int) -> ConnectionCaps:
        """The caps a config sets, its unset ones derived from the descriptor limit.

        Args:
            config: the server's settings (``max_connections``,
                ``max_unauthenticated_connections``, ``max_tls_handshakes``).
            nofile: the process's soft ``RLIMIT_NOFILE`` (``raise_nofile_limit``).

        Returns:
            The caps: by default an eighth of the limit (at least ``MIN_RESERVED_FDS``) and two
            descriptors per transfer connection stay free; HTTP connections may take the rest,
            unauthenticated ones a quarter of that.
        """
        reserved = max(MIN_RESERVED_FDS, nofile // 8)
        transfer = 2 * (config.transfer_connections + config.transfer_unauthenticated_connections)
        derived = max(16, nofile - reserved - transfer)
        max_connections = config.max_connections or derived
        max_unauthenticated = config.max_unauthenticated_connections or max(4, max_connections // 4)
        return cls(
            max_connections=max_connections,
            max_unauthenticated=min(max_unauthenticated, max_connections),
            max_tls_handshakes=min(config.max_tls_handshakes, max_unauthenticated),
        )
