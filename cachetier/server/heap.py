"""Giving memory that a burst of connections freed back to the system.

A flood of connections (TLS handshakes, plain HTTP requests without a token, a tenant's
thousands of keep-alive connections) allocates a transport, a protocol, a parser and its
buffers per connection, and an SSL object with TLS; once they are closed, Python and OpenSSL
free that memory, but glibc's allocator keeps the freed pages in its arenas, so the process's
resident size stays at the burst's peak for as long as it runs. ``malloc_trim`` hands free
pages at the top and in the middle of the heaps back to the kernel. Elsewhere (musl, macOS)
there is no such call and nothing is done.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import gc
import logging
from collections.abc import Callable

logger = logging.getLogger("cachetier.server.heap")

SETTLE_S = 1.0
"""How long a burst must have been over before its trim: by then the closed connections'
transports and protocols are gone, and one more second of ends shows whether it goes on."""


def _load_malloc_trim() -> Callable[[int], int] | None:
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        trim = ctypes.CDLL(name).malloc_trim
    except (OSError, AttributeError):
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return trim


class HeapTrimmer:
    """Trims the heap once a burst of ended connections is over: ``threshold`` of them have
    ended since the last trim, then fewer than ``threshold`` in ``settle_s``, and ``busy()``
    (TLS handshakes in progress) says no.

    Args:
        loop: the event loop the connections end on (the trim runs there).
        busy: whether a burst is still under way whatever the ends say; never trimmed then.
        threshold: how many ended connections make a burst worth a trim (a trim walks the
            heap: cheap, but not for every connection).
        settle_s: seconds between a burst's last ends and its trim.
    """

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        busy: Callable[[], bool] = lambda: False,
        threshold: int = 256,
        settle_s: float = SETTLE_S,
    ) -> None:
        if threshold <= 0:
            raise ValueError(f"threshold must be positive, got {threshold}")
        if not settle_s > 0:
            raise ValueError(f"settle_s must be positive, got {settle_s!r}")
        self._loop = loop
        self._busy = busy
        self._threshold = threshold
        self._settle_s = settle_s
        self._trim = _load_malloc_trim()
        self._timer: asyncio.TimerHandle | None = None
        self._ended = 0  # since the last trim
        self._ended_at_arm = 0  # self._ended when the timer was armed
        self.num_trims = 0

    @property
    def can_trim(self) -> bool:
        """Whether this C library has ``malloc_trim``."""
        return self._trim is not None

    def note_ended(self) -> None:
        """One connection (or handshake) ended; arms the trim once a burst has."""
        self._ended += 1
        if self._timer is None and self._trim is not None and self._ended >= self._threshold:
            self._arm()

    def close(self) -> None:
        """Trim no more (the server stops)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def trim(self) -> None:
        """Hand free heap pages back to the kernel now, and start counting the next burst."""
        self._ended = 0
        if self._trim is None:
            return
        # The closed connections' objects that sit in reference cycles (a protocol and its
        # timers' callbacks) are freed only by a full collection, which may not come for long.
        gc.collect()
        self._trim(0)
        self.num_trims += 1
        logger.debug("heap trimmed after a burst of connections")

    def _arm(self) -> None:
        self._ended_at_arm = self._ended
        self._timer = self._loop.call_later(self._settle_s, self._settle)

    def _settle(self) -> None:
        self._timer = None
        if self._busy() or self._ended - self._ended_at_arm >= self._threshold:
            self._arm()  # still going on: freed memory is about to be used again
            return
        self.trim()
