"""Keep freed host memory in the process instead of handing it back to the kernel after each op.

A prefill step allocates tens of megabytes of activations per layer (a 2,048-token chunk's
gate/up projection alone is 25 MB in fp32) and frees them a moment later. glibc's malloc serves
blocks that large from fresh ``mmap``s and gives them back on ``free``, or trims the top of its
heap once enough is free there, so the next layer's activations fault in and zero every page
again: tens of thousands of minor page faults per prefill step, which the thresholds below cut
by an order of magnitude. vLLM's CPU backend asks its users for tcmalloc for the same reason;
this gets most of it from the allocator already in the process.

The cost is that the process keeps its peak of transient memory (a few hundred MB for a
2,048-token step of a small model) instead of returning it, which a serving process does anyway
on its next step.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import sys

log = logging.getLogger(__name__)

# mallopt parameters (glibc's malloc.h).
_M_TRIM_THRESHOLD = -1
_M_TOP_PAD = -2
_M_MMAP_THRESHOLD = -3
# Blocks below this come from the heap, not their own mapping: glibc's own ceiling (32 MiB on
# 64-bit), above the largest activation of a 2,048-token step.
MMAP_THRESHOLD_BYTES = 32 << 20
# Free memory at the top of the heap kept before any is trimmed.
TRIM_THRESHOLD_BYTES = 1 << 30
# Extra room the heap grows by, so growth comes in fewer, larger steps.
TOP_PAD_BYTES = 64 << 20


@functools.cache
def keep_freed_memory() -> bool:
    """Set glibc malloc's thresholds for this process (once; later calls return the first
    answer).

    Returns:
        ``True`` if they were set; ``False`` where the C library is not glibc (no ``mallopt``)
        or refused a value, and then nothing is changed beyond what it accepted.
    """
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # musl and others: no mallopt
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    settings = (
        (_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES),
        (_M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES),
        (_M_TOP_PAD, TOP_PAD_BYTES),
    )
    ok = all(mallopt(param, value) == 1 for param, value in settings)
    if not ok:
        log.warning("malloc thresholds not set: activations will fault their pages in again")
    return ok
