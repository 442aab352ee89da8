"""The server's bound on bytes in flight: upload bodies being read, records being decoded.

Per request, the limits (``max_batch_bytes``, ``max_block_bytes``) bound what one client can
make the server hold; this bounds all of them together, so many clients at once cannot grow
the server past it either. A request that does not fit now is answered busy (HTTP 503, the
transfer port's ``BUSY``), never queued: the client backs off and retries.
"""

from __future__ import annotations

import threading

from cachetier.errors import OverloadedError


class ByteBudget:
    """Bytes that requests take before they hold them and give back when they are done.
    Thread-safe: the HTTP event loop and the transfer port's threads share one.

    Args:
        limit_bytes: most bytes taken at once.
    """

    def __init__(self, limit_bytes: int) -> None:
        if limit_bytes <= 0:
            raise ValueError(f"limit_bytes must be positive, got {limit_bytes}")
        self.limit_bytes = limit_bytes
        self._taken = 0
        self._lock = threading.Lock()

    @property
    def taken_bytes(self) -> int:
        """Bytes taken right now."""
        with self._lock:
            return self._taken

    def try_take(self, nbytes: int) -> bool:
        """Take ``nbytes`` if they fit under the limit.

        Args:
            nbytes: bytes to take (>= 0).

        Returns:
            Whether they were taken (if not, nothing was).
        """
        if nbytes < 0:
            raise ValueError(f"nbytes must be >= 0, got {nbytes}")
        with self._lock:
            if self._taken + nbytes > self.limit_bytes:
                return False
            self._taken += nbytes
            return True

    def take(self, nbytes: int, what: str) -> None:
        """Take ``nbytes`` or raise.

        Args:
            nbytes: bytes to take (>= 0).
            what: what they are for, for the error's message.

        Raises:
            OverloadedError: they do not fit now.
        """
        if not self.try_take(nbytes):
            raise OverloadedError(
                f"{what} of {nbytes} bytes does not fit in the {self.limit_bytes} bytes the "
                "server holds in flight; retry shortly"
            )

    def give(self, nbytes: int) -> None:
        """Give back bytes taken before.

        Args:
            nbytes: bytes to give back.
        """
        with self._lock:
            assert 0 <= nbytes <= self._taken, f"gave back {nbytes} of {self._taken} taken"
            self._taken -= nbytes


class Hold:
    """The bytes one request holds of a ``ByteBudget``, given back together when it is done.

    Args:
        budget: the budget to take from.
    """

    def __init__(self, budget: ByteBudget) -> None:
        self.budget = budget
        self.nbytes = 0

    def take(self, nbytes: int) -> bool:
        """Take ``nbytes`` more if they fit (``ByteBudget.try_take``); returns whether."""
        if not self.budget.try_take(nbytes):
            return False
        self.nbytes += nbytes
        return True

    def release(self) -> None:
        """Give back all this hold took."""
        self.budget.give(self.nbytes)
        self.nbytes = 0
