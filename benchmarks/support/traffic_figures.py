"""The figures of ``benchmarks.traffic``: one configuration's from its answers and its server's
counters, and the headline ratios between configurations.

Where the prompt tokens a server did not compute came from:

- our engine says per request (``cachetier.cached_tokens_by_source``: ``pool`` and a tier);
- vLLM counts them on ``/metrics`` (``vllm:prompt_tokens_by_source``: ``local_cache_hit`` is its
  pool, ``external_kv_transfer`` a connector's), and our connector logs the tier of every block
  it loads (``cachetier: request R loaded N/M blocks (T tokens) from {'disk': 3, ...}``).
"""

from __future__ import annotations

import ast
import re
import statistics
from collections.abc import Sequence
from typing import Any

from benchmarks.support.traffic_drive import Answer

_LOADED_RE = re.compile(
    r"cachetier: request \S+ loaded (\d+)/\d+ blocks \((\d+) tokens\) from (\{[^}]*\})"
)
_SOURCE_RE = re.compile(
    r'^vllm:prompt_tokens_by_source_total\{[^}]*source="([^"]+)"[^}]*\} ([0-9.e+]+)', re.M
)
_CLOSE_RE = re.compile(r"cachetier: tier counters at close: (\{.*\}); (\d+) blocks dropped")
_SAVED_RE = re.compile(r"KV Transfer metrics: .*?saved_bytes=(\d+)")
_REFUSAL_RE = re.compile(r"request \S+: recomputing (\d+) of (\d+) stored")
PREFILL_ONLY = "vllm-prefill-only"  # the configuration that measures the prefill share
VLLM_SOURCES = {"local_cache_hit": "pool", "external_kv_transfer": "external"}


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q`` quantile (0-1) of ``values``, interpolated; 0.0 for none."""
    if not values:
        return 0.0
    ordered = sorted(values)
    pos = q * (len(ordered) - 1)
    low = int(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def answer_figures(answers: Sequence[Answer], wall_s: float) -> dict[str, Any]:
    """TTFT, throughput and prompt accounting of one configuration's answers."""
    ok = [a for a in answers if a.error is None and a.ttft_s is not None]
    ttfts = [a.ttft_s for a in ok if a.ttft_s is not None]
    prompt = sum(a.prompt_tokens for a in answers)
    cached = sum(a.cached_tokens for a in ok)
    return {
        "requests": len(answers),
        "errors": len(answers) - len(ok),
        "first_errors": sorted({a.error for a in answers if a.error})[:3],
        "wall_s": round(wall_s, 2),
        "requests_per_s": round(len(ok) / wall_s, 4) if wall_s else 0.0,
        "ttft_mean_s": round(statistics.fmean(ttfts), 4) if ttfts else None,
        "ttft_p50_s": round(percentile(ttfts, 0.5), 4) if ttfts else None,
        "ttft_p90_s": round(percentile(ttfts, 0.9), 4) if ttfts else None,
        "prompt_tokens": prompt,
        "prompt_tokens_cached": cached,
        "prompt_tokens_computed": prompt - cached,
        "hit_rate": round(cached / prompt, 4) if prompt else 0.0,
    }


def engine_sources(answers: Sequence[Answer]) -> dict[str, int]:
    """Our engine's cached prompt tokens by source, summed over its answers."""
    out: dict[str, int] = {}
    for answer in answers:
        for source, num in answer.cached_by_source.items():
            out[source] = out.get(source, 0) + int(num)
    return out


def vllm_sources(metrics_text: str, log_text: str) -> dict[str, int]:
    """vLLM's cached prompt tokens by source: its pool and a connector's (``/metrics``), the
    latter split by tier where our connector's log says."""
    out: dict[str, int] = {}
    for source, value in _SOURCE_RE.findall(metrics_text):
        if source in VLLM_SOURCES:
            out[VLLM_SOURCES[source]] = out.get(VLLM_SOURCES[source], 0) + int(float(value))
    tiers = connector_tiers(log_text)
    if tiers:
        out.pop("external", None)
        out.update(tiers)
    return out


def connector_tiers(log_text: str) -> dict[str, int]:
    """Tokens our vLLM connector loaded, by tier, from its per-request log lines."""
    out: dict[str, int] = {}
    for num_good, tokens, by_tier in _LOADED_RE.findall(log_text):
        blocks = int(num_good)
        if not blocks:
            continue
        per_block = int(tokens) // blocks
        for tier, count in ast.literal_eval(by_tier).items():
            out[tier] = out.get(tier, 0) + int(count) * per_block
    return out


def connector_writes(log_text: str) -> dict[str, Any]:
    """Bytes our vLLM connector's tiers took in and the blocks its full write queues dropped,
    from the line it logs as it closes (empty if it did not close cleanly)."""
    found = _CLOSE_RE.findall(log_text)
    if not found:
        return {}
    tiers, dropped = found[-1]
    counters = ast.literal_eval(tiers)
    return {
        "bytes_written": {name: c.get("bytes_in", 0) for name, c in counters.items()},
        "evictions": {name: c.get("evictions", 0) for name, c in counters.items()},
        "write_queue_dropped_blocks": int(dropped),
    }


def connector_saved_bytes(log_text: str) -> int:
    """Bytes our vLLM connector saved into its first tier, summed over vLLM's periodic "KV
    Transfer metrics" lines (each covers one logging interval)."""
    return sum(int(n) for n in _SAVED_RE.findall(log_text))


def cost_refusals(log_text: str) -> int:
    """Stored blocks our connector chose to recompute rather than load (its cost model)."""
    return sum(int(n) for n, _ in _REFUSAL_RE.findall(log_text))


def outputs_against(answers: Sequence[Answer], baseline: Sequence[Answer]) -> dict[str, Any]:
    """Greedy outputs compared with the baseline's, request by request."""
    pairs = [(a, b) for a, b in zip(answers, baseline, strict=True) if not (a.error or b.error)]
    differing = [a.index for a, b in pairs if a.token_ids != b.token_ids]
    return {
        "outputs_compared": len(pairs),
        "outputs_differing": len(differing),
        "outputs_identical": not differing and len(pairs) == len(answers),
        "first_differing_requests": differing[:5],
    }


def ratio(a: float | None, b: float | None) -> float | None:
    """``a / b`` rounded, ``None`` where either is missing or ``b`` is 0."""
    if a is None or not b:
        return None
    return round(a / b, 4)


def headline(
    configs: dict[str, dict[str, Any]], baseline: str, target: str, ceiling: float
) -> dict[str, Any]:
    """The issue's figures: ``target`` (vLLM with the connector) against ``baseline`` (vLLM
    alone), and against LMCache where it ran."""
    base, ours = configs.get(baseline) or {}, configs.get(target) or {}
    if not base or not ours or base.get("error") or ours.get("error"):
        return {}
    work = ratio(ours["prompt_tokens_computed"], base["prompt_tokens_computed"])
    # The least work a cache can leave: the sample's ceiling hit rate against what vLLM's pool
    # alone served in the baseline run.
    bound = ratio(1 - ceiling, 1 - base["hit_rate"])
    ttft = ratio(ours["ttft_mean_s"], base["ttft_mean_s"])
    rps = ratio(ours["requests_per_s"], base["requests_per_s"])
    out: dict[str, Any] = {
        "prefill_work_ratio": work,
        "prefill_work_ratio_bound": bound,
        "ttft_mean_vs_vllm": ttft,
        "ttft_p50_vs_vllm": ratio(ours["ttft_p50_s"], base["ttft_p50_s"]),
        "ttft_p90_vs_vllm": ratio(ours["ttft_p90_s"], base["ttft_p90_s"]),
        "throughput_vs_vllm": rps,
        "ttft_vs_work_bound": ratio(ttft, work),
        "throughput_vs_work_bound": round(rps * work, 4) if rps and work else None,
        "outputs_identical": all(
            c.get("outputs_identical", False)
            for n, c in configs.items()
            if not c.get("error") and n != PREFILL_ONLY
        ),
    }
    out.update(throughput_ceiling(configs.get(PREFILL_ONLY) or {}, base, work))
    lm = configs.get("vllm+lmcache") or {}
    out["lmcache_ran"] = bool(lm) and not lm.get("error")
    out["lmcache_error"] = lm.get("error")
    if out["lmcache_ran"]:
        out["ttft_mean_vs_lmcache"] = ratio(ours["ttft_mean_s"], lm["ttft_mean_s"])
        out["throughput_vs_lmcache"] = ratio(ours["requests_per_s"], lm["requests_per_s"])
    return out


def throughput_ceiling(
    prefill_only: dict[str, Any], base: dict[str, Any], work: float | None
) -> dict[str, Any]:
    """The most ``throughput_vs_work_bound`` can be when decode costs what it costs.

    ``prefill_only`` is vLLM alone on the same requests with one output token each: its wall
    over the baseline's is the share ``f`` of the baseline's time that prefill (and each
    request's fixed overhead, which a cache cannot save either, so ``f`` errs high) takes.
    Computing ``work`` of the prefill at best leaves ``1 - f * (1 - work)`` of the time, so
    requests per second rise at most ``1 / (1 - f * (1 - work))`` times and the figure is at
    most ``work`` times that: 1.0 only where prefill is the whole cost."""
    if not prefill_only or prefill_only.get("error") or not work or not base.get("wall_s"):
        return {}
    share = min(1.0, prefill_only["wall_s"] / base["wall_s"])
    return {
        "baseline_prefill_share": round(share, 4),
        "throughput_vs_work_bound_ceiling": round(work / (1 - share * (1 - work)), 4),
    }


def predicted_hits(
    requests: Sequence[Any],
    block_size: int,
    blocks: tuple[int, int, int],
    guard_first_hits: int,
    in_flight: int = 1,
) -> list[int]:
    """Each request's hit tokens as ``cachetier report --trace`` replays the scaled trace:
    the same ``replay_hierarchy`` over the same pool and tier capacities (``blocks``: pool,
    CPU, disk), guard and requests in flight, request by request."""
    from cachetier.report.config import ReportConfig
    from cachetier.report.hierarchy_replay import replay_hierarchy
    from cachetier.report.replay import ReplayTrace, TraceRequest

    trace = ReplayTrace.from_requests(
        [TraceRequest(r.index, len(r.prompt), r.max_tokens, r.hash_ids) for r in requests],
        block_size=block_size,
    )
    pool_blocks, cpu_blocks, disk_blocks = blocks
    config = ReportConfig(
        trace="scaled",
        cpu_blocks=cpu_blocks,
        disk_blocks=disk_blocks,
        block_size=block_size,
        pool_blocks=pool_blocks,
        guard_first_hits=guard_first_hits,
        in_flight=in_flight,
    )
    events, _ = replay_hierarchy(trace, config, ["t"] * len(requests))
    return [sum(e.hit_tokens.values()) for e in events]


def hit_gap(answers: Sequence[Answer], predicted: Sequence[int]) -> dict[str, Any]:
    """Where the live hits and the report's differ, request by request: how many requests got
    fewer (more) hit tokens than predicted, by how many tokens, and the first few of each."""
    below = [
        (a.index, p - a.cached_tokens) for a, p in zip(answers, predicted) if a.cached_tokens < p
    ]
    above = [
        (a.index, a.cached_tokens - p) for a, p in zip(answers, predicted) if a.cached_tokens > p
    ]
    return {
        "requests_below_report": len(below),
        "tokens_below_report": sum(n for _, n in below),
        "first_below": below[:8],
        "requests_above_report": len(above),
        "tokens_above_report": sum(n for _, n in above),
        "first_above": above[:8],
    }
