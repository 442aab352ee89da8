"""How benchmarks time: interleaved runs, their medians and paired ratios, CPU time, settling."""

from __future__ import annotations

import ctypes
import gc
import math
import os
import statistics
import time
from collections.abc import Callable, Sequence


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


def paired_ratio_interval(
    num: Sequence[float], den: Sequence[float], confidence: float = 0.95
) -> tuple[float, float, float]:
    """The median of the per-round ratios ``num[i] / den[i]`` of two interleaved runs, and a
    distribution-free interval for it (order statistics of the binomial, nothing assumed of
    the ratios' shape). Samples taken in turn are paired: the drift a round sees hits both,
    so a ratio's spread across rounds says whether a median ratio near 1.0 is a difference
    or this machine's noise.

    Args:
        num: one op's samples, in round order (e.g. the peer's seconds).
        den: the other op's, the same rounds.
        confidence: the interval's coverage of the true median ratio, at least.

    Returns:
        ``(low, median, high)``; with too few rounds for that coverage, the lowest and
        highest ratio seen.

    Raises:
        ValueError: no rounds, rounds that do not pair up, or a sample that is not > 0.
    """
    if len(num) != len(den) or not num:
        raise ValueError(f"{len(num)} and {len(den)} samples do not pair up round by round")
    if min(den) <= 0 or min(num) <= 0:
        raise ValueError("a sample is not a positive time")
    ratios = sorted(a / b for a, b in zip(num, den, strict=True))
    n = len(ratios)
    # The k-th lowest and k-th highest ratios bound the median with probability
    # 1 - 2 * P(Binomial(n, 1/2) < k): the largest k that keeps that at least ``confidence``.

    def coverage(k: int) -> float:
        return 1 - 2 * sum(math.comb(n, i) for i in range(k)) / 2**n

    k = max((k for k in range(1, n // 2 + 1) if coverage(k) >= confidence), default=1)
    return ratios[k - 1], statistics.median(ratios), ratios[n - k]


def cpu_ns(pid: int) -> int:
    """CPU time of every thread of process ``pid`` so far, in nanoseconds (Linux).

    ``/proc/<pid>/task/<tid>/schedstat`` counts each thread's time on a CPU in nanoseconds;
    ``/proc/<pid>/stat`` and ``getrusage`` of another process count 10 ms ticks, too coarse
    for one put. A thread that ends between the listing and its read is left out.
    """
    total = 0
    tasks = f"/proc/{pid}/task"
    for tid in os.listdir(tasks):
        try:
            with open(f"{tasks}/{tid}/schedstat", "rb") as f:
                total += int(f.read().split()[0])
        except (FileNotFoundError, ProcessLookupError):
            continue
    return total


def settle() -> None:
    """Free what earlier measurements left behind and hand it back to the OS, so the heap
    state one measurement leaves does not tilt the next (glibc only; a no-op elsewhere)."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
