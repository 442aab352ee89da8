"""The store's writers: each lower tier gets its puts on a thread of its own, from a bounded
queue, so a slow disk or link never holds up the engine's save; a full queue drops the put and
counts it, rather than blocking or growing without end.

A writer at the lowest priority (``SCHED_IDLE``) runs only on cores nothing else wants. An
engine that keeps every core busy while it serves (vLLM-CPU) leaves none, so that writer may
never run: in a replayed trace through vLLM-CPU the disk tier took one byte
in ten of those saved and the rest were dropped from a full queue. A second thread, at nice 19
but in the normal class (which the kernel still gives a slice to), applies puts that have
waited longer than ``AGED_AFTER_S``: it wakes twice a second and does nothing while the idle
writer keeps up. A thread cannot leave ``SCHED_IDLE`` without ``CAP_SYS_NICE``, hence a second
thread rather than a raised priority."""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from cachetier.primitives.keys import BlockHash
from cachetier.record import KVBlock
from cachetier.tiers.base import Tier
from cachetier.tiers.stats import TierStats
from cachetier.util.parallel import become_background

_STOP = object()
# How long a flush waits on a writer thread that applies nothing before it applies queued puts
# itself (``TierWriter.join``).
HELP_AFTER_S = 0.25
# How long a put may wait for the idle writer before the aged-backlog thread applies it.
AGED_AFTER_S = 1.0


class TierWriter:
    """One background thread applying queued puts to one lower tier.

    Args:
        tier: the lower tier it writes.
        max_blocks: most blocks queued before a put is dropped (counted ``rejected``).
        max_bytes: most bytes queued before a put is dropped; ``None`` for no byte bound.
        stats: the store's counters.
        nice: the thread's CPU priority (``cachetier.util.parallel.become_background``).
    """

    def __init__(
        self, tier: Tier, max_blocks: int, max_bytes: int | None, stats: TierStats, nice: int
    ) -> None:
        self.tier = tier
        self._nice = nice
        self._queue: queue.Queue[Any] = queue.Queue()
        self._max_blocks = max_blocks
        self._max_bytes = max_bytes
        self._pending_blocks = 0
        self._pending_bytes = 0
        self._num_applied = 0  # puts applied, by any thread: what a flush sees progress by
        self._lock = threading.Lock()
        self._stats = stats
        # Told ``(namespace, keys)`` of each put the tier took (the store's block events).
        self.on_written: Callable[[str, Sequence[BlockHash]], None] | None = None
        self._stopped = threading.Event()
        self._thread = threading.Thread(
            target=self._run, name=f"cachetier-writer-{tier.name}", daemon=True
        )
        self._thread.start()
        self._aged: threading.Thread | None = None
        if nice == 19:  # only the idle class can starve
            self._aged = threading.Thread(
                target=self._run_aged, name=f"cachetier-aged-writer-{tier.name}", daemon=True
            )
            self._aged.start()

    def submit(self, namespace: str, blocks: Sequence[KVBlock]) -> bool:
        # Bytes too, not only blocks: 4096 blocks of 64 MiB would be 256 GiB of queue.
        nbytes = sum(b.nbytes for b in blocks)
        with self._lock:
            if self._pending_blocks + len(blocks) > self._max_blocks or (
                self._max_bytes is not None and self._pending_bytes + nbytes > self._max_bytes
            ):
                self._stats.add(rejected=len(blocks))
                return False
            self._pending_blocks += len(blocks)
            self._pending_bytes += nbytes
        self._queue.put((namespace, blocks, nbytes, time.monotonic()))
        return True

    def _run(self) -> None:
        become_background(self._nice)
        while self._apply(self._queue.get()):
            pass

    def _apply(self, item: Any) -> bool:
        """Apply one queued put (on whichever thread took it); ``False`` for the stop mark."""
        try:
            if item is _STOP:
                return False
            namespace, blocks, nbytes, _ = item
            try:
                self.tier.put_many(namespace, blocks)
            except Exception:  # noqa: BLE001 - a lower tier must never kill the writer
                self._stats.add(errors=len(blocks))
            else:
                if self.on_written is not None:
                    self.on_written(namespace, [b.key for b in blocks])
            with self._lock:
                self._pending_blocks -= len(blocks)
                self._pending_bytes -= nbytes
                self._num_applied += 1
            return True
        finally:
            self._queue.task_done()

    def _run_aged(self) -> None:
        """Apply puts the idle writer left waiting for ``AGED_AFTER_S``, at nice 19."""
        become_background(self._nice, idle_class=False)
        while not self._stopped.wait(AGED_AFTER_S / 2):
            while self._oldest_age() >= AGED_AFTER_S and self._apply_one_here():
                pass

    def _oldest_age(self) -> float:
        """Seconds the head of the queue has waited; 0 for none (or the stop mark)."""
        with self._queue.mutex:
            head = self._queue.queue[0] if self._queue.queue else None
        if head is None or head is _STOP:
            return 0.0
        return time.monotonic() - head[3]

    def pending_blocks(self) -> int:
        with self._lock:
            return self._pending_blocks

    def join(self, deadline: float | None) -> bool:
        """Wait until every queued put is applied, or ``deadline`` (monotonic) passes.

        The writer thread runs at the lowest priority (``SCHED_IDLE`` at 19), which a node whose
        cores other processes keep busy may never give a slice: a flush at shutdown then lost
        every queued block. So once the writer has applied nothing for ``HELP_AFTER_S``, the
        caller, who is waiting anyway, applies queued puts itself at its own priority.

        Returns:
            ``True`` if everything was applied, ``False`` at the deadline.
        """
        seen, since = self._num_applied, time.monotonic()
        while self._queue.unfinished_tasks:
            now = time.monotonic()
            if deadline is not None and now >= deadline:
                return False
            if self._num_applied != seen:
                seen, since = self._num_applied, now
            if now - since < HELP_AFTER_S or not self._apply_one_here():
                time.sleep(0.001)
        return True

    def _apply_one_here(self) -> bool:
        """Apply the next queued put on the calling thread; ``False`` if there was none."""
        try:
            item = self._queue.get_nowait()
        except queue.Empty:  # the writer thread holds the last one
            return False
        if item is _STOP:  # stopped meanwhile: the mark is the writer thread's
            self._queue.task_done()
            self._queue.put(item)
            return False
        return self._apply(item)

    def stop(self) -> None:
        self._stopped.set()
        self._queue.put(_STOP)
        self._thread.join(timeout=5)
        if self._aged is not None:
            self._aged.join(timeout=5)
