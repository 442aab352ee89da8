"""Eviction policies on the Mooncake conversation trace, replayed through a real ``CPUTier``.

Block hit ratio (leading hit blocks / all block references) of every policy in
``cachetier.tiers.eviction.POLICIES`` at each capacity, beside Belady's offline policy and an
infinite cache. The baseline is LRU replayed in the same run: ``vs_lru`` is policy / LRU, > 1 is
better. ``default`` is the policy ``StoreConfig`` uses.

    python -m benchmarks.policies --json
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

from benchmarks.support.children import REPO_ROOT
from benchmarks.support.output import emit
from cachetier.report.replay import (
    ReplayResult,
    ReplayTrace,
    replay_belady,
    replay_infinite,
    replay_tier,
)
from cachetier.store.config import StoreConfig
from cachetier.tiers.eviction import POLICIES

TRACE = str(REPO_ROOT / "workloads" / "mooncake_conversation_trace.jsonl.gz")
CAPACITIES = (2_000, 5_000, 10_000, 20_000, 50_000, 100_000)
HEADLINE = (10_000, 50_000)  # the capacities the issue quotes figures for


def default_policy() -> str:
    """The eviction policy a ``StoreConfig`` gets when none is named."""
    return next(f.default for f in dataclasses.fields(StoreConfig) if f.name == "policy")  # type: ignore[return-value]


def run(trace_path: str, capacities: list[int]) -> dict[str, object]:
    """Replay every policy and Belady at every capacity, and the infinite cache once."""
    start = time.perf_counter()
    trace = ReplayTrace.load(trace_path)
    prepare_s = time.perf_counter() - start
    results: dict[str, dict[int, ReplayResult]] = {name: {} for name in [*POLICIES, "belady"]}
    for capacity in capacities:
        for name in POLICIES:
            results[name][capacity] = replay_tier(trace, name, capacity)
        results["belady"][capacity] = replay_belady(trace, capacity)
    ceiling = replay_infinite(trace)
    default = default_policy()
    lru = results["lru"]
    out: dict[str, object] = {
        "trace": Path(trace_path).name,
        "num_requests": ceiling.summary()["num_requests"],
        "num_blocks": ceiling.num_blocks,
        "default_policy": default,
        "ceiling": ceiling.block_hit_ratio,
        "ceiling_token_hit_ratio": ceiling.token_hit_ratio,
        "ceiling_alignment_lost_tokens": ceiling.num_alignment_lost_tokens,
    }
    for capacity in HEADLINE:
        tag = f"{capacity // 1000}k"
        out[f"lru_{tag}"] = lru[capacity].block_hit_ratio
        out[f"default_{tag}"] = results[default][capacity].block_hit_ratio
        out[f"belady_{tag}"] = results["belady"][capacity].block_hit_ratio
    # Lists in ``capacities`` order, ready to plot.
    out["capacities"] = capacities
    out["curve"] = {n: [by[c].block_hit_ratio for c in capacities] for n, by in results.items()}
    out["token_curve"] = {
        n: [by[c].token_hit_ratio for c in capacities] for n, by in results.items()
    }
    out["vs_lru"] = {
        n: [by[c].num_hit_blocks / max(lru[c].num_hit_blocks, 1) for c in capacities]
        for n, by in results.items()
        if n != "lru"
    }
    out["beats_lru_at_every_capacity"] = sorted(
        name
        for name in POLICIES
        if name != "lru"
        and all(results[name][c].num_hit_blocks > lru[c].num_hit_blocks for c in capacities)
    )
    out["default_ge_lru_at_every_capacity"] = all(
        results[default][c].num_hit_blocks >= lru[c].num_hit_blocks for c in capacities
    )
    out["prepare_s"] = prepare_s
    out["replay_s"] = {n: [by[c].elapsed_s for c in capacities] for n, by in results.items()}
    out["replay_s_max_tier"] = max(r.elapsed_s for n in POLICIES for r in results[n].values())
    out["total_s"] = time.perf_counter() - start
    return out


def print_table(result: dict[str, object], file: object) -> None:
    """Hit ratios by capacity, one row per policy."""
    caps: list[int] = result["capacities"]  # type: ignore[assignment]
    curve: dict[str, list[float]] = result["curve"]  # type: ignore[assignment]
    lines = [f"{'block hit ratio':>16}" + "".join(f"{c:>9}" for c in caps)]
    lines += [f"{n:>16}" + "".join(f"{r:>9.4f}" for r in rs) for n, rs in curve.items()]
    lines.append(f"{'infinite':>16}{result['ceiling']:>9.4f} at any capacity")
    print("\n".join(lines), file=file)  # type: ignore[call-overload]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--json", action="store_true", help="print one JSON object last")
    parser.add_argument("--trace", default=TRACE, help="Mooncake-format .jsonl trace")
    parser.add_argument(
        "--capacities",
        default=",".join(map(str, CAPACITIES)),
        help="comma-separated capacities in blocks (10000 and 50000 are always added)",
    )
    args = parser.parse_args()
    capacities = sorted({int(c) for c in args.capacities.split(",") if c} | set(HEADLINE))
    result = run(args.trace, capacities)
    print_table(result, sys.stderr if args.json else sys.stdout)
    emit(result, args.json)


if __name__ == "__main__":
    main()
