"""A few shared threads for the data paths: file reads and the copies that land blocks in KV
memory.

Both release the GIL for their bulk (``os.readv``, numpy's ``copyto``), so running a batch's
items on a few threads overlaps them: a large copy into a pool finishes in about half the time
on two cores, and cold disk reads keep several requests in flight instead of one. Small batches
stay on the caller's thread, where a hand-off would cost more than it saves.
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TypeVar

import numpy as np

_T = TypeVar("_T")
_I = TypeVar("_I")

# Threads the data paths use at most, the caller's included: one per core (up to 4). Measured
# here (2 cores, benchmarks.peers): 2 reader threads beat 3 and 4 on cached files, and tie them on
# cold ones; copies gain nothing past the cores.
WORKERS = max(1, min(4, os.cpu_count() or 1))
# Below this many bytes a copy stays on one thread: small pieces spend more on handing the GIL
# back and forth than a second thread wins; multi-megabyte ones split well.
_MIN_PARALLEL_COPY_BYTES = 16 << 20
_PIECE_BYTES = 16 << 20  # copies are cut into pieces of at most this size

# Threads for reads that wait on a cold disk (``submit_io``): waiting takes no core, and the
# device serves more requests in flight faster. On cached files the few data threads win (no
# wait to overlap, only hand-offs), so only files found cold come here.
IO_WORKERS = 8

_lock = threading.Lock()
_pools: dict[str, ThreadPoolExecutor] = {}  # by thread name prefix, each started on first use
_local = threading.local()


def _shared_pool(prefix: str, workers: int) -> ThreadPoolExecutor:
    """The process's pool of ``workers`` threads named ``prefix``, started on first use; its
    threads count as data threads (``_mark_worker``)."""
    with _lock:
        pool = _pools.get(prefix)
        if pool is None:
            pool = ThreadPoolExecutor(workers, thread_name_prefix=prefix, initializer=_mark_worker)
            _pools[prefix] = pool
        return pool


def _executor() -> ThreadPoolExecutor:
    return _shared_pool("cachetier-data", WORKERS - 1)


def may_wait_on_io() -> bool:
    """Whether the calling thread may hand reads to the I/O threads and wait for them: not
    one of the shared threads, and not background work (which never waits on them)."""
    return not getattr(_local, "worker", False)


def submit_io(fn: Callable[[], _T]) -> Future[_T]:
    """``fn``, a read that waits on the disk, started on one of the ``IO_WORKERS`` I/O threads
    (callers check ``may_wait_on_io`` first). They count as data threads: work they start
    (``beside``, ``map_in_threads``) runs on them."""
    return _shared_pool("cachetier-io", IO_WORKERS).submit(fn)


def _mark_worker() -> None:
    _local.worker = True


def beside(fn: Callable[[], _T]) -> Future[_T] | None:
    """``fn`` started on a shared data thread, to run beside the caller's own work.

    Returns:
        Its future, or ``None`` where the caller should run ``fn`` itself: it is one of those
        threads or background work (``map_in_threads``'s rule: they never wait on each other),
        or there is only one core.
    """
    if WORKERS <= 1 or getattr(_local, "worker", False):
        return None
    return _executor().submit(fn)


# The CPU priority of background work (writes to lower tiers): the lowest. On a host whose
# cores the engine keeps busy (vLLM-CPU runs one OpenMP thread per core), a writer at the
# engine's priority preempts a forward's threads and every other thread of the team waits for
# the one preempted: saving every block of a no-hit workload cost vLLM-CPU 13-30% that way,
# 4% at nice 19 (benchmarks.vllm_overhead), with every block still saved. At 19, Linux threads also
# take SCHED_IDLE: a nice-19 thread still preempts the engine's when it wakes (an fsync that
# returns), while an idle-class thread runs only on a core nothing else wants.
BACKGROUND_NICE = 19


def become_background(nice: int = BACKGROUND_NICE, *, idle_class: bool = True) -> None:
    """Make the calling thread background work.

    Its data work stays on it (``map_in_threads`` runs inline: the shared pool's threads serve
    reads a request waits for), and on Linux it runs at ``nice`` (there a thread has its own
    priority; elsewhere nice is the whole process's, so it is left alone); at 19, in the
    ``SCHED_IDLE`` class too.

    Args:
        nice: 0 (the process's priority) to 19 (the lowest).
        idle_class: at 19, take ``SCHED_IDLE`` as well (``False``: stay in the normal class,
            which the kernel still gives a slice on busy cores).
    """
    if not 0 <= nice <= 19:
        raise ValueError(f"nice must be in [0, 19], got {nice}")
    _local.worker = True
    if nice and sys.platform.startswith("linux"):
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)
            if nice == 19 and idle_class:
                # pid 0: the calling thread alone (Linux schedules threads, not processes).
                os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
        except OSError:  # a sandbox that forbids it: the work still runs, at normal priority
            pass


def map_in_threads(
    fn: Callable[[_I], _T], items: Sequence[_I], *, workers: int = WORKERS
) -> list[_T | BaseException]:
    """``fn`` over ``items`` on up to ``workers`` threads (the caller's among them).

    Args:
        fn: the work of one item.
        items: the items, each handed to one call.
        workers: most threads to use; 1 (or a call from one of these threads) runs inline.

    Returns:
        Per item, in order, ``fn``'s result or the exception it raised (one item's failure
        does not stop the others).
    """
    if len(items) == 1:  # a connector's one-block get: no pool, no list to build
        return [_call(fn, items[0])]
    workers = min(workers, WORKERS, len(items))
    if workers <= 1 or getattr(_local, "worker", False):
        return [_call(fn, item) for item in items]
    out: list[_T | BaseException] = [None] * len(items)  # type: ignore[list-item]

    def share(first: int) -> None:
        for i in range(first, len(items), workers):
            out[i] = _call(fn, items[i])

    pool = _executor()
    futures: list[Future[None]] = [pool.submit(share, w) for w in range(1, workers)]
    # The caller's share runs as one of the workers: its items must not wait on a pool thread
    # (``beside``) that is busy with the other shares.
    was_worker = getattr(_local, "worker", False)
    _local.worker = True
    try:
        share(0)
    finally:
        _local.worker = was_worker
    for future in futures:
        future.result()  # share() itself never raises
    return out


def _call(fn: Callable[[_I], _T], item: _I) -> _T | BaseException:
    try:
        return fn(item)
    except Exception as exc:  # returned to the caller, who decides per item
        return exc


def copy_into(pairs: Sequence[tuple[memoryview, memoryview]]) -> None:
    """Copy each source into its destination (same sizes, flat bytes), on a few threads when
    the total is large.

    Args:
        pairs: ``(dest, src)``; ``dest`` writable.
    """
    total = sum(dest.nbytes for dest, _ in pairs)
    if total < _MIN_PARALLEL_COPY_BYTES or WORKERS == 1:
        for dest, src in pairs:
            dest[:] = src
        return
    pieces = [
        (dest[start : start + _PIECE_BYTES], src[start : start + _PIECE_BYTES])
        for dest, src in pairs
        for start in range(0, dest.nbytes, _PIECE_BYTES)
    ]

    def copy(piece: tuple[memoryview, memoryview]) -> None:
        # copyto releases the GIL for the copy; a memoryview assignment does not.
        np.copyto(np.frombuffer(piece[0], dtype=np.uint8), np.frombuffer(piece[1], dtype=np.uint8))

    for result in map_in_threads(copy, pieces):
        if isinstance(result, BaseException):
            raise result
