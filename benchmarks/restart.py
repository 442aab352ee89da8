"""TTFT of a long prompt on SmolLM2: cold, then warm from each tier, disk and Redis each after a
real restart of the engine process.

    python -m benchmarks.restart --json [--tokens 4096] [--dtype float32]
    python -m benchmarks.restart --json --device cuda --model DIR --no-redis

``--model`` takes another model folder (``python -m benchmarks.support.random_model`` makes one
of SmolLM2's shapes with random weights where its weights cannot be had, as on our GPU machine);
``--device`` runs the engine there; ``--no-redis`` leaves the Redis restart out where no Redis
answers.

Ratios:
- ``speedup_disk`` = cold TTFT / warm-from-disk TTFT (target >= 60 at 4096 and 8000 tokens).
- ``restore_vs_raw_bound`` = restore time / (bytes restored / raw-read GB/s of the same block
  files measured in this run, page cache warm) (target <= 2): how close a restore comes to
  just reading the bytes.
- ``warm_vs_bound_disk`` = warm-from-disk TTFT / (TTFT of the same prompt with every block in
  the pool, in the same restarted process + bytes restored / raw-read GB/s) (target <= 1.5):
  how close a restart comes to "read the bytes, then compute the suffix".
- ``ttft_breakdown``: where each run's TTFT went (``cachetier.engine.sequence.TTFT_PARTS``).

Every mode runs ``--repeats`` times (default 3), each in a fresh process, interleaved round by
round; the figures are those of each mode's median run, and ``ttft_runs_s`` lists every run.
One run of each is one sample of a shared machine, which can swing by half between
back-to-back runs of one build. The restart from disk, the figure's subject and the cheapest
run (no prefill of the prompt), runs ``--disk-runs`` times a round (default 3): now and then
one such run is much slower, its restore and its suffix prefill both, so a median of few
samples can land on one. A cold run (seconds of compute) averages such moments out by
itself.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

from benchmarks.support.children import REPO_ROOT, module_command
from benchmarks.support.output import emit
from benchmarks.support.workdir import disk_work_dir

REDIS_URL = os.environ.get("CACHETIER_REDIS_URL", "redis://127.0.0.1:6379/0")


def child(args: argparse.Namespace) -> None:
    """One engine process: run the prompt (twice for ``cpu``), report TTFT and restore figures."""
    from cachetier.engine.demo import build_prompt
    from cachetier.engine.llm import LLM
    from cachetier.engine.sampling import SamplingParams
    from cachetier.engine.smollm2 import smollm2_path
    from cachetier.store.config import StoreConfig

    tiers = args.tiers.split(",")
    model = args.model or smollm2_path()
    store = StoreConfig(
        cpu_bytes=(2 << 30) if "cpu" in tiers else 0,
        disk_path=args.data_dir if "disk" in tiers else None,
        disk_bytes=16 << 30,
        redis_url=REDIS_URL if "redis" in tiers else None,
        redis_key_prefix=args.redis_prefix,
    )
    greedy = SamplingParams(temperature=0, max_tokens=8)
    with LLM(
        model,
        store=store,
        dtype=args.dtype,
        kv_cache_bytes=3 << 30,
        max_num_batched_tokens=args.tokens + 64,
        device=args.device,
        kv_load_policy=args.kv_load_policy,
        guard=False,  # the restore is measured; the guard's cost is benchmarks.guard's figure
    ) as llm:
        prompt = build_prompt(llm, args.tokens)
        runs = []
        for _ in range(2 if args.mode == "cpu" else 1):
            before = refaulted_file_pages()
            out = llm.generate([prompt], greedy)[0]
            refaults = refaulted_file_pages() - before
            runs.append(out)
            llm.flush()
            # The next run must not find the blocks in the engine's own pool, only in a tier.
            llm.engine.blocks.clear_cache()
        stats = llm.engine.stats()
        pool_hit = None
        if args.mode != "cold":
            # The same prompt once more with its blocks left in the pool: what the TTFT would be
            # had the restore cost nothing (the bound's compute part, in this very process).
            llm.generate([prompt], greedy)
            pool_hit = llm.generate([prompt], greedy)[0]
    out = runs[-1]
    print(
        json.dumps(
            {
                "prompt_tokens": len(prompt),
                "ttft_s": out.ttft_s,
                "token_ids": out.token_ids,
                "recomputed_hit_tokens": out.num_recomputed_hit_tokens,
                "by_source": out.cached_tokens_by_source,
                "restore_s": stats.get("restore_s", 0.0),
                "restored_bytes": stats.get("restored_bytes", 0),
                "restored_blocks": stats.get("restored_blocks", 0),
                "ttft_breakdown": {k: round(v, 5) for k, v in out.ttft_breakdown.items()},
                "refaulted_file_pages": refaults,
                "pool_hit_ttft_s": None if pool_hit is None else pool_hit.ttft_s,
                "pool_hit_by_source": None
                if pool_hit is None
                else pool_hit.cached_tokens_by_source,
            }
        )
    )


def device_name(device: str) -> str:
    """``device`` and, for a GPU, what it is (read in a child: the parent never touches CUDA)."""
    if device == "cpu":
        return device
    code = f"import torch; print(torch.cuda.get_device_name({device!r}))"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    return f"{device} ({proc.stdout.strip() or 'unknown'})"


def refaulted_file_pages() -> int:
    """Pages of files read back in after the kernel dropped them from the page cache, machine
    wide (Linux's ``workingset_refault_file``; -1 where it is not kept). A disk restart's
    "warm page cache" is only as warm as this says: some VMs page out file pages left idle for
    seconds (this project's measured one did, through DAMON)."""
    try:
        with open("/proc/vmstat") as f:
            for line in f:
                name, value = line.split()
                if name == "workingset_refault_file":
                    return int(value)
    except OSError:
        pass
    return -1


def run(mode: str, tiers: str, args: argparse.Namespace, data_dir: str, prefix: str) -> dict:
    cmd = module_command(
        "benchmarks.restart",
        *("--child", "--mode", mode, "--tiers", tiers, "--data-dir", data_dir),
        *("--redis-prefix", prefix, "--tokens", str(args.tokens), "--dtype", args.dtype),
        *("--device", args.device, "--kv-load-policy", args.kv_load_policy),
        *(["--model", args.model] if args.model else []),
    )
    proc = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True)
    if proc.returncode:
        sys.stderr.write(proc.stderr[-4000:])
        raise SystemExit(f"{mode} run failed")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def raw_read_gbps(folder: str) -> float:
    """Plain open().read() of every block file under ``folder`` (page cache warm: read twice)."""
    paths = [p for p in Path(folder).rglob("*.ctkv")]
    total = sum(p.stat().st_size for p in paths)
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        kept = []
        for p in paths:
            with open(p, "rb") as f:
                kept.append(f.read())
        best = min(best, time.perf_counter() - start)
        del kept
    return total / best / 1e9


def median_run(runs: list[dict]) -> dict:
    """The run with the median TTFT (the lower middle one of an even count): its parts, restore
    and pool hit are one process's, so they add up as measured."""
    return sorted(runs, key=lambda r: r["ttft_s"])[(len(runs) - 1) // 2]


def measure(args: argparse.Namespace) -> dict:
    import redis

    prefix = f"bench-restart-{uuid.uuid4().hex[:8]}"
    client = redis.Redis.from_url(REDIS_URL) if args.redis else None
    samples: dict[str, list[dict]] = {"cold": [], "cpu": [], "disk": []}
    if args.redis:
        samples["redis"] = []
    cold_tiers = "cpu,disk,redis" if args.redis else "cpu,disk"
    try:
        parent = disk_work_dir(args.work_dir, "--work-dir")
        with tempfile.TemporaryDirectory(prefix="bench-restart-", dir=parent) as work:
            data = os.path.join(work, "shared")
            for round_ in range(args.repeats):
                # The first cold run fills the tiers the warm runs read; later ones get tiers
                # of their own, so they are as cold as the first.
                cold_dir = data if round_ == 0 else os.path.join(work, f"cold-{round_}")
                samples["cold"].append(
                    run("cold", cold_tiers, args, cold_dir, f"{prefix}-{round_}")
                )
                samples["cpu"].append(run("cpu", "cpu", args, data, f"{prefix}-0"))
                # A restart: the CPU tier is empty, only the disk (or Redis) holds the blocks.
                for _ in range(args.disk_runs):
                    samples["disk"].append(run("disk", "cpu,disk", args, data, f"{prefix}-0"))
                if args.redis:
                    samples["redis"].append(run("redis", "cpu,redis", args, data, f"{prefix}-0"))
            gbps = raw_read_gbps(data)
    finally:
        if client is not None:
            names = list(client.scan_iter(match=f"{prefix}*", count=1000))
            if names:
                client.delete(*names)
            client.close()
    runs = {mode: median_run(got) for mode, got in samples.items()}
    cold, disk = runs["cold"], runs["disk"]
    warm = {mode: runs[mode] for mode in samples if mode != "cold"}
    first = samples["cold"][0]["token_ids"]
    same = all(r["token_ids"] == first for got in samples.values() for r in got)
    bound_s = disk["restored_bytes"] / (gbps * 1e9) if gbps else float("nan")
    # Where the cost model recomputed the whole hit (a GPU, whose prefill beats the disk), no
    # byte was restored and there is no read bound to hold the restore to: both ratios are None.
    restored = disk["restored_bytes"] > 0
    return {
        "prompt_tokens": cold["prompt_tokens"],
        "repeats": args.repeats,
        "disk_runs_per_repeat": args.disk_runs,
        "cold_ttft_s": cold["ttft_s"],
        "warm_ttft_s": {mode: r["ttft_s"] for mode, r in warm.items()},
        "ttft_runs_s": {m: [round(r["ttft_s"], 4) for r in got] for m, got in samples.items()},
        # Tokens each run restored: a run that fell back to computing (a tier timed out, say)
        # shows 0 here and a cold-like TTFT above.
        "restored_tokens_runs": {
            m: [sum(r["by_source"].values()) for r in got] for m, got in samples.items()
        },
        # Per disk run: file pages re-read from the disk during its request (0: all in memory).
        "disk_refaulted_pages_runs": [r["refaulted_file_pages"] for r in samples["disk"]],
        "restored_tokens": {mode: r["by_source"] for mode, r in warm.items()},
        # Tokens a tier held that the cost model chose to recompute, per run.
        "recomputed_hit_tokens_runs": {
            m: [r.get("recomputed_hit_tokens", 0) for r in got] for m, got in samples.items()
        },
        **{f"speedup_{mode}": cold["ttft_s"] / r["ttft_s"] for mode, r in warm.items()},
        "disk_restore_s": disk["restore_s"],
        "disk_restored_bytes": disk["restored_bytes"],
        "raw_read_gbps": gbps,
        "restore_vs_raw_bound": disk["restore_s"] / bound_s if restored else None,
        "disk_pool_hit_ttft_s": disk["pool_hit_ttft_s"],
        "warm_vs_bound_disk": (
            disk["ttft_s"] / (disk["pool_hit_ttft_s"] + bound_s) if restored else None
        ),
        "ttft_breakdown": {name: r["ttft_breakdown"] for name, r in runs.items()},
        "outputs_identical": same,
    }


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument(
        "--also",
        type=int,
        nargs="*",
        default=[8000],
        help="further prompt lengths (8000: the chat prompt built for it comes out ~90 tokens "
        "longer, and prompt plus output must stay within SmolLM2's 8192)",
    )
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument(
        "--repeats", type=int, default=3, help="fresh-process runs of each mode (median kept)"
    )
    parser.add_argument(
        "--disk-runs",
        type=int,
        default=3,
        help="fresh-process restarts from disk per repeat (median over all of them kept)",
    )
    parser.add_argument(
        "--work-dir", default=None, help="parent of the disk tier's temp folder (on a disk)"
    )
    parser.add_argument(
        "--model", default=None, help="model folder (default: the converted SmolLM2-135M)"
    )
    parser.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    parser.add_argument(
        "--kv-load-policy",
        default="cost",
        choices=["cost", "always"],
        help="cost: the engine loads a hit only where that beats recomputing it",
    )
    parser.add_argument(
        "--redis",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also restart from Redis (at CACHETIER_REDIS_URL)",
    )
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--mode", default="cold", help=argparse.SUPPRESS)
    parser.add_argument("--tiers", default="cpu,disk", help=argparse.SUPPRESS)
    parser.add_argument("--data-dir", default="", help=argparse.SUPPRESS)
    parser.add_argument("--redis-prefix", default="cachetier", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.repeats < 1 or args.disk_runs < 1:
        parser.error("--repeats and --disk-runs must be at least 1")
    return args


# The figures kept of each further prompt length (``--also``), under ``at_<tokens>``.
AT_LENGTH = (
    "prompt_tokens",
    "cold_ttft_s",
    "warm_ttft_s",
    "ttft_runs_s",
    "restored_tokens_runs",
    "disk_refaulted_pages_runs",
    "speedup_disk",
    "restore_vs_raw_bound",
    "warm_vs_bound_disk",
    "ttft_breakdown",
    "outputs_identical",
)


def main() -> None:
    args = parse_args()
    if args.child:
        child(args)
        return
    result = {
        "model": Path(args.model).name if args.model else "SmolLM2-135M-Instruct",
        "dtype": args.dtype,
        "device": device_name(args.device),
        "kv_load_policy": args.kv_load_policy,
        "threads": os.cpu_count(),
        "page_cache": "warm (the cold run just wrote the files; see disk_refaulted_pages_runs)",
    }
    result.update(measure(args))
    for tokens in args.also:
        extra = measure(argparse.Namespace(**{**vars(args), "tokens": tokens}))
        result[f"at_{tokens}"] = {k: extra[k] for k in AT_LENGTH}
        result[f"warm_vs_bound_disk_at_{tokens}"] = extra["warm_vs_bound_disk"]
    emit(result, args.json)


if __name__ == "__main__":
    main()
