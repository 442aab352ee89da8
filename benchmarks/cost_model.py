"""Load or recompute over a real slow link: SmolLM2 with its only tier (Redis) behind a
bandwidth- and latency-limited TCP proxy, swept from a thin link to an unlimited one.

    python -m benchmarks.cost_model --json [--tokens 2048] [--repeats 3] [--plot out.png]

At every link speed, in one process and interleaved, the same prompt's TTFT is measured:
- ``cold``: an engine without tiers (what recomputing everything costs);
- ``always``: every hit loaded (``kv_load_policy="always"``, the behaviour before the model);
- ``cost``: the cost model's plan, from tier rates it measured on the real gets of the runs
  before (at each speed, ``LEARN_RUNS`` loads through the link come first, unmeasured).

Figures (medians over ``--repeats``):
- ``thin_link_ttft_vs_cold`` = cost TTFT / cold TTFT on the thinnest link (target <= 1.05),
  beside ``thin_link_always_load_ttft_vs_cold``;
- ``fast_link_loaded_fraction`` = loaded / hit tokens on the unlimited link (target 1.0);
- ``cost_model_regret`` = per speed, cost TTFT / min(always, cold) (target <= 1.1 at every one);
- ``sweep``: per speed, the three TTFTs, the plan (tokens loaded, recomputed by choice) and
  the model's estimate.
"""

from __future__ import annotations

import argparse
import os
import statistics
import uuid
from typing import Any

from benchmarks.support.output import emit
from tests.throttled_link import SlowLink

REDIS = os.environ.get("CACHETIER_REDIS_HOSTPORT", "127.0.0.1:6379")
# Link speeds swept, MB/s (None: no limit), thinnest first.
SPEEDS: tuple[float | None, ...] = (10, 25, 50, 100, 200, None)
# Reads the engine makes at a new link speed before any is measured: the model learns a link
# from real gets (a moving average), so the first requests after a change still see the old one.
LEARN_RUNS = 2
LATENCY_S = 0.002  # one way: a link inside a region


def ttft(llm: Any, prompt: list[int]) -> Any:
    from cachetier.engine.sampling import SamplingParams

    # The pool forgets the prompt: every run finds its blocks in the tier only.
    llm.engine.blocks.clear_cache()
    return llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1))[0]


def measure_speed(llm: Any, cold_llm: Any, prompt: list[int], repeats: int) -> dict[str, Any]:
    """At the link's speed now: the cold, load-everything and cost-model TTFTs, interleaved.

    Args:
        llm: the engine whose only tier is Redis behind the link.
        cold_llm: an engine without tiers (recomputes everything).
        prompt: the prompt, whose blocks the tier holds.
        repeats: runs of each; the figures are medians.

    Returns:
        One row of the sweep, without its ``link_mb_s``.
    """
    llm.engine.cost_model.enabled = False
    for _ in range(LEARN_RUNS):
        ttft(llm, prompt)
    runs: dict[str, list[Any]] = {"cold": [], "always": [], "cost": []}
    for _ in range(repeats):
        runs["cold"].append(ttft(cold_llm, prompt))
        llm.engine.cost_model.enabled = False
        runs["always"].append(ttft(llm, prompt))
        llm.engine.cost_model.enabled = True
        runs["cost"].append(ttft(llm, prompt))
    med = {k: statistics.median(o.ttft_s for o in v) for k, v in runs.items()}
    last = runs["cost"][-1]
    return {
        "ttft_cold_s": med["cold"],
        "ttft_always_load_s": med["always"],
        "ttft_cost_model_s": med["cost"],
        "regret": med["cost"] / min(med["always"], med["cold"]),
        "loaded_tokens": sum(n for s, n in last.cached_tokens_by_source.items() if s != "pool"),
        "recomputed_tokens": last.num_recomputed_hit_tokens,
        "outputs_identical": all(
            o.token_ids == runs["cold"][0].token_ids for v in runs.values() for o in v
        ),
    }


def forget(host: str, port: int, prefix: str) -> None:
    """Delete every Redis key the run wrote (they all start with ``prefix``)."""
    import redis

    client = redis.Redis(host=host, port=port)
    names = list(client.scan_iter(match=f"{prefix}*", count=1000))
    if names:
        client.delete(*names)
    client.close()


def sweep_links(args: argparse.Namespace) -> tuple[int, list[dict[str, Any]], dict[str, Any]]:
    """Every link speed of ``SPEEDS``, thinnest first, over one Redis tier behind a ``SlowLink``.

    Returns:
        The prompt's length, the sweep (one row per speed) and the rates the model learned.
    """
    from cachetier.engine.demo import build_prompt
    from cachetier.engine.llm import LLM
    from cachetier.engine.smollm2 import smollm2_path
    from cachetier.store.tiered import TieredStore
    from cachetier.tiers.redis import RedisTier, RedisTierConfig

    host, port = REDIS.rsplit(":", 1)
    prefix = f"bench-cost-{uuid.uuid4().hex[:8]}"
    engine_args = dict(
        dtype="float32", kv_cache_bytes=2 << 30, max_num_batched_tokens=args.tokens + 64
    )
    cold_llm = LLM(smollm2_path(), **engine_args)
    prompt = build_prompt(cold_llm, args.tokens)
    with SlowLink(target=(host, int(port)), bandwidth_bytes_per_s=None, latency_s=0) as link:
        # A thin link needs more than the default 0.5 s to answer a read.
        config = RedisTierConfig(url=link.url("redis"), key_prefix=prefix, socket_timeout_s=30)
        store = TieredStore([RedisTier(config)])
        # Every load decision is measured: no hit may be drawn by the restore guard.
        llm = LLM(smollm2_path(), store=store, guard=False, **engine_args)
        try:
            first = ttft(llm, prompt)  # computes and saves every block, over the open link
            assert first.num_cached_tokens == 0, "the tier was not empty"
            sweep = []
            for speed in SPEEDS:
                link.set(
                    bandwidth_bytes_per_s=None if speed is None else speed * 1e6,
                    latency_s=LATENCY_S,
                )
                row = measure_speed(llm, cold_llm, prompt, args.repeats)
                sweep.append({"link_mb_s": speed, **row})
            rates = llm.engine.stats()["cost_model"]
        finally:
            llm.close()
            store.close()
            forget(host, int(port), prefix)
    return len(prompt), sweep, rates


def measure(args: argparse.Namespace) -> dict[str, Any]:
    prompt_tokens, sweep, rates = sweep_links(args)
    thin, fast = sweep[0], sweep[-1]
    hit_tokens = fast["loaded_tokens"] + fast["recomputed_tokens"]
    return {
        "prompt_tokens": prompt_tokens,
        "thin_link_mb_s": thin["link_mb_s"],
        "thin_link_ttft_vs_cold": thin["ttft_cost_model_s"] / thin["ttft_cold_s"],
        "thin_link_always_load_ttft_vs_cold": thin["ttft_always_load_s"] / thin["ttft_cold_s"],
        "fast_link_loaded_fraction": fast["loaded_tokens"] / hit_tokens if hit_tokens else 0.0,
        "cost_model_regret": [round(p["regret"], 4) for p in sweep],
        "cost_model_regret_max": max(p["regret"] for p in sweep),
        "outputs_identical": all(p["outputs_identical"] for p in sweep),
        "sweep": sweep,
        "learned": rates,
    }


def plot(result: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sweep = result["sweep"]
    labels = [("none" if p["link_mb_s"] is None else f"{p['link_mb_s']:g}") for p in sweep]
    x = range(len(sweep))
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 6), sharex=True)
    for key, label in [
        ("ttft_cold_s", "recompute all (no tier)"),
        ("ttft_always_load_s", "load all"),
        ("ttft_cost_model_s", "cost model"),
    ]:
        top.plot(x, [p[key] for p in sweep], marker="o", label=label)
    top.set_yscale("log")
    top.set_ylabel("TTFT, s (median)")
    top.legend()
    top.set_title(f"{result['prompt_tokens']}-token prompt, Redis behind a throttled link")
    loaded = [p["loaded_tokens"] for p in sweep]
    recomputed = [p["recomputed_tokens"] for p in sweep]
    bottom.bar(x, loaded, label="tokens loaded")
    bottom.bar(x, recomputed, bottom=loaded, label="tokens recomputed by choice")
    bottom.set_ylabel("hit tokens")
    bottom.set_xticks(list(x), labels)
    bottom.set_xlabel("link bandwidth, MB/s (2 ms one way)")
    bottom.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--plot", default=None, help="write the sweep as a PNG here")
    args = parser.parse_args()
    result: dict[str, Any] = {"model": "SmolLM2-135M-Instruct", "dtype": "float32"}
    result.update(measure(args))
    if args.plot:
        plot(result, args.plot)
    emit(result, args.json)


if __name__ == "__main__":
    main()
