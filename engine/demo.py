"""The main job: a long prompt on SmolLM2, cold; the engine process restarts; the same prompt
again, warm from the disk tier. Prints TTFT cold vs warm, tokens restored per tier, hit rate.

The restarted process first serves a short chat request that shares only the system prompt:
the restore guard computes that first hit and compares it with the disk's records before the
tier is trusted (``cachetier.guard``), so the long prompt after it is restored.

    python -m cachetier.engine.demo [--tokens 2048] [--data-dir DIR]

Each run is a separate Python process (a real restart); the store is the embedded default,
CPU + disk, no Redis needed.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

STORY = (
    "In the old harbour town the lighthouse keeper kept a ledger of every ship that passed: "
    "its name, its flag, the weather, and what it carried. "
)


def build_prompt(llm: object, num_tokens: int) -> list[int]:
    """A chat prompt of at least ``num_tokens`` tokens: a long ledger and a question."""
    pages = 1
    while True:
        body = "".join(STORY.replace("ledger", f"ledger (page {p})") for p in range(pages))
        ids = llm.encode(body + "\nSummarise the ledger in one sentence.", chat=True)  # type: ignore[attr-defined]
        if len(ids) >= num_tokens:
            return ids
        # Grow by the measured tokens per page, so this takes a handful of rounds.
        pages = max(pages + 1, int(pages * num_tokens / len(ids)) + 1)


def child(args: argparse.Namespace) -> None:
    from cachetier.engine.llm import LLM
    from cachetier.engine.sampling import SamplingParams
    from cachetier.engine.smollm2 import smollm2_path
    from cachetier.store.config import StoreConfig

    started = time.perf_counter()
    store = StoreConfig(cpu_bytes=1 << 30, disk_path=args.data_dir, disk_bytes=8 << 30)
    with LLM(
        smollm2_path(), store=store, kv_cache_bytes=1 << 30, num_threads=os.cpu_count()
    ) as llm:
        load_s = time.perf_counter() - started
        greedy = SamplingParams(temperature=0, max_tokens=args.max_tokens)
        if args.probe:  # another user's short question: only the system prompt is shared
            llm.generate([llm.encode("Hello! Who keeps lighthouses?", chat=True)], greedy)
        prompt = build_prompt(llm, args.tokens)
        out = llm.generate([prompt], greedy)[0]
        stats = llm.engine.stats()
    print(
        json.dumps(
            {
                "prompt_tokens": len(prompt),
                "ttft_s": out.ttft_s,
                "cached_tokens": out.num_cached_tokens,
                "by_source": out.cached_tokens_by_source,
                "text": out.text,
                "token_ids": out.token_ids,
                "load_s": load_s,
                "restore_s": stats.get("restore_s", 0.0),
                "saved_blocks": stats.get("saved_blocks", 0),
                "guard": stats.get("guard", {}),
            }
        )
    )


def run_child(data_dir: str, tokens: int, max_tokens: int, probe: bool = False) -> dict:
    cmd = [
        sys.executable,
        "-m",
        "cachetier.engine.demo",
        "--child",
        "--data-dir",
        data_dir,
        "--tokens",
        str(tokens),
        "--max-tokens",
        str(max_tokens),
        *(["--probe"] if probe else []),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.stderr.write(proc.stderr)
        raise SystemExit(f"engine process failed with exit code {proc.returncode}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tokens", type=int, default=2048, help="prompt length (default 2048)")
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument(
        "--data-dir", default=None, help="disk tier folder (default: a fresh temp dir)"
    )
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--probe", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args)
        return
    with tempfile.TemporaryDirectory(prefix="cachetier-demo-") as tmp:
        data_dir = args.data_dir or tmp
        print(
            f"cachetier demo: SmolLM2-135M, fp32, a ~{args.tokens}-token prompt, "
            f"tiers CPU + disk ({data_dir})"
        )
        print("1/2 engine process A (cold: nothing stored yet) ...", flush=True)
        cold = run_child(data_dir, args.tokens, args.max_tokens)
        print(
            f"    TTFT {cold['ttft_s']:.2f} s, {cold['saved_blocks']} blocks saved to the tiers; "
            "process exits"
        )
        print("2/2 engine process B (a restart: empty pool, empty CPU tier) ...", flush=True)
        warm = run_child(data_dir, args.tokens, args.max_tokens, probe=True)
        guard = warm["guard"]
        print(
            f"    restore guard: the first hit (a short chat sharing the system prompt) was "
            f"computed and compared, {guard.get('verified_blocks', 0)} block(s) verified, "
            f"{guard.get('mismatched_blocks', 0)} mismatched"
        )
        print(f"    TTFT {warm['ttft_s']:.2f} s, restored in {warm['restore_s']:.2f} s")
    prompt = warm["prompt_tokens"]
    hit = warm["cached_tokens"] / prompt
    print()
    print(f"  prompt tokens          {prompt}")
    print(f"  TTFT cold              {cold['ttft_s']:.3f} s")
    speedup = cold["ttft_s"] / warm["ttft_s"]
    print(f"  TTFT warm (restart)    {warm['ttft_s']:.3f} s   ({speedup:.1f}x faster)")
    for tier, n in sorted(warm["by_source"].items()) or [("none", 0)]:
        print(f"  tokens restored from   {tier}: {n}")
    print(f"  prefix hit rate        {hit:.1%} (the partial last block is always recomputed)")
    print(f"  outputs identical      {cold['token_ids'] == warm['token_ids']}")
    print(f"  answer                 {warm['text'].strip()[:120]!r}")
    if cold["token_ids"] != warm["token_ids"] or not warm["cached_tokens"]:
        raise SystemExit("the warm run did not reuse the stored prefix or changed the output")


if __name__ == "__main__":
    main()
