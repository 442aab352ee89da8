"""The restore guard's figures: forgeries caught, honest restarts never quarantined, and what
verification costs a serving engine.

- **Forgeries** (our engine, a tiny random Llama in fp32, disk tier): a prompt and another are
  stored; the prompt's records are rewritten with each forgery of
  ``benchmarks.support.forgeries`` (K and V swapped, another arrangement labelled canonical,
  another prompt's KV, another model's KV of the same prompt under this model's fingerprint),
  each passing every checksum. A fresh engine with the guard at its default sampling serves
  the prompt twice. ``forgeries_detected`` counts those quarantined within ``guard_first_hits``
  verified requests; ``outputs_after_quarantine_differ_from_cold`` counts answers, both
  requests', that differ from a cold engine's. vLLM-CPU's three forgeries run as
  ``tests/connectors/test_vllm_guard_forgeries.py`` (one pytest child; its four assertions per
  forgery are the same) unless ``--no-vllm``; the other-model forgery through vLLM is not run.
- **Honest restarts** (SmolLM2-135M, fp32 and bf16, CPU + disk tiers): an engine stores
  ``benchmarks.engine``'s requests; a restarted engine verifies every hit (``guard_fraction``
  1) and serves each request with its pool forgotten in between. ``false_quarantines`` counts
  quarantines begun (target 0), ``honest_verified_blocks`` the blocks compared.
- **Overhead** (SmolLM2 fp32): a filled disk tier; fresh engines alternate with the guard at
  its defaults and off (``--pairs``), each serving two batches of the requests (16 output
  tokens each). ``guard_overhead_first_batch`` = median(on) / median(off) - 1 over the first
  batch, which carries the one verified request of a fresh process;
  ``guard_overhead_engine`` the same over the second batch, the steady state.
- **vLLM-CPU** (unless ``--no-vllm``; fresh processes, ``benchmarks.support.vllm_batch``'s
  settings, 64 output tokens): an honest restart verifying every hit
  (``vllm_false_quarantines``), then alternating processes with the guard at its defaults
  and off over the same filled disk (``guard_overhead_vllm``; each process's untimed warm-up
  request takes its first verified hit). ``guard_overhead`` is the larger steady-state
  overhead of the two engines (target <= 0.01); ``false_quarantines`` sums both engines'.

    python -m benchmarks.guard --json [--pairs 3] [--no-vllm]
"""

from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.support.forgeries import Stored, another_arrangement, k_and_v_swapped, values_of
from benchmarks.support.output import emit
from benchmarks.support.requests import make_requests
from cachetier.engine.llm import LLM
from cachetier.engine.sampling import SamplingParams
from cachetier.store.config import StoreConfig
from tests.models import make_tiny_llama

GREEDY = SamplingParams(temperature=0, max_tokens=8)
PROMPT = [(i * 7 + 3) % 250 for i in range(150)]  # 9 full blocks of 16
OTHER = [(i * 13 + 1) % 250 for i in range(150)]
TINY_POOL = {"kv_cache_bytes": 4 << 20}
DEFAULT_GUARD = {"guard": True, "guard_first_hits": 1, "guard_fraction": 0.001}
FIRST_HITS = DEFAULT_GUARD["guard_first_hits"]


def _disk(folder: Path, cpu_bytes: int = 0) -> StoreConfig:
    return StoreConfig(cpu_bytes=cpu_bytes, disk_path=str(folder), fsync=False)


def _store(model: Path, folder: Path, prompts: list[list[int]]) -> Any:
    with LLM(model, store=_disk(folder), guard=False, **TINY_POOL) as llm:
        llm.generate(prompts, GREEDY)
        return llm.engine.namespace


def _forgery_case(
    name: str, model: Path, folder: Path, forge: Callable[[list], list], cold: list[int]
) -> dict[str, Any]:
    """Serve the forged prompt twice in a fresh guarded engine; what the guard did."""
    namespace = _store(model, folder, [PROMPT, OTHER])
    stored = Stored(folder, namespace)
    try:
        records = stored.records(PROMPT)
        stored.replace(records, forge(records))
    finally:
        stored.close()
    with LLM(model, store=_disk(folder), **TINY_POOL, **DEFAULT_GUARD) as llm:
        first = llm.generate([PROMPT], GREEDY)[0]
        caught_after = llm.engine.stats()["guard"]["verified_requests"]
        llm.engine.blocks.clear_cache()
        second = llm.generate([PROMPT], GREEDY)[0]
        guard = llm.engine.stats()["guard"]
    quarantined = guard["quarantined"] == [("disk", namespace.id)]
    return {
        "forgery": name,
        "detected": quarantined and caught_after <= FIRST_HITS,
        "verified_requests_to_detect": caught_after,
        "outputs_differing_from_cold": sum(o.token_ids != cold for o in (first, second)),
        "served_from_tiers": sum(bool(o.cached_tokens_by_source) for o in (first, second)),
    }


def engine_forgeries(workdir: Path) -> list[dict[str, Any]]:
    """The four forgeries through our engine."""
    model = make_tiny_llama(workdir / "tiny", seed=0)
    other_model = make_tiny_llama(workdir / "tiny-other", seed=1)
    cold = LLM(model, enable_prefix_caching=False, **TINY_POOL).generate([PROMPT], GREEDY)[0]
    theirs = Stored(workdir / "other-model", _store(other_model, workdir / "other-model", [PROMPT]))
    other_prompt_folder = workdir / "other-prompt"
    mine = Stored(other_prompt_folder, _store(model, other_prompt_folder, [OTHER]))
    try:
        forgeries = {
            "k_and_v_swapped": k_and_v_swapped,
            "another_arrangement": another_arrangement,
            "other_tokens": values_of(mine.records(OTHER)),
            "another_model": values_of(theirs.records(PROMPT)),
        }
    finally:
        theirs.close()
        mine.close()
    return [
        _forgery_case(name, model, workdir / f"case-{name}", forge, cold.token_ids)
        for name, forge in forgeries.items()
    ]


def vllm_forgeries() -> dict[str, Any]:
    """Run the vLLM forgery test in a child pytest; its three forgeries pass or fail together."""
    test = "tests/connectors/test_vllm_guard_forgeries.py"
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rA", "-p", "no:cacheprovider", test],
        capture_output=True,
        text=True,
        timeout=1800,
    )
    passed = len(re.findall(r"^PASSED ", proc.stdout, re.M))
    return {"test": test, "passed": passed == 1 and proc.returncode == 0, "forgeries": 3}


def honest_restart(smollm2: Path, workdir: Path, dtype: str, requests: list[list[int]]) -> dict:
    """Verify every hit of a restarted engine over honest records; count quarantines."""
    folder = workdir / f"honest-{dtype}"
    args = {"dtype": dtype, "kv_cache_bytes": 1 << 30, "max_num_batched_tokens": 2048}
    with LLM(smollm2, store=_disk(folder), guard=False, **args) as llm:
        llm.generate(requests, GREEDY)
    every = {"guard": True, "guard_first_hits": 0, "guard_fraction": 1.0}
    with LLM(smollm2, store=_disk(folder), **args, **every) as llm:
        for prompt in requests:
            llm.generate([prompt], GREEDY)
            llm.engine.blocks.clear_cache()
        guard = llm.engine.stats()["guard"]
    return {
        "dtype": dtype,
        "false_quarantines": len(guard["quarantined"]),
        "verified_requests": guard["verified_requests"],
        "verified_blocks": guard["verified_blocks"],
        "mismatched_blocks": guard["mismatched_blocks"],
    }


def _serve(smollm2: Path, folder: Path, batches: list[list[list[int]]], guard: bool) -> list:
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    settings = DEFAULT_GUARD if guard else {"guard": False}
    times = []
    with LLM(smollm2, store=_disk(folder, 1 << 30), kv_cache_bytes=1 << 30, **settings) as llm:
        for batch in batches:
            start = time.perf_counter()
            llm.generate(batch, params)
            times.append(time.perf_counter() - start)
    return times


def overhead(smollm2: Path, workdir: Path, requests: list[list[int]], pairs: int) -> dict:
    """Alternating fresh engines, the guard at its defaults and off, over one filled disk."""
    folder = workdir / "overhead"
    with LLM(smollm2, store=_disk(folder), guard=False, kv_cache_bytes=1 << 30) as llm:
        llm.generate(requests, GREEDY)
    half = len(requests) // 2
    batches = [requests[:half], requests[half:]]
    runs: dict[bool, list[list[float]]] = {True: [], False: []}
    for _ in range(pairs):
        for guard in (False, True):
            runs[guard].append(_serve(smollm2, folder, batches, guard))

    def ratio(batch: int) -> float:
        on = statistics.median(r[batch] for r in runs[True])
        off = statistics.median(r[batch] for r in runs[False])
        return round(on / off - 1, 4)

    return {
        "guard_overhead_first_batch": ratio(0),
        "guard_overhead": ratio(1),
        "on_s": [[round(t, 3) for t in r] for r in runs[True]],
        "off_s": [[round(t, 3) for t in r] for r in runs[False]],
    }


def vllm_parts(smollm2: Path, workdir: Path, requests: list[list[int]], pairs: int) -> dict:
    """vLLM-CPU through the connector (fresh processes, ``benchmarks.support.vllm_batch``):
    an honest restart verifying every hit, then the guard at its defaults against off over the
    same filled disk, alternating. Each process's untimed warm-up request (stored by the fill)
    takes its first verified hit, so the timed batch is the steady state."""
    from benchmarks.support.vllm_batch import BLOCK_SIZE, run_batch

    folder = workdir / "vllm-disk"
    base = {
        "model": str(smollm2),
        "requests": requests,
        "warmup": make_requests(1, 49152, 0, seed=1)[0][:96],
        "max_model_len": max(len(r) for r in requests) + 64 + BLOCK_SIZE,
    }
    tiers = {"cpu_bytes": 1 << 30, "disk_path": str(folder)}
    run_batch({**base, "kv_extra": {**tiers, "guard": False}}, workdir, "vllm-fill")
    every = {"guard": True, "guard_first_hits": 0, "guard_fraction": 1.0}
    honest = run_batch({**base, "kv_extra": {**tiers, **every}}, workdir, "vllm-honest")
    guard = honest["tiers"]["guard"]
    runs: dict[bool, list[float]] = {True: [], False: []}
    for i in range(pairs):
        for on in (False, True):
            extra = {**tiers, **(DEFAULT_GUARD if on else {"guard": False})}
            out = run_batch({**base, "kv_extra": extra}, workdir, f"vllm-{on}-{i}")
            runs[on].append(out["seconds"])
    return {
        "vllm_false_quarantines": sum(guard["quarantines"].values()),
        "vllm_honest_verified_blocks": sum(guard["verified_blocks"].values()),
        "guard_overhead_vllm": round(
            statistics.median(runs[True]) / statistics.median(runs[False]) - 1, 4
        ),
        "vllm_on_s": [round(t, 3) for t in runs[True]],
        "vllm_off_s": [round(t, 3) for t in runs[False]],
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--num-requests", type=int, default=16)
    parser.add_argument("--no-vllm", action="store_true", help="leave out the vLLM forgeries")
    parser.add_argument("--quick", action="store_true", help="forgeries only (tests)")
    args = parser.parse_args()
    emit(run(args), args.json)


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Every part the arguments ask for, as the figures of the module docstring."""
    result: dict[str, Any] = {"guard_defaults": DEFAULT_GUARD}
    with tempfile.TemporaryDirectory(prefix="bench-guard-") as tmp:
        workdir = Path(tmp)
        cases = engine_forgeries(workdir)
        vllm = None if args.no_vllm or args.quick else vllm_forgeries()
        forgeries = len(cases) + (vllm["forgeries"] if vllm else 0)
        detected = sum(c["detected"] for c in cases) + (
            vllm["forgeries"] if vllm and vllm["passed"] else 0
        )
        result.update(
            forgeries=forgeries,
            forgeries_detected=detected,
            outputs_after_quarantine_differ_from_cold=sum(
                c["outputs_differing_from_cold"] for c in cases
            ),
            engine_forgeries=cases,
            vllm_forgeries=vllm or "not run",
        )
        if args.quick:
            return result
        from cachetier.engine.smollm2 import smollm2_path

        smollm2 = smollm2_path()
        requests = make_requests(args.num_requests, 49152, 0)
        honest = [
            honest_restart(smollm2, workdir, d, requests[:8]) for d in ("float32", "bfloat16")
        ]
        result.update(honest_restarts=honest, **overhead(smollm2, workdir, requests, args.pairs))
        false = sum(h["false_quarantines"] for h in honest)
        if not args.no_vllm:
            result.update(vllm_parts(smollm2, workdir, requests, args.pairs))
            false += result["vllm_false_quarantines"]
            result["guard_overhead_engine"] = result["guard_overhead"]
            result["guard_overhead"] = max(result["guard_overhead"], result["guard_overhead_vllm"])
        result["false_quarantines"] = false
    return result


if __name__ == "__main__":
    main()
