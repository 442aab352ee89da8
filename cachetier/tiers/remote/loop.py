"""A private asyncio event loop in a background thread, for code that has to offer a blocking
API over async I/O (one loop per owner: no loop is shared through module state)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

from cachetier.errors import TierUnavailableError

_T = TypeVar("_T")


class LoopThread:
    """An event loop running forever in a daemon thread until ``close()``.

    Args:
        name: the thread's name (shows in stack dumps and profilers).
    """

    def __init__(self, name: str) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name=name, daemon=True)
        self._thread.start()
        self._closed = False

    def run(self, coro: Coroutine[Any, Any, _T], timeout_s: float) -> _T:
        """Run ``coro`` on the loop and wait for its result, from any other thread.

        Args:
            coro: the coroutine.
            timeout_s: longest wait, in seconds; the coroutine is cancelled after it.

        Returns:
            What the coroutine returned.

        Raises:
            TierUnavailableError: the wait timed out.
            RuntimeError: called on the loop's own thread (it would wait for itself), or
                after ``close()``.
        """
        self._check_usable(coro)
        if threading.current_thread() is self._thread:
            coro.close()
            raise RuntimeError("on the loop's own thread, await the async API instead")
        future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            return future.result(timeout=timeout_s)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise TierUnavailableError(f"no answer within {timeout_s:.3g} s") from None

    async def run_async(self, coro: Coroutine[Any, Any, _T]) -> _T:
        """Run ``coro`` on this loop and await it, from any event loop (or this one).

        Args:
            coro: the coroutine.

        Returns:
            What the coroutine returned.
        """
        self._check_usable(coro)
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is self._loop:
            return await coro
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, self._loop))

    def _check_usable(self, coro: Coroutine[Any, Any, Any]) -> None:
        if self._closed:
            coro.close()
            raise RuntimeError("the loop is closed")

    def close(self, last: Coroutine[Any, Any, Any] | None = None, timeout_s: float = 5.0) -> None:
        """Stop the loop and join its thread.

        Args:
            last: a coroutine to run first (e.g. closing a session), or ``None``.
            timeout_s: longest wait for ``last`` and for the thread, in seconds.
        """
        if self._closed:
            if last is not None:
                last.close()
            return
        if last is not None:
            try:
                self.run(last, timeout_s)
            except (TierUnavailableError, OSError):
                pass  # closing connections to a server that is gone: nothing left to do
        self._closed = True
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=timeout_s)
        if not self._thread.is_alive():
            self._loop.close()
