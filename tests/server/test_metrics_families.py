"""The metric families both servers share: tier counters, write-queue drops, breaker states."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

from cachetier.server.metrics import store_health_families, tier_counter_families
from cachetier.tiers.stats import COUNTERS
from cachetier.util.backoff import CircuitBreaker, ExponentialBackoff
from tests.support import FakeClock


class _Fixed(Collector):
    def __init__(self, stats: dict) -> None:
        self._stats = stats

    def collect(self) -> Iterator[Metric]:
        yield from tier_counter_families(self._stats["tiers"])
        yield from store_health_families(self._stats)


def _samples(stats: dict) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    registry = CollectorRegistry()
    registry.register(_Fixed(stats))
    text = generate_latest(registry).decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_drops_failures_and_an_open_breaker_are_exported() -> None:
    clock = FakeClock()
    breaker = CircuitBreaker(2, ExponentialBackoff(1.0, 4.0), clock=clock)
    breaker.record_failure()
    breaker.record_failure()  # the threshold: open
    cpu = {name: 0 for name in COUNTERS} | {"hits": 3, "evictions": 2}
    redis = {name: 0 for name in COUNTERS} | {"errors": 2, "breaker": breaker.snapshot()}
    stats = {"rejected": 5, "errors": 1, "tiers": {"cpu": cpu, "redis": redis}}

    samples = _samples(stats)

    assert samples[("cachetier_write_queue_dropped_blocks_total", ())] == 5
    assert samples[("cachetier_write_queue_failed_blocks_total", ())] == 1
    assert samples[("cachetier_tier_hits_total", (("tier", "cpu"),))] == 3
    assert samples[("cachetier_tier_evictions_total", (("tier", "cpu"),))] == 2
    assert samples[("cachetier_tier_errors_total", (("tier", "redis"),))] == 2
    states = {
        dict(labels)["state"]: value
        for (name, labels), value in samples.items()
        if name == "cachetier_tier_breaker_state"
    }
    assert states == {"closed": 0.0, "open": 1.0, "half_open": 0.0}
    assert samples[("cachetier_tier_breaker_opens_total", (("tier", "redis"),))] == 1
    # A local tier has no breaker, so no breaker series.
    assert not any(
        name.startswith("cachetier_tier_breaker") and ("tier", "cpu") in labels
        for name, labels in samples
    )
