"""The steps of a report in order: read the inputs, replay a trace, compute the figures.

The result is one JSON-ready dict, the report document: the JSON output is this dict, and the
HTML page and the terminal summary are drawn from it alone.
"""

from __future__ import annotations

import datetime
import time
from typing import Any

from cachetier.report.config import PREFILL_SOURCE, PREFILL_TOKENS_PER_S, ReportConfig
from cachetier.report.counters import counters_table
from cachetier.report.curve import add_trace_figures
from cachetier.report.figures import lookup_figures
from cachetier.report.hierarchy_replay import replay_for_report
from cachetier.report.inputs import load_events, load_stats, load_trace
from cachetier.report.live_curve import live_curve_figure

SCHEMA = "cachetier-report/1"


def build_report(config: ReportConfig) -> dict[str, Any]:
    """Read the inputs and compute every figure.

    Args:
        config: inputs and settings.

    Returns:
        The report document: ``schema``, ``input``, ``settings``, ``headline`` (the numbers the
        summary prints), ``figures`` by name, ``build_s`` (seconds to read the inputs and
        compute the figures) and ``timings_s`` (a trace's read and replay seconds).

    Raises:
        ValueError: an input is missing or corrupt (one line, naming the file).
    """
    start = time.perf_counter()
    # Stats first: a refused URL should fail before a long replay, not after it.
    stats = load_stats(config.stats) if config.stats else None
    prefill_source = (
        PREFILL_SOURCE
        if config.prefill_tokens_per_s == PREFILL_TOKENS_PER_S
        else "given with --prefill-tokens-per-s."
    )
    figures: dict[str, dict[str, Any]] = {}
    timings: dict[str, float] = {}
    doc_input: dict[str, Any] = {}
    if config.trace:
        trace = load_trace(config.trace, config.block_size)
        timings["read_s"] = time.perf_counter() - start
        replays = replay_for_report(trace, config)
        timings["replay_s"] = time.perf_counter() - start - timings["read_s"]
        figures = lookup_figures(
            replays.events,
            prefill_tokens_per_s=config.prefill_tokens_per_s,
            prefill_source=prefill_source,
            bin_s=config.bin_s,
        )
        add_trace_figures(figures, trace, replays, config, config.policy)
        doc_input = {"kind": "trace", "path": config.trace, "num_lookups": len(trace.requests)}
    elif config.events:
        events = load_events(config.events)
        figures = lookup_figures(
            events,
            prefill_tokens_per_s=config.prefill_tokens_per_s,
            prefill_source=prefill_source,
            bin_s=config.bin_s,
        )
        doc_input = {"kind": "events", "path": config.events, "num_lookups": len(events)}
    if stats is not None:
        assert config.stats is not None, "stats were read from config.stats"
        figures["tier_counters"] = counters_table(stats, config.stats)
        live = live_curve_figure(stats, config.stats)
        if live is not None:
            figures["live_curve"] = live
        doc_input.setdefault("kind", "stats")
        doc_input["stats"] = config.stats
    return {
        "schema": SCHEMA,
        "generated_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "input": doc_input,
        "settings": _settings(config),
        "headline": headline(figures),
        "figures": figures,
        "build_s": time.perf_counter() - start,
        "timings_s": timings,
    }


def _settings(config: ReportConfig) -> dict[str, Any]:
    out: dict[str, Any] = {
        "prefill_tokens_per_s": config.prefill_tokens_per_s,
        "bin_s": config.bin_s,
    }
    if config.trace:
        out.update(
            cpu_blocks=config.cpu_blocks,
            disk_blocks=config.disk_blocks,
            block_size=config.block_size,
            pool_blocks=config.pool_blocks,
            guard_first_hits=config.guard_first_hits,
            in_flight=config.in_flight,
            exact=config.exact,
            max_error=config.max_error,
            policy=config.policy,
            num_tenants=config.num_tenants,
            curve_capacities=list(config.curve_capacities),
            curve_policies=list(config.curve_policies),
            admission_policies=list(config.admission_policies),
            num_workers=config.num_workers,
        )
    return out


def headline(figures: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The numbers a reader looks for first, taken from the figures.

    Args:
        figures: the report's figures.

    Returns:
        Flat totals; for a trace also ``block_hit_ratio`` and, under ``at_capacity``, every
        curve policy's block hit ratio at the two modelled tier capacities.
    """
    out: dict[str, Any] = {}
    if "per_tenant" in figures:
        tenants = figures["per_tenant"]
        num_tokens = sum(tenants["num_tokens"])
        saved = figures["saved"]
        out.update(
            num_lookups=sum(tenants["num_lookups"]),
            num_tenants=len(tenants["tenants"]),
            num_tokens=num_tokens,
            hit_tokens=saved["hit_tokens"],
            token_hit_ratio=saved["hit_tokens"] / num_tokens if num_tokens else 0.0,
            hit_tokens_by_source=dict(
                zip(figures["per_tier"]["sources"], figures["per_tier"]["hit_tokens"])
            ),
            saved_s=saved["saved_s"],
            restore_s=saved["restore_s"],
            net_saved_s=saved["net_saved_s"],
            alignment_lost_tokens=figures["alignment"]["alignment_lost_tokens"],
            loaded_tokens=figures["load_or_recompute"]["loaded_tokens"],
            recomputed_by_choice_tokens=figures["load_or_recompute"]["recomputed_by_choice_tokens"],
            cost_model_est_saved_s=figures["load_or_recompute"]["est_saved_s"],
            verified_by_guard_tokens=figures["load_or_recompute"]["verified_by_guard_tokens"],
            quarantined_tokens=figures["load_or_recompute"]["quarantined_tokens"],
            miss_tokens_by_cause=dict(
                zip(figures["why_missed"]["causes"], figures["why_missed"]["miss_tokens"])
            ),
            unexplained_miss_tokens=figures["why_missed"]["unexplained_tokens"],
        )
    if "capacity_curve" in figures:
        curve = figures["capacity_curve"]
        out["block_hit_ratio"] = figures["per_tier"]["block_hit_ratio"]
        out["default_policy"] = curve["default_policy"]
        out["at_capacity"] = {
            str(capacity): {
                **{n: rs[curve["capacities"].index(capacity)] for n, rs in curve["series"].items()},
                "infinite": curve["ceiling"],
            }
            for capacity in sorted(set(curve["tier_capacity_blocks"].values()))
        }
        out["ceiling"] = curve["ceiling"]
        out["default_ge_lru_at_every_capacity"] = curve["default_ge_lru_at_every_capacity"]
    if "tier_counters" in figures:
        out["num_counter_rows"] = len(figures["tier_counters"]["rows"])
    return out
