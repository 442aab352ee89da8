"""Giving memory that a burst of connections freed back to the system.

A flood of TLS handshakes allocates an SSL object and buffers per connection; once they are
closed, Python and OpenSSL free that memory, but glibc's allocator keeps the freed pages in its
arenas, so the process's resident size stays at the burst's peak for as long as it runs.
``malloc_trim`` hands free pages at the top and in the middle of the heaps back to the kernel.
Elsewhere (musl, macOS) there is no such call and nothing is done.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
from collections.abc import Callable

logger = logging.getLogger("cachetier.server.heap")


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
    """Trims the heap once a burst is over: after ``threshold`` events (handshakes) have ended
    since the last trim and none is in progress.

    Args:
        threshold: how many ended events make a burst worth a trim (a trim walks the heap:
            cheap, but not for every connection).
    """

    def __init__(self, threshold: int = 256) -> None:
        if threshold <= 0:
            raise ValueError(f"threshold must be positive, got {threshold}")
        self._threshold = threshold
        self._trim = _load_malloc_trim()
        self._ended = 0
        self.num_trims = 0

    def note_ended(self, num_in_progress: int) -> bool:
        """One event ended, ``num_in_progress`` are still going on.

        Returns:
            Whether a trim is due (the caller runs ``trim`` once the closed connections'
            objects are freed: a moment later).
        """
        self._ended += 1
        return self._trim is not None and not num_in_progress and self._ended >= self._threshold

    def trim(self) -> None:
        """Hand free heap pages back to the kernel, and start counting the next burst."""
        if self._trim is None:
            return
        self._ended = 0
        self._trim(0)
        self.num_trims += 1
        logger.debug("heap trimmed after a burst of connections")
