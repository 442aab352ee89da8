"""Recycled payload buffers: a read lands in memory that is already mapped and faulted in.

A fresh multi-megabyte ``np.empty`` is a new mapping, and the read that fills it takes a page
fault per 4 KiB (a 5.6 MiB SmolLM2 block takes 1,440 faults, about as long as the copy).
Buffers handed out here go back to an idle list when the last object using them is collected,
and the next read of the same size reuses one: the same memory, already faulted in.

Each starts on a page boundary. malloc hands large blocks out 16 bytes past a page start, and
the kernel's copy of a read into memory that is not cache-line aligned is measurably slower.
"""

from __future__ import annotations

import threading
import weakref

import numpy as np

# Smaller buffers come cheaply from malloc's own free lists.
MIN_RECYCLED_BYTES = 64 * 1024
# Idle buffers kept at most, all sizes together; beyond this a returned buffer is freed.
MAX_IDLE_BYTES = 256 * 1024 * 1024
# Where a recycled buffer starts: a page boundary (so also a cache-line one).
ALIGN_BYTES = 4096

_lock = threading.Lock()
_idle: dict[int, list[np.ndarray]] = {}
_idle_bytes = 0
# Handed-out buffers: id of the weak reference to the array handed out -> (that reference,
# the buffer to take back when it fires). Single dict operations, atomic under the GIL.
_out: dict[int, tuple[weakref.ref[np.ndarray], np.ndarray]] = {}


def take(nbytes: int) -> np.ndarray:
    """A writable ``uint8`` array of ``nbytes``, contents undefined.

    Its memory returns to the idle list once the array and every view or buffer made from it
    are gone, so callers simply drop it like any other array.
    """
    global _idle_bytes
    if nbytes < MIN_RECYCLED_BYTES:
        return np.empty(nbytes, dtype=np.uint8)
    base = None
    with _lock:
        idle = _idle.get(nbytes)
        if idle:
            base = idle.pop()
            _idle_bytes -= nbytes
    if base is None:
        base = _aligned(nbytes)
    handed = base.view()  # a new array over the same memory: its end is the signal
    # A bare weak reference with a callback, kept alive here until it fires: far cheaper than
    # weakref.finalize, and it is paid on every read of a block.
    ref = weakref.ref(handed, _returned)
    _out[id(ref)] = (ref, base)
    return handed


def _returned(ref: weakref.ref[np.ndarray]) -> None:
    _give_back(_out.pop(id(ref))[1])


def _aligned(nbytes: int) -> np.ndarray:
    """``nbytes`` starting on an ``ALIGN_BYTES`` boundary (the array's base keeps the rest)."""
    whole = np.empty(nbytes + ALIGN_BYTES, dtype=np.uint8)
    skip = -int(whole.__array_interface__["data"][0]) % ALIGN_BYTES
    return whole[skip : skip + nbytes]


def _give_back(base: np.ndarray) -> None:
    global _idle_bytes
    with _lock:
        if _idle_bytes + base.nbytes > MAX_IDLE_BYTES:
            return  # dropped: numpy frees it
        _idle.setdefault(base.nbytes, []).append(base)
        _idle_bytes += base.nbytes


def idle_bytes() -> int:
    """Bytes waiting in the idle list."""
    with _lock:
        return _idle_bytes
