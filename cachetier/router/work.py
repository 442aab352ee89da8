"""``PrepareQueue``: the router's CPU-heavy steps (parsing a body, tokenizing it, keying and
weighing its blocks) on a few threads of their own, never on the event loop.

The tokenizer's Rust core lets go of the GIL while it encodes, so a thread is enough to keep
the loop (``/healthz``, streaming answers, the pollers) answering while a long prompt is
tokenized. The queue is bounded: a request that finds ``max_queued`` others waiting or
running is refused at once (503, ``Retry-After``), and one whose work is not done within
``timeout_s`` is answered 503 too; its thread finishes the work and drops the result.
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from cachetier.errors import OverloadedError

T = TypeVar("T")
PREPARE_NICENESS = 10
"""How much lower the prepare threads' CPU priority is than the event loop's: on busy cores the
loop thread is woken first, so ``/healthz`` and streaming answers do not wait behind tokenizing.
"""


class PrepareBusyError(OverloadedError):
    """The router has no room for a request's preparation now, or it took too long."""


class PrepareQueue:
    """A bounded pool of threads for the work each request needs before it is forwarded.

    Args:
        num_threads: threads that run the work.
        max_queued: requests whose work may wait or run at once; more are refused.
        timeout_s: the longest a request waits for its work, queueing included.
    """

    def __init__(self, num_threads: int, max_queued: int, timeout_s: float) -> None:
        if num_threads < 1 or max_queued < num_threads:
            raise ValueError(
                f"need num_threads >= 1 and max_queued >= num_threads, got {num_threads}, "
                f"{max_queued}"
            )
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s}")
        self.max_queued = max_queued
        self.timeout_s = timeout_s
        self.num_queued = 0  # read and written on the event loop only
        self.num_refused = 0
        self.num_timed_out = 0
        self._pool = ThreadPoolExecutor(
            num_threads, thread_name_prefix="router-prepare", initializer=_lower_priority
        )

    async def run(self, work: Callable[[], T]) -> T:
        """``work()`` on a pool thread; its exceptions are raised here.

        Raises:
            PrepareBusyError: the queue is full, or the work passed ``timeout_s``.
        """
        if self.num_queued >= self.max_queued:
            self.num_refused += 1
            raise PrepareBusyError(
                f"the router is busy preparing {self.num_queued} requests: retry shortly"
            )
        loop = asyncio.get_running_loop()
        self.num_queued += 1
        future = self._pool.submit(work)
        # The count drops when the thread is done, not when the caller gives up: a request
        # that timed out still holds its place until its work really ends.
        future.add_done_callback(lambda _: loop.call_soon_threadsafe(self._release))
        try:
            return await asyncio.wait_for(asyncio.wrap_future(future), self.timeout_s)
        except asyncio.TimeoutError:
            self.num_timed_out += 1
            raise PrepareBusyError(
                f"preparing the request (tokenizing its prompt) took longer than "
                f"{self.timeout_s:g} s: send a shorter prompt, or retry when the router is "
                "less busy"
            ) from None

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _release(self) -> None:
        self.num_queued -= 1


def _lower_priority() -> None:
    # Linux keeps a nice value per thread; elsewhere (or where refused) the thread runs as is.
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), PREPARE_NICENESS)
    except (AttributeError, OSError):
        pass
