"""The figures of lookups (from an event log or a trace replay) as plain dicts.

Each figure is ``{"title": ..., "how": ..., <data>}``: the JSON output holds them as they are,
the plots draw them and the HTML page prints ``how`` under each plot. Ratios of an empty
bin are ``None``. Every token count here is a prompt token count.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from cachetier.report.events import MISS_CAUSES, SOURCES, LookupEvent

MAX_TENANTS_PLOTTED = 20  # the rest are drawn as one "other" bar; the JSON keeps all
_NICE_BIN_S = (1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200, 21600, 86400)


def pick_bin_s(span_s: float, max_bins: int = 60) -> float:
    """The smallest round bin width that cuts ``span_s`` into at most ``max_bins`` bins.

    Args:
        span_s: seconds from the first lookup to the last.
        max_bins: most bins wanted.

    Returns:
        The width in seconds.
    """
    for width in _NICE_BIN_S:
        if span_s / width <= max_bins:
            return float(width)
    return float(np.ceil(span_s / max_bins / 86400) * 86400)


def time_bins(times_s: np.ndarray, bin_s: float) -> tuple[np.ndarray, int]:
    """Bin index of each time, counted from the earliest.

    Args:
        times_s: times in seconds.
        bin_s: bin width in seconds.

    Returns:
        The index per time and the number of bins.
    """
    index = np.floor((times_s - times_s.min()) / bin_s).astype(np.int64)
    return index, int(index.max()) + 1


def ratio(num: np.ndarray, den: np.ndarray) -> list[float | None]:
    """``num / den`` per element, ``None`` where ``den`` is 0.

    Args:
        num: numerators.
        den: denominators, as many.

    Returns:
        The ratios, as plain floats for the JSON output.
    """
    return [float(n / d) if d else None for n, d in zip(num, den)]


def lookup_figures(
    events: Sequence[LookupEvent],
    *,
    prefill_tokens_per_s: float,
    prefill_source: str,
    bin_s: float | None = None,
) -> dict[str, dict[str, Any]]:
    """Hit rate over time, per source, per tenant, prefill saved, and alignment losses.

    Args:
        events: the lookups, in any order.
        prefill_tokens_per_s: prefill speed that turns hit tokens into seconds.
        prefill_source: where that speed comes from (printed with the figure).
        bin_s: width of the time bins; ``None`` picks a round width giving at most 60 bins.

    Returns:
        Figures by name: ``hit_rate_over_time``, ``per_tier``, ``per_tenant``, ``saved``,
        ``alignment`` and ``load_or_recompute``.
    """
    if not events:
        raise ValueError("no lookups to report on")
    times = np.array([e.time_s for e in events], dtype=np.float64)
    tokens = np.array([e.num_tokens for e in events], dtype=np.int64)
    hits = {s: np.array([e.hit_tokens.get(s, 0) for e in events], np.int64) for s in SOURCES}
    lost = np.array([e.num_alignment_lost_tokens for e in events], dtype=np.int64)
    restore = np.array([e.restore_s for e in events], dtype=np.float64)
    total_hits = sum(hits.values())
    t0_s = float(times.min())
    width = bin_s or pick_bin_s(float(times.max()) - t0_s)
    bins = _TimeBins(*time_bins(times, width), width)
    # Sources that served nothing stay out of the plots, not out of the question.
    sources = [s for s in SOURCES if hits[s].any()] or ["cpu"]
    num_tokens = int(tokens.sum())
    saved_s = total_hits / prefill_tokens_per_s
    return {
        "hit_rate_over_time": _over_time(bins, t0_s, tokens, total_hits, hits, sources),
        "per_tier": _per_tier(hits, sources, num_tokens),
        "per_tenant": _per_tenant(events, total_hits, tokens, lost, saved_s - restore),
        "saved": _saved(bins, total_hits, saved_s, restore, prefill_tokens_per_s, prefill_source),
        "alignment": _alignment(events, num_tokens, hits, sources, lost),
        "load_or_recompute": _load_or_recompute(events, hits),
        "why_missed": _why_missed(events, num_tokens, int(total_hits.sum())),
    }


@dataclass(frozen=True, slots=True)
class _TimeBins:
    """Which time bin each lookup falls in, and how many bins of ``width`` seconds there are."""

    index: np.ndarray
    num_bins: int
    width: float

    def sum(self, values: np.ndarray) -> np.ndarray:
        """``values`` summed per bin."""
        return np.bincount(self.index, weights=values, minlength=self.num_bins)


def _over_time(
    bins: _TimeBins,
    t0_s: float,
    tokens: np.ndarray,
    total_hits: np.ndarray,
    hits: dict[str, np.ndarray],
    sources: list[str],
) -> dict[str, Any]:
    bin_tokens = bins.sum(tokens)
    width, num_bins = bins.width, bins.num_bins
    return {
        "title": "Hit rate over time",
        "how": (
            f"Lookups are grouped into {width:g}-second bins by their time from the first "
            "lookup. Token hit ratio of a bin = prompt tokens served from cache in the bin / "
            "prompt tokens asked for in it, split by where the hit came from. Only whole "
            "blocks count as hits (see 'Tokens lost to block alignment')."
        ),
        "bin_s": width,
        "t0_s": t0_s,
        "bin_start_s": [i * width for i in range(num_bins)],
        "num_lookups": np.bincount(bins.index, minlength=num_bins).tolist(),
        "num_tokens": bin_tokens.astype(np.int64).tolist(),
        "token_hit_ratio": ratio(bins.sum(total_hits), bin_tokens),
        "token_hit_ratio_by_source": {s: ratio(bins.sum(hits[s]), bin_tokens) for s in sources},
    }


def _per_tier(hits: dict[str, np.ndarray], sources: list[str], num_tokens: int) -> dict[str, Any]:
    return {
        "title": "Hits per tier",
        "how": (
            "Prompt tokens served by each source over the whole run, and their share of all "
            "prompt tokens asked for. A lookup's hit is the longest leading run of its blocks "
            "held anywhere; each block of that run is credited to the tier that held it."
        ),
        "sources": sources,
        "hit_tokens": [int(hits[s].sum()) for s in sources],
        "share_of_prompt_tokens": [float(hits[s].sum() / num_tokens) for s in sources],
    }


def _saved(
    bins: _TimeBins,
    total_hits: np.ndarray,
    saved_s: np.ndarray,
    restore: np.ndarray,
    prefill_tokens_per_s: float,
    prefill_source: str,
) -> dict[str, Any]:
    return {
        "title": "Prefill saved (cumulative)",
        "how": (
            "Prefill tokens saved = prompt tokens served from cache. Estimated seconds saved = "
            f"those tokens / {prefill_tokens_per_s:.1f} prefill tokens per second; net seconds "
            "subtract the time spent restoring hits from the tiers (restore_s of each lookup; 0 "
            "in a trace replay, which moves no real payloads). The estimate is linear in "
            "tokens, while attention makes a token of a long prompt cost more than one of a "
            f"short prompt. Prefill speed: {prefill_source}"
        ),
        "prefill_tokens_per_s": prefill_tokens_per_s,
        "prefill_source": prefill_source,
        "hit_tokens": int(total_hits.sum()),
        "saved_s": float(saved_s.sum()),
        "restore_s": float(restore.sum()),
        "net_saved_s": float(saved_s.sum() - restore.sum()),
        "bin_end_s": [(i + 1) * bins.width for i in range(bins.num_bins)],
        "cumulative_hit_tokens": np.cumsum(bins.sum(total_hits)).astype(np.int64).tolist(),
        "cumulative_net_saved_s": np.cumsum(bins.sum(saved_s - restore)).tolist(),
    }


def _load_or_recompute(
    events: Sequence[LookupEvent], hits: dict[str, np.ndarray]
) -> dict[str, Any]:
    loaded = sum(int(hits[s].sum()) for s in SOURCES if s != "pool")
    recomputed = sum(e.recomputed_tokens for e in events)
    return {
        "title": "Load or recompute",
        "how": (
            "Tokens the tiers held, split by what the engine's cost model chose: loaded (read "
            "from a tier) or recomputed by choice (reading them was estimated slower than "
            "computing them, e.g. a slow link). Estimated seconds saved is the model's own "
            "estimate per lookup: TTFT had the whole hit been recomputed, minus TTFT of the "
            "chosen plan. Lookups logged without a cost model count as all loaded. Verified "
            "by the guard: tier hits the restore guard drew, computed and compared with the "
            "tier's records instead of loaded. Quarantined: tokens a tier held but may not serve, "
            "because the guard found its records wrong for this namespace."
        ),
        "loaded_tokens": loaded,
        "recomputed_by_choice_tokens": recomputed,
        "num_lookups_with_recompute": sum(1 for e in events if e.recomputed_tokens),
        "est_saved_s": float(sum(e.est_saved_s for e in events)),
        "verified_by_guard_tokens": sum(e.verified_tokens for e in events),
        "num_lookups_verified": sum(1 for e in events if e.verified_tokens),
        "quarantined_tokens": sum(e.miss_tokens.get("quarantined", 0) for e in events),
        "num_lookups_quarantined": sum(1 for e in events if e.miss_tokens.get("quarantined")),
    }


def _why_missed(events: Sequence[LookupEvent], num_tokens: int, hit_tokens: int) -> dict[str, Any]:
    by_cause = {c: sum(e.miss_tokens.get(c, 0) for e in events) for c in MISS_CAUSES}
    verified = sum(e.verified_tokens for e in events)
    missed = num_tokens - hit_tokens
    # Logs written before causes were recorded leave their misses unexplained, and say so.
    unexplained = missed - verified - sum(by_cause.values())
    return {
        "title": "Why misses missed",
        "how": (
            "Prompt tokens not served from cache, by cause: never_stored (no tier ever held "
            "them), evicted, not_admitted (admission kept them out), write_dropped (a full "
            "write queue), namespace_mismatch (held under another model, layout or tenant), "
            "corrupt, too_slow (the cost model recomputed them), tier_down, partial_block (past "
            "the last full block), quarantined (the restore guard). Verified: computed to check "
            "a tier. Unexplained: misses of lookups logged without a cause."
        ),
        "causes": list(MISS_CAUSES),
        "miss_tokens": [by_cause[c] for c in MISS_CAUSES],
        "share_of_misses": [by_cause[c] / missed if missed else 0.0 for c in MISS_CAUSES],
        "verified_tokens": verified,
        "unexplained_tokens": max(unexplained, 0),
    }


def _per_tenant(
    events: Sequence[LookupEvent],
    hits: np.ndarray,
    tokens: np.ndarray,
    lost: np.ndarray,
    net_saved_s: np.ndarray,
) -> dict[str, Any]:
    names, index = np.unique([e.tenant for e in events], return_inverse=True)
    count = len(names)
    tok = np.bincount(index, weights=tokens, minlength=count)
    hit = np.bincount(index, weights=hits, minlength=count)
    order = np.argsort(-tok, kind="stable")  # biggest tenants first
    return {
        "title": "Hits per tenant",
        "how": (
            "Lookups grouped by tenant (the cache salt / token's tenant the lookup was made "
            "under; '' is none). Token hit ratio = the tenant's prompt tokens served from "
            "cache / its prompt tokens. Tenants are listed by prompt tokens, largest first; "
            f"past the first {MAX_TENANTS_PLOTTED} the plot adds the rest up as 'other'."
        ),
        "tenants": [str(names[i]) for i in order],
        "num_lookups": np.bincount(index, minlength=count)[order].tolist(),
        "num_tokens": tok[order].astype(np.int64).tolist(),
        "hit_tokens": hit[order].astype(np.int64).tolist(),
        "token_hit_ratio": ratio(hit[order], tok[order]),
        "alignment_lost_tokens": np.bincount(index, weights=lost, minlength=count)[order]
        .astype(np.int64)
        .tolist(),
        "net_saved_s": np.bincount(index, weights=net_saved_s, minlength=count)[order].tolist(),
    }


def _alignment(
    events: Sequence[LookupEvent],
    num_tokens: int,
    hits: dict[str, np.ndarray],
    sources: list[str],
    lost: np.ndarray,
) -> dict[str, Any]:
    num_hit = int(sum(int(hits[s].sum()) for s in sources))
    num_lost = int(lost.sum())
    block_sizes = sorted({e.block_size for e in events})
    return {
        "title": "Tokens lost to block alignment",
        "how": (
            "A cache keeps whole blocks of "
            + "/".join(map(str, block_sizes))
            + " tokens, so the tokens of a prompt's partial last block are prefilled again "
            "even when they match. Each lookup's lost tokens are counted where it was logged: "
            "the engine counts the partial tail of a prompt whose every full block hit (an "
            "upper bound: it cannot tell whether the tail matched); a trace replay counts a "
            "partial last block whose hash id matched. Lost share = lost tokens / (hit + lost "
            "tokens). The bar splits every prompt token into served from each tier, lost to "
            "alignment, and prefilled."
        ),
        "block_sizes": block_sizes,
        "alignment_lost_tokens": num_lost,
        "num_lookups_with_loss": int((lost > 0).sum()),
        "share_of_matched_tokens": num_lost / (num_hit + num_lost) if num_hit + num_lost else 0.0,
        "share_of_prompt_tokens": num_lost / num_tokens if num_tokens else 0.0,
        "breakdown": {
            "cache": {
                **{f"hit_{s}": int(hits[s].sum()) for s in sources},
                "alignment_lost": num_lost,
                "prefilled": num_tokens - num_hit - num_lost,
            }
        },
    }
