"""Where the connector's time goes: calls and seconds per hook, per process.

vLLM calls the worker's hooks around every forward and the scheduler's in every schedule, so
what they cost is what a cache costs on a day with no hits. ``benchmarks.vllm_overhead``
reads this to publish the breakdown. Timing a call costs two ``perf_counter`` calls and a lock,
about a microsecond, against hooks that run a few times per step.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

_F = TypeVar("_F", bound=Callable[..., Any])

_lock = threading.Lock()
_totals: dict[str, list[float]] = {}  # name -> [calls, seconds]


def add(name: str, seconds: float) -> None:
    """Count one call of ``name`` that took ``seconds``."""
    with _lock:
        entry = _totals.setdefault(name, [0, 0.0])
        entry[0] += 1
        entry[1] += seconds


def timed(name: str) -> Callable[[_F], _F]:
    """Decorate a hook so that every call is counted under ``name``."""

    def wrap(fn: _F) -> _F:
        @functools.wraps(fn)
        def inner(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                add(name, time.perf_counter() - start)

        return inner  # type: ignore[return-value]

    return wrap


def snapshot() -> dict[str, dict[str, float]]:
    """``{name: {"calls": n, "seconds": s}}`` since the process started (or ``reset``)."""
    with _lock:
        return {k: {"calls": int(c), "seconds": s} for k, (c, s) in sorted(_totals.items())}


def reset() -> None:
    with _lock:
        _totals.clear()
