"""Prometheus metrics of the engine server, in its own per-app ``CollectorRegistry``.

Names are vLLM's with ``cachetier_engine_`` in place of ``vllm:``: a vLLM dashboard or alert
moves over by swapping the prefix, the names stay in the sidecar's ``cachetier_`` family, and
colons stay free for recording rules, which is what Prometheus reserves them for.

Gauges (and the preemption count) are read from the engine's stats snapshot at scrape time;
token counters and latency histograms are updated as outputs arrive, on the engine thread.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from cachetier.engine.llm_engine import RequestOutput
from cachetier.report.events import SOURCES
from cachetier.server.metrics import (
    admission_families,
    live_curve_families,
    pin_families,
    store_health_families,
    tier_counter_families,
    tier_rate_families,
)

PREFIX = "cachetier_engine_"
# Miss causes that concern no tier (the engine's own choices and block alignment).
_TIERLESS = frozenset({"partial_block", "too_slow", "never_stored"})

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
# Seconds. CPU inference: a first token takes tens of ms (cached) to tens of seconds (long cold
# prompts); a decode step of a small model a few ms to a few hundred.
_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
_TPOT_BUCKETS = (0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5)
_E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0)


class EngineMetrics:
    """The registry of one app and what goes into it.

    Args:
        stats: returns the engine's latest ``stats()`` (read at scrape time).
        model_name: the served model's name (the ``model_name`` label, as vLLM labels).
        store_stats: returns the engine's ``TieredStore.stats()`` (read at scrape time), or
            ``None`` when the engine has no tiers.
    """

    def __init__(
        self,
        stats: Callable[[], Mapping[str, Any]],
        model_name: str,
        store_stats: Callable[[], dict[str, Any]] | None = None,
    ) -> None:
        self.registry = CollectorRegistry()
        labels = {"model_name": model_name}

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(PREFIX + name, doc, [*labels, *extra], registry=self.registry)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(
                PREFIX + name, doc, list(labels), buckets=buckets, registry=self.registry
            )

        self._prompt_tokens = counter("prompt_tokens", "Prompt tokens of started requests")
        self._generation_tokens = counter("generation_tokens", "Tokens generated")
        self._queries = counter(
            "prefix_cache_queries", "Prompt tokens looked up in the prefix cache"
        )
        self._hits = counter(
            "prefix_cache_hits",
            "Prompt tokens served from cache, by source (the pool or a tier)",
            ("source",),
        )
        self._misses = counter(
            "prefix_cache_misses",
            "Prompt tokens not served from cache, by cause and the tier it concerns",
            ("cause", "tier"),
        )
        self._success = counter(
            "request_success", "Requests finished, by finish reason", ("finished_reason",)
        )
        self._ttft = histogram(
            "time_to_first_token_seconds", "From arrival to the first token", _TTFT_BUCKETS
        )
        self._tpot = histogram(
            "time_per_output_token_seconds",
            "Between consecutive tokens of a request",
            _TPOT_BUCKETS,
        )
        self._e2e = histogram(
            "e2e_request_latency_seconds", "From arrival to the last token", _E2E_BUCKETS
        )
        self._model_name = model_name
        for source in SOURCES:
            # Every series exists from the start: an alert on a rate needs it before the first hit.
            self._hits.labels(model_name, source)
        # Likewise: a series born with its first request has no sample from before it, so
        # rate() and histogram_quantile() would leave that request out.
        for family in (
            self._prompt_tokens,
            self._generation_tokens,
            self._queries,
            self._ttft,
            self._tpot,
            self._e2e,
        ):
            family.labels(model_name)
        self.registry.register(_EngineStatsCollector(stats, model_name))
        if store_stats is not None:
            self.registry.register(_EngineStoreCollector(store_stats))

    def on_output(
        self, output: RequestOutput, arrival_s: float, previous_token_s: float | None, now: float
    ) -> None:
        """Account one output of the engine (called on the engine thread)."""
        name = self._model_name
        if previous_token_s is None:
            num_prompt = len(output.prompt_token_ids)
            self._ttft.labels(name).observe(now - arrival_s)
            self._prompt_tokens.labels(name).inc(num_prompt)
            self._queries.labels(name).inc(num_prompt)
            for source, num in output.cached_tokens_by_source.items():
                self._hits.labels(name, source).inc(num)
            for cause, num in output.miss_tokens_by_cause.items():
                # Only the run's own cause has a tier; the fixed ones (partial_block,
                # too_slow) concern none.
                tier = output.miss_tier if cause not in _TIERLESS else ""
                self._misses.labels(name, cause, tier).inc(num)
        else:
            self._tpot.labels(name).observe(now - previous_token_s)
        self._generation_tokens.labels(name).inc(len(output.new_token_ids))

    def on_request_done(self, finish_reason: str, e2e_s: float) -> None:
        """Account a request the client saw end (``stop``, ``length``, ``abort``: the client
        left, or ``error``)."""
        self._success.labels(self._model_name, finish_reason).inc()
        self._e2e.labels(self._model_name).observe(e2e_s)

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        return generate_latest(self.registry)


class _EngineStatsCollector(Collector):
    def __init__(self, stats: Callable[[], Mapping[str, Any]], model_name: str) -> None:
        self._stats = stats
        self._model_name = model_name

    def collect(self) -> Iterator[Metric]:
        stats = self._stats()
        label = [self._model_name]
        gauges = (
            (
                "kv_cache_usage_perc",
                "KV pool usage, 0 to 1 (1: every block held)",
                "kv_cache_usage",
            ),
            ("num_requests_running", "Requests in the running batch", "num_running"),
            ("num_requests_waiting", "Requests waiting to be admitted", "num_waiting"),
        )
        for name, doc, key in gauges:
            family = GaugeMetricFamily(PREFIX + name, doc, labels=["model_name"])
            family.add_metric(label, stats[key])
            yield family
        counters = [
            ("num_preemptions", "Sequences preempted (recomputed later)", "num_preemptions"),
            (
                "evicted_blocks",
                "KV pool blocks evicted (saved to the tiers first)",
                "num_evicted_blocks",
            ),
        ]
        if "restored_bytes" in stats:
            # Restore bandwidth is rate(restored_bytes) / rate(restore_seconds).
            counters += [
                ("saved_blocks", "Blocks saved to the tiers", "saved_blocks"),
                ("restored_bytes", "Bytes restored from the tiers into the pool", "restored_bytes"),
                ("restore_seconds", "Seconds spent restoring blocks from the tiers", "restore_s"),
            ]
        for name, doc, key in counters:
            family = CounterMetricFamily(PREFIX + name, doc, labels=["model_name"])
            family.add_metric(label, stats[key])
            yield family
        if "restored_bytes" in stats:
            by_tier = CounterMetricFamily(
                PREFIX + "restored_blocks",
                "Blocks restored from the tiers, by the tier that held them",
                labels=["model_name", "tier"],
            )
            for tier, count in stats["restored_by_tier"].items():
                by_tier.add_metric([*label, tier], count)
            yield by_tier
        cost = stats.get("cost_model")
        if cost is not None:
            recomputed = CounterMetricFamily(
                "cachetier_recomputed_by_choice_tokens",
                "Prompt tokens the tiers held that the cost model chose to recompute",
                labels=["model_name"],
            )
            recomputed.add_metric(label, cost["recomputed_tokens"])
            yield recomputed
            plans = CounterMetricFamily(
                "cachetier_load_plans",
                "Requests with a tier hit, by the cost model's choice: load_all, partial "
                "(recompute some hit blocks) or recompute_all",
                labels=["model_name", "choice"],
            )
            for choice, count in cost["plans"].items():
                plans.add_metric([*label, choice], count)
            yield plans
            yield from tier_rate_families(cost["tiers"])


class _EngineStoreCollector(Collector):
    """The engine's own tiers (a CPU tier in the pod, the sidecar behind it): the sidecar's
    names, told apart by the scrape's ``job``."""

    def __init__(self, store_stats: Callable[[], dict[str, Any]]) -> None:
        self._store_stats = store_stats

    def collect(self) -> Iterator[Metric]:
        stats = self._store_stats()
        yield from tier_counter_families(stats["tiers"])
        yield from pin_families(stats["tiers"])
        yield from store_health_families(stats)
        yield from admission_families(stats)
        yield from live_curve_families(stats)
