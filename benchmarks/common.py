"""What every benchmark shares: interleaved timing, medians, and the JSON last line."""

from __future__ import annotations

import ctypes
import gc
import json
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any


def interleaved_medians(
    runs: dict[str, Callable[[], object]], repeats: int, warmup: int = 1
) -> dict[str, float]:
    """Median seconds of each function, run in turn (a, b, a, b, ...) so drift hits all alike.

    Args:
        runs: name -> function to time (one call is one sample).
        repeats: samples per function.
        warmup: untimed calls of each function first.

    Returns:
        name -> median seconds.
    """
    for _ in range(warmup):
        for fn in runs.values():
            fn()
    samples: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(repeats):
        for name, fn in runs.items():
            start = time.perf_counter()
            fn()
            samples[name].append(time.perf_counter() - start)
    return {name: statistics.median(s) for name, s in samples.items()}


def settle() -> None:
    """Free what earlier measurements left behind and hand it back to the OS, so the heap
    state one measurement leaves does not tilt the next (glibc only; a no-op elsewhere)."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def emit(result: dict[str, Any], as_json: bool) -> None:
    """Print a human summary, then (with ``--json``) the result as the last line."""
    for key, value in result.items():
        if isinstance(value, float):
            print(f"{key:>32}: {value:.4g}", file=sys.stderr if as_json else sys.stdout)
        elif not isinstance(value, dict):
            print(f"{key:>32}: {value}", file=sys.stderr if as_json else sys.stdout)
    if as_json:
        print(json.dumps(result, sort_keys=True))
