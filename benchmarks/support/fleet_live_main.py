"""The runs, settings and JSON of ``benchmarks.bench_fleet`` (its docstring says what each
figure is); that module only makes sure it runs from the checkout's root."""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Any

from benchmarks import fleet_sim
from benchmarks.support.admission_traces import CONVERSATION_TRACE
from benchmarks.support.fleet_live_procs import FleetSpec
from benchmarks.support.fleet_live_report import headline, print_table
from benchmarks.support.fleet_live_requests import (
    TOKENS_PER_ID,
    live_requests,
    pick_sessions,
    reuse_ceiling,
    unique_ids,
    warmup_prompts,
)
from benchmarks.support.fleet_live_runs import Drive, KillPlan, run_lost_events, run_policy
from benchmarks.support.output import emit
from benchmarks.support.workdir import disk_work_dir
from cachetier.fleet import POLICIES, RoutingConfig
from cachetier.report.replay import read_trace

BASELINE = "round_robin"
TARGET_POLICY = "tier_aware"
NUM_REPLICAS = 3
VICTIM = 1
KILL_AT = 0.2
# Cold rounds: the first is not timed (``fleet_live_runs``).
FULL = {"sessions": 30, "kill_sessions": 12, "lost_sessions": 10, "cold_rounds": 3}
QUICK = {"sessions": 4, "kill_sessions": 4, "lost_sessions": 4, "cold_rounds": 2}
QUICK_POLICIES = ("round_robin", "pool_only", "tier_aware")
"""The policies the headline figures compare: all ``--quick`` runs, for time."""


def model_shape(model_dir: Path) -> tuple[int, int]:
    """SmolLM2's vocabulary and the bytes of one token's KV (fp32, the engine's default)."""
    config = json.loads((model_dir / "config.json").read_text())
    head_dim = config["hidden_size"] // config["num_attention_heads"]
    per_token = config["num_hidden_layers"] * 2 * config["num_key_value_heads"] * head_dim * 4
    return int(config["vocab_size"]), per_token


def ordered_policies(names: str) -> list[str]:
    """The policies asked for, the baseline first (its cold rounds set the arrival rate)."""
    wanted = [p for p in names.split(",") if p]
    unknown = sorted(set(wanted) - set(POLICIES))
    if unknown:
        raise SystemExit(f"unknown policies {unknown}; known: {list(POLICIES)}")
    return sorted(set(wanted), key=lambda p: (p != BASELINE, list(POLICIES).index(p)))


def measure(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """Every live run and the simulated figures; the JSON the benchmark prints."""
    from cachetier.engine.smollm2 import smollm2_path  # torch: not for --help

    sizes = QUICK if args.quick else FULL
    model_dir = smollm2_path()
    vocab, token_bytes = model_shape(model_dir)
    trace = read_trace(args.trace)
    pick = {"max_ids": args.max_ids, "max_turns": args.max_turns}
    main_sessions = pick_sessions(trace, sizes["sessions"], **pick)
    skip = sizes["sessions"]
    kill_sessions = pick_sessions(trace, sizes["kill_sessions"], skip=skip, **pick)
    skip += sizes["kill_sessions"]
    lost_sessions = pick_sessions(trace, sizes["lost_sessions"], skip=skip, **pick)
    requests = live_requests(trace, main_sessions, vocab)
    block_bytes = TOKENS_PER_ID * token_bytes
    needed_bytes = unique_ids(requests) * block_bytes
    mean_ids = round(sum(len(r.hash_ids) for r in requests) / len(requests))
    warm = warmup_prompts(sizes["cold_rounds"] * args.replicas, mean_ids, vocab, TOKENS_PER_ID)
    warm_bytes = sum(len(p) for p in warm) * token_bytes
    drive = Drive(requests, warm, args.max_tokens, args.utilization)
    spec = FleetSpec(
        policy=BASELINE,
        model_dir=model_dir,
        num_replicas=args.replicas,
        kv_cache_bytes=args.pool_blocks * block_bytes,
        disk_bytes=args.disk_bytes,
        # The cold rounds' blocks come first and go first (LRU): room for them on top.
        shared_bytes=int(args.shared_fraction * needed_bytes) + warm_bytes,
        kv_events_queue=10_000,
        reconcile_interval_s=args.reconcile_interval_s,
        pin_cores=args.pin,
    )
    policies: dict[str, dict[str, Any]] = {}
    rate = None
    names = args.policies or ",".join(QUICK_POLICIES if args.quick else POLICIES)
    for policy in ordered_policies(names):
        kill = None
        if policy == TARGET_POLICY:
            kill = KillPlan(live_requests(trace, kill_sessions, vocab), VICTIM, KILL_AT)
        print(f"fleet: {policy}...", file=sys.stderr, flush=True)
        figures = run_policy(_with(spec, policy), work / policy, drive, rate, kill)
        rate = figures["arrival_rate"] if rate is None else rate
        policies[policy] = figures
    assert rate is not None, "at least one policy ran"
    print("fleet: lost events...", file=sys.stderr, flush=True)
    lost_requests = live_requests(trace, lost_sessions, vocab)
    lost_drive = Drive(lost_requests, warm, args.max_tokens, args.utilization)
    lost = run_lost_events(_with(spec, TARGET_POLICY), work / "lost", lost_drive)
    result: dict[str, Any] = {
        "command": command(args),
        "trace": Path(args.trace).name,
        "baseline": BASELINE,
        "settings": {
            "num_replicas": args.replicas,
            "replicas_pinned": args.pin,
            "num_sessions": sizes["sessions"],
            "num_requests": len(requests),
            "tokens_per_hash_id": TOKENS_PER_ID,
            "mean_prompt_tokens": sum(len(r.prompt) for r in requests) / len(requests),
            "max_prompt_tokens": max(len(r.prompt) for r in requests),
            "max_tokens": args.max_tokens,
            "pool_blocks": args.pool_blocks,
            "shared_bytes": spec.shared_bytes,
            "shared_fraction": args.shared_fraction,
            "needed_bytes": needed_bytes,
            "disk_bytes": args.disk_bytes,
            "utilization": args.utilization,
            "arrival_rate_per_s": rate,
            "reconcile_interval_s": args.reconcile_interval_s,
        },
        "policies": policies,
        "lost_events": lost,
    }
    if not args.no_simulated:
        print("fleet: simulated...", file=sys.stderr, flush=True)
        result["simulated"] = simulated(args.quick, args.trace)
    result.update(headline(result, BASELINE, TARGET_POLICY))
    result.update(routing_bounds(policies, reuse_ceiling(requests)))
    return result


def routing_bounds(policies: dict[str, dict[str, Any]], ceiling: float) -> dict[str, Any]:
    """What a perfect router could reach on these requests: the reuse ceiling, and per baseline
    the tokens it would compute (1 - ceiling) over those the baseline computed, which is the
    tier-aware TTFT ratio's bound where TTFT follows the tokens computed."""
    out: dict[str, Any] = {"token_hit_ceiling": ceiling}
    for base in (BASELINE, "pool_only"):
        hit = policies.get(base, {}).get("token_hit_ratio")
        if hit is not None and hit < 1:
            out[f"tier_aware_ttft_vs_{base}_bound"] = (1 - ceiling) / (1 - hit)
    return out


def command(args: argparse.Namespace) -> str:
    """The command line that reproduces this run's fleet."""
    out = "python benchmarks/bench_fleet.py --json"
    out += " --quick" if args.quick else ""
    out += f" --replicas {args.replicas}" if args.replicas != NUM_REPLICAS else ""
    out += " --pin" if args.pin else ""
    out += f" --policies {args.policies}" if args.policies else ""
    return out


def _with(spec: FleetSpec, policy: str) -> FleetSpec:
    return replace(spec, policy=policy)


def simulated(quick: bool, trace: str) -> dict[str, Any]:
    """``benchmarks.fleet_sim`` at its defaults (its quick variant with ``quick``): its
    headline figures, and ``tier_aware``'s mean TTFT over ``pool_only``'s per fleet size."""
    args = argparse.Namespace(
        quick=quick,
        sizes=",".join(map(str, fleet_sim.SIZES)),
        limit=None,
        disk_blocks=fleet_sim.DISK_BLOCKS,
        shared_blocks=fleet_sim.SHARED_BLOCKS,
        decode_s=fleet_sim.DECODE_S,
        utilization=fleet_sim.UTILIZATION,
        max_imbalance=RoutingConfig().max_imbalance,
        results=str(fleet_sim.RESULTS),
        trace=trace,
    )
    sim = fleet_sim.measure(args)
    out: dict[str, Any] = {
        "command": sim["command"],
        "num_requests": sim["num_requests"],
        "sizes": sim["sizes"],
    }
    for key, value in sim.items():
        if key.startswith(("tier_aware_", "best_mean_ttft_policy_")) or key == "targets_met":
            out[key] = value
    for n, fleet in sim["fleets"].items():
        by = fleet["policies"]
        ratio = by[TARGET_POLICY]["mean_ttft_s"] / by["pool_only"]["mean_ttft_s"]
        out[f"tier_aware_mean_ttft_vs_pool_only_{n}"] = ratio
    return out


def main(description: str) -> None:
    """Parse the flags (``description``: the benchmark's docstring), run, print."""
    parser = argparse.ArgumentParser(
        description=description, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--quick", action="store_true", help="a few sessions: a smoke test")
    parser.add_argument(
        "--policies", default=None, help="comma-separated (default: all; --quick: three)"
    )
    parser.add_argument("--replicas", type=int, default=NUM_REPLICAS, help="engine replicas")
    parser.add_argument(
        "--pin",
        action="store_true",
        help="each replica on a core of its own (taskset)",
    )
    parser.add_argument("--max-ids", type=int, default=48, help="longest prompt, in hash ids")
    parser.add_argument("--max-turns", type=int, default=6, help="turns kept per session")
    parser.add_argument("--max-tokens", type=int, default=8, help="tokens each request makes")
    parser.add_argument("--utilization", type=float, default=0.7, help="of the cold capacity")
    parser.add_argument("--pool-blocks", type=int, default=128, help="each replica's pool")
    parser.add_argument("--disk-bytes", type=int, default=4 << 30, help="each replica's disk")
    parser.add_argument(
        "--shared-fraction", type=float, default=0.25, help="sidecar / the replay's blocks"
    )
    parser.add_argument("--reconcile-interval-s", type=float, default=5.0)
    parser.add_argument("--no-simulated", action="store_true", help="skip benchmarks.fleet_sim")
    parser.add_argument("--trace", default=str(CONVERSATION_TRACE))
    parser.add_argument("--work-dir", default=None, help="a folder on a disk (default: temp)")
    args = parser.parse_args()
    if args.replicas < 2:
        parser.error("--replicas must be at least 2 (routing needs a choice)")
    if args.pin and args.replicas > len(os.sched_getaffinity(0)):
        parser.error(
            f"--pin needs a core per replica; this process may run on "
            f"{len(os.sched_getaffinity(0))}"
        )
    if not 0 < args.utilization < 1:
        parser.error("--utilization must be in (0, 1)")
    if not 0 < args.shared_fraction <= 1:
        parser.error("--shared-fraction must be in (0, 1]")
    folder = disk_work_dir(args.work_dir, "--work-dir")
    with tempfile.TemporaryDirectory(prefix="fleet-", dir=folder) as work:
        result = measure(args, Path(work))
    print_table(result, args.json)
    emit(result, args.json)
