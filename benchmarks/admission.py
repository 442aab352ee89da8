"""Admission (issues 54 and 66): the disk's writes each policy saves, against the hits it keeps.

Two traces, each replayed once per admission policy (``cachetier.admission``: ``adaptive``, the
default, ``all``, which is store-all and the baseline, ``second_hit``, ``tinylfu``, at their
default settings) and disk
capacity, through a ``TieredStore`` of a CPU tier over a real ``DiskTier`` in a folder on a
disk (``benchmarks.support.admission_tiers``: the store's own admission path, its writer,
record files and byte budget):

- ``conversation``: the shipped Mooncake conversation trace
  (``workloads/mooncake_conversation_trace.jsonl.gz``): multi-turn chats, each turn resending
  the one before; most blocks are used once, and nothing at a block's first sighting says
  which ones will be used again.
- ``rag``: a trace this benchmark makes (``benchmarks.support.admission_traces.RagShape``,
  seeded): 6,000 requests, each a 4-block system prompt shared by all, then one of 5,000
  documents of 8 to 40 blocks (uniform) drawn by a Zipf popularity of exponent 0.8 over
  shuffled ranks, then a question of 1 to 3 blocks of its own (the last partial); Poisson
  arrivals 500 ms apart on average. A few documents are reused heavily, the tail once or
  twice, the questions never.

Blocks are 512 tokens (a trace block); the CPU tier holds 10,000 and the disk is swept over
the report's admission capacities (10,000, 14,000, 27,000, 50,000 and 100,000: its curve's
points from the CPU tier's up).

Issue 66's figures: ``adaptive_margin_min``, the adaptive policy's hit ratio minus the best
fixed policy's at the same capacity (least over capacities and traces);
``adaptive_writes_where_filter_wins``, its disk bytes against store-all's where a filter is the
best fixed policy (most); ``sampled_curve_max_abs_error``, the largest difference between the
report's default sampled replay and ``--exact`` over every curve policy, admission policy and
capacity of both traces (``benchmarks.support.admission_curve``); and
``report_conversation_trace_s``, the wall time of ``cachetier report --trace`` on the shipped
conversation trace at its defaults (not measured with ``--quick``; it shares the cores with
whatever else runs: ``report_load_average`` is the machine's load when it ended, and
``--report-only`` times it alone). Figures, per trace, policy and capacity:
the block hit ratio, the bytes the disk tier wrote (its record files), and against store-all
at the same capacity ``hit_rate_delta_vs_store_all`` (absolute) and
``disk_bytes_written_vs_store_all``. A policy meets issue 54's targets on a trace when, at
every capacity, it writes at most half of store-all's bytes and loses at most half a point of
hit rate; ``targets_met_by`` lists the policies that meet both on both traces (possibly
none), ``best_filter`` says for each policy which targets it met, and the top-level
``disk_bytes_written_vs_store_all`` and ``hit_rate_delta_vs_store_all`` are the default
policy's worst over both traces. A policy whose disk evicted nothing at one capacity is not
replayed at the larger ones (the capacity never bound, so the replay would be the same; its
row says ``replayed_at_disk_blocks``).

    python -m benchmarks.admission --json [--data-dir DIR] [--quick] [--report-only]

``--quick`` replays 150 requests of each trace at tiny capacities (for tests).
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

from benchmarks.support.admission_curve import sampled_vs_exact, time_report
from benchmarks.support.admission_tiers import DiskReplay, replay_on_disk
from benchmarks.support.admission_traces import (
    CONVERSATION_TRACE,
    RagShape,
    conversation_requests,
    rag_requests,
)
from benchmarks.support.output import emit
from benchmarks.support.workdir import disk_work_dir
from cachetier.admission import (
    ADMISSION_POLICIES,
    DEFAULT_ADMISSION_POLICY,
    FIXED_POLICIES,
    AdmissionConfig,
)
from cachetier.report.admission_figure import BASELINE, admission_figure
from cachetier.report.admission_replay import FILTERED_TIER
from cachetier.report.config import DEFAULT_NUM_WORKERS, DEFAULT_POLICY, ReportConfig
from cachetier.report.hierarchy_replay import admission_capacities
from cachetier.report.replay import ReplayTrace
from cachetier.report.workers import CurveRunner

BYTES_TARGET = 0.5
"""Most of store-all's disk bytes a policy may write, at every capacity."""
HIT_DELTA_TARGET = -0.005
"""Least hit rate change against store-all (absolute), at every capacity."""
ADAPTIVE_MARGIN_TARGET = -0.005
"""Least hit rate of ``adaptive`` minus the best fixed policy's, at every capacity."""
ADAPTIVE_WRITES_TARGET = 0.5
"""Most of store-all's disk bytes ``adaptive`` may write where a filter is the best policy."""
SAMPLED_ERROR_TARGET = 0.005
"""Largest error of the report's sampled curve against ``--exact``, at every point."""
REPORT_SECONDS_TARGET = 20.0
"""Most seconds of the default report of the shipped conversation trace."""
CPU_BLOCKS = 10_000
DISK_CAPACITIES = admission_capacities(ReportConfig(trace="-", cpu_blocks=CPU_BLOCKS))
"""The report's admission capacities: its curve's points from the CPU tier's up."""
EVICTION = DEFAULT_POLICY  # the store's default, as the report replays it
QUICK_REQUESTS = 150
QUICK_DOCUMENTS = 60
QUICK_CPU_BLOCKS = 100
QUICK_CAPACITIES = (200, 800)


def traces(quick: bool) -> dict[str, tuple[ReplayTrace, dict[str, Any]]]:
    """The two keyed traces, each with what describes it in the JSON."""
    shape = (
        RagShape(num_requests=QUICK_REQUESTS, num_documents=QUICK_DOCUMENTS)
        if quick
        else RagShape()
    )
    limit = QUICK_REQUESTS if quick else None
    return {
        "conversation": (
            ReplayTrace.from_requests(conversation_requests(limit)),
            {"source": str(CONVERSATION_TRACE.relative_to(CONVERSATION_TRACE.parents[1]))},
        ),
        "rag": (ReplayTrace.from_requests(rag_requests(shape)), {"shape": shape.as_dict()}),
    }


def replay_all(
    name: str, trace: ReplayTrace, folder: Path, cpu_blocks: int, capacities: tuple[int, ...]
) -> dict[str, tuple[DiskReplay, ...]]:
    """Every policy at every capacity, each in a fresh folder under ``folder``, the policies
    spread over the cores (``CurveRunner``).

    A capacity is not replayed when the policy's disk evicted nothing at a smaller one: the
    capacity never bound, so a larger disk holds the same blocks before every request and the
    replay is the same (its ``replay.disk_blocks`` says where it ran).
    """
    jobs = [(policy, 0) for policy in ADMISSION_POLICIES]
    run = functools.partial(
        _replay_policy, name=name, folder=folder, cpu_blocks=cpu_blocks, capacities=capacities
    )
    results = CurveRunner(trace, jobs, DEFAULT_NUM_WORKERS, run).run()
    return {policy: runs for (policy, _), runs in zip(jobs, results)}


def _replay_policy(
    trace: ReplayTrace,
    job: tuple[str, int],
    *,
    name: str,
    folder: Path,
    cpu_blocks: int,
    capacities: tuple[int, ...],
) -> tuple[DiskReplay, ...]:
    policy = job[0]
    done: list[DiskReplay] = []
    for capacity in capacities:
        if done and done[-1].disk_evictions == 0:
            done.append(done[-1])
            continue
        with tempfile.TemporaryDirectory(dir=folder, prefix=f"{name}-{policy}-") as disk:
            run = replay_on_disk(
                trace,
                AdmissionConfig(admission_policy=policy),
                Path(disk),
                cpu_blocks=cpu_blocks,
                disk_blocks=capacity,
                policy=EVICTION,
            )
        done.append(run)
        print(
            f"{name} {policy:>10} disk {capacity:>7,}: hit ratio "
            f"{run.replay.block_hit_ratio:.4f}, {run.disk_bytes_written:>11,} bytes "
            f"written, {run.disk_evictions:,} evicted, {run.replay.elapsed_s:.1f} s",
            file=sys.stderr,
        )
    return tuple(done)


def adaptive_figures(
    runs: dict[str, tuple[DiskReplay, ...]], capacities: tuple[int, ...]
) -> list[dict[str, Any]]:
    """Per capacity: ``adaptive`` against the best fixed policy there, and its writes."""
    rows = []
    for i, capacity in enumerate(capacities):
        fixed = {p: runs[p][i].replay.block_hit_ratio for p in FIXED_POLICIES}
        best = max(fixed, key=lambda p: fixed[p])
        adaptive = runs["adaptive"][i]
        rows.append(
            {
                "disk_blocks": capacity,
                "best_fixed": best,
                "adaptive_margin": round(adaptive.replay.block_hit_ratio - fixed[best], 5),
                "adaptive_writes_vs_store_all": round(
                    _ratio(adaptive.disk_bytes_written, runs[BASELINE][i].disk_bytes_written), 4
                ),
            }
        )
    return rows


def _ratio(value: int, baseline: int) -> float:
    return value / baseline if baseline else 1.0


def trace_figures(
    runs: dict[str, tuple[DiskReplay, ...]],
    capacities: tuple[int, ...],
    cpu_blocks: int,
) -> tuple[list[dict[str, Any]], dict[str, dict[str, Any]]]:
    """One row per policy and capacity, and per policy its worst figures and targets met."""
    figure = admission_figure(
        {p: tuple(r.replay for r in rs) for p, rs in runs.items()}, capacities, cpu_blocks, EVICTION
    )
    base = runs[BASELINE]
    rows: list[dict[str, Any]] = []
    summary: dict[str, dict[str, Any]] = {}
    for policy, rs in runs.items():
        deltas = figure["hit_rate_delta_vs_all"][policy]
        ratios = [_ratio(r.disk_bytes_written, b.disk_bytes_written) for r, b in zip(rs, base)]
        for i, run in enumerate(rs):
            replay = run.replay
            rows.append(
                {
                    "policy": policy,
                    "disk_blocks": capacities[i],
                    "block_hit_ratio": round(replay.block_hit_ratio, 5),
                    "token_hit_ratio": round(replay.token_hit_ratio, 5),
                    "disk_hit_ratio": round(
                        replay.hit_blocks[FILTERED_TIER] / replay.num_blocks, 5
                    ),
                    "hit_rate_delta_vs_store_all": round(deltas[i], 5),
                    "disk_bytes_written": run.disk_bytes_written,
                    "disk_bytes_written_vs_store_all": round(ratios[i], 4),
                    "disk_refused_blocks": replay.admission_stats.get("refused", 0),
                    "disk_evictions": run.disk_evictions,
                    "replayed_at_disk_blocks": replay.disk_blocks,
                    "replay_s": round(replay.elapsed_s, 1),
                }
            )
        summary[policy] = _targets(max(ratios), min(deltas))
    return rows, summary


def _targets(bytes_ratio: float, hit_delta: float) -> dict[str, Any]:
    """A policy's worst figures and which of issue 54's targets they meet."""
    meets_bytes, meets_hits = bytes_ratio <= BYTES_TARGET, hit_delta >= HIT_DELTA_TARGET
    return {
        "disk_bytes_written_vs_store_all_max": round(bytes_ratio, 4),
        "hit_rate_delta_vs_store_all_min": round(hit_delta, 5),
        "meets_bytes_target": meets_bytes,
        "meets_hit_rate_target": meets_hits,
        "meets_both_targets": meets_bytes and meets_hits,
    }


def describe(trace: ReplayTrace, runs: dict[str, tuple[DiskReplay, ...]]) -> dict[str, Any]:
    """The trace's size and reuse, and the replays' common facts."""
    uses = Counter(key for keys in trace.keys for key in keys)
    every = [run for rs in runs.values() for run in rs]
    return {
        "num_requests": len(trace.requests),
        "num_block_refs": sum(uses.values()),
        "num_distinct_blocks": len(uses),
        "one_use_block_share": round(sum(n == 1 for n in uses.values()) / len(uses), 4),
        "record_bytes": every[0].record_bytes,
        "tracked_keys": every[0].replay.tracked_keys,
        "writes_dropped": sum(run.writes_dropped for run in every),
    }


def measure(
    folder: Path,
    *,
    quick: bool = False,
    cpu_blocks: int | None = None,
    capacities: tuple[int, ...] | None = None,
) -> dict[str, Any]:
    """The figures of the module docstring.

    Args:
        folder: a folder on a disk; each replay's disk tier is a fresh folder in it.
        quick: 150 requests of each trace at tiny capacities.
        cpu_blocks: the CPU tier's capacity in blocks (default: by ``quick``).
        capacities: the disk capacities in blocks, ascending (default: by ``quick``).
    """
    start = time.perf_counter()
    cpu_blocks = cpu_blocks or (QUICK_CPU_BLOCKS if quick else CPU_BLOCKS)
    capacities = tuple(sorted(capacities or (QUICK_CAPACITIES if quick else DISK_CAPACITIES)))
    rows: dict[str, list[dict[str, Any]]] = {}
    per_trace: dict[str, dict[str, Any]] = {}
    for name, (trace, about) in traces(quick).items():
        runs = replay_all(name, trace, folder, cpu_blocks, capacities)
        rows[name], summary = trace_figures(runs, capacities, cpu_blocks)
        per_trace[name] = {
            **about,
            **describe(trace, runs),
            "policies": summary,
            "adaptive": adaptive_figures(runs, capacities),
            "sampled_curve": sampled_vs_exact(trace, cpu_blocks),
        }
    adaptive = [row for t in per_trace.values() for row in t["adaptive"]]
    filter_wins = [
        r["adaptive_writes_vs_store_all"] for r in adaptive if r["best_fixed"] != BASELINE
    ]
    # Other work may share the cores while it runs: read it beside the machine's load.
    report_s = None if quick else round(time_report(CONVERSATION_TRACE), 1)
    best = {
        policy: _targets(
            max(
                t["policies"][policy]["disk_bytes_written_vs_store_all_max"]
                for t in per_trace.values()
            ),
            min(
                t["policies"][policy]["hit_rate_delta_vs_store_all_min"] for t in per_trace.values()
            ),
        )
        for policy in ADMISSION_POLICIES
    }
    default = best[DEFAULT_ADMISSION_POLICY]
    return {
        "adaptive_margin_min": min(r["adaptive_margin"] for r in adaptive),
        "adaptive_writes_where_filter_wins": max(filter_wins, default=None),
        "sampled_curve_max_abs_error": max(
            t["sampled_curve"]["max_abs_error"] for t in per_trace.values()
        ),
        "report_conversation_trace_s": report_s,
        "report_load_average": round(os.getloadavg()[0], 2),  # over the last minute
        "adaptive_targets": {
            "adaptive_margin_min": ADAPTIVE_MARGIN_TARGET,
            "adaptive_writes_where_filter_wins": ADAPTIVE_WRITES_TARGET,
            "sampled_curve_max_abs_error": SAMPLED_ERROR_TARGET,
            "report_conversation_trace_s": REPORT_SECONDS_TARGET,
        },
        "default_policy": DEFAULT_ADMISSION_POLICY,
        "disk_bytes_written_vs_store_all": default["disk_bytes_written_vs_store_all_max"],
        "hit_rate_delta_vs_store_all": default["hit_rate_delta_vs_store_all_min"],
        "targets": {
            "disk_bytes_written_vs_store_all_max": BYTES_TARGET,
            "hit_rate_delta_vs_store_all_min": HIT_DELTA_TARGET,
        },
        "targets_met_by": [p for p, figures in best.items() if figures["meets_both_targets"]],
        "best_filter": best,
        "policies": list(ADMISSION_POLICIES),
        "cpu_blocks": cpu_blocks,
        "disk_capacities": list(capacities),
        "quick": quick,
        "traces": per_trace,
        "replays": rows,
        "elapsed_s": round(time.perf_counter() - start, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--quick", action="store_true", help="150 requests, tiny capacities")
    parser.add_argument(
        "--data-dir", default=None, help="parent of the disk tiers' temp folders (on a disk)"
    )
    parser.add_argument(
        "--report-only",
        action="store_true",
        help="time the report on the conversation trace alone (what a loaded machine distorts)",
    )
    args = parser.parse_args()
    if args.report_only:
        seconds = round(time_report(CONVERSATION_TRACE), 1)
        load = round(os.getloadavg()[0], 2)
        emit({"report_conversation_trace_s": seconds, "report_load_average": load}, args.json)
        return
    parent = disk_work_dir(args.data_dir, "--data-dir")
    with tempfile.TemporaryDirectory(prefix="bench-admission-", dir=parent) as tmp:
        emit(measure(Path(tmp), quick=args.quick), args.json)


if __name__ == "__main__":
    main()
