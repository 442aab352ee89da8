"""Prometheus metrics: request counts and latency, and the store's and tenants' counters.

Each app gets its own ``CollectorRegistry`` (no process-global default registry), owned by the
lifespan like the store. Tier and tenant figures are read from ``stats()`` at scrape time, so
there is one set of counters, not a second copy kept in step.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from cachetier.admission import FIXED_POLICIES
from cachetier.server.connections import ConnectionTable
from cachetier.server.listener import HttpAcceptor
from cachetier.server.service import BlockService
from cachetier.server.transfer import TransferServer
from cachetier.tiers.stats import COUNTERS
from cachetier.util.backoff import BreakerState

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_TIER_COUNTERS = COUNTERS
_TENANT_COUNTERS = ("hits", "misses", "puts", "bytes_in", "bytes_out", "rejected")
# Seconds; a 5.6 MiB block over loopback takes a few ms, a batch of them tens.
_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


class ServerMetrics:
    """The registry of one app and the request metrics recorded into it.

    Args:
        service: whose tiers and tenants are reported.
        transfer: the transfer server whose connections are reported, if one runs.
    """

    def __init__(self, service: BlockService, transfer: TransferServer | None = None) -> None:
        self.registry = CollectorRegistry()
        self.transfer = transfer  # its listeners count in readiness (routes_admin)
        self._requests = Counter(
            "cachetier_http_requests",
            "HTTP requests answered, by route and status",
            ["method", "route", "status"],
            registry=self.registry,
        )
        self._latency = Histogram(
            "cachetier_http_request_duration_seconds",
            "Time from request to the last byte of the answer",
            ["method", "route"],
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self._closed = Counter(
            "cachetier_http_connections_closed",
            "HTTP connections the server closed on a client: head_timeout, body_timeout, "
            "send_timeout (an answer not read), head_too_large, unauthenticated_timeout, "
            "connection_cap, unauthenticated_cap, tls_handshake_cap, descriptors (shed to "
            "accept again)",
            ["reason"],
            registry=self.registry,
        )
        self._refused_body_max = 0
        refused = Gauge(
            "cachetier_http_refused_body_bytes_max",
            "Most body bytes read of a request before it was refused on its token (401/403)",
            registry=self.registry,
        )
        refused.set_function(lambda: self._refused_body_max)
        inflight = Gauge(
            "cachetier_inflight_bytes",
            "Upload bytes held right now (bodies and payloads being checked), all ports",
            registry=self.registry,
        )
        inflight.set_function(lambda: service.inflight.taken_bytes)
        self.registry.register(_StoreCollector(service))
        if transfer is not None:
            self.registry.register(_TransferCollector(transfer))

    def watch_http(self, table: ConnectionTable, acceptors: list[HttpAcceptor]) -> None:
        """Report the HTTP port's connections and accept errors (``httpserver.GuardedServer``
        calls it once it listens).

        Args:
            table: its connection caps.
            acceptors: its accept loops.
        """
        self.registry.register(_HttpConnectionCollector(table, acceptors))

    def note_closed(self, reason: str) -> None:
        """Count a connection the HTTP guard closed (``httpserver.GuardedHttpProtocol``).

        Args:
            reason: why, e.g. ``head_timeout``.
        """
        self._closed.labels(reason).inc()

    def note_refused_body(self, nbytes: int) -> None:
        """Note how much of a body was read before its request was refused on its token.

        Args:
            nbytes: body bytes read by the time of the 401/403 answer.
        """
        self._refused_body_max = max(self._refused_body_max, nbytes)

    def observe(self, method: str, route: str, status: int, seconds: float) -> None:
        """Count one answered request.

        Args:
            method: the HTTP method.
            route: the route template (not the path: one series per endpoint).
            status: the answer's status code.
            seconds: from the request to the answer's last byte.
        """
        self._requests.labels(method, route, str(status)).inc()
        self._latency.labels(method, route).observe(seconds)

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        return generate_latest(self.registry)


class _StoreCollector(Collector):
    def __init__(self, service: BlockService) -> None:
        self._service = service

    def collect(self) -> Iterator[Metric]:
        stats = self._service.store.stats()
        tiers: dict[str, dict[str, Any]] = stats["tiers"]
        yield from tier_counter_families(tiers)
        used = GaugeMetricFamily("cachetier_tier_used_bytes", "bytes a tier holds", labels=["tier"])
        cap = GaugeMetricFamily(
            "cachetier_tier_capacity_bytes", "capacity of a tier", labels=["tier"]
        )
        for tier, figures in tiers.items():
            used.add_metric([tier], figures["used_bytes"])
            if figures["capacity_bytes"] is not None:
                cap.add_metric([tier], figures["capacity_bytes"])
        yield used
        yield cap
        yield from pin_families(tiers)
        pending = GaugeMetricFamily(
            "cachetier_pending_writes", "blocks queued for a lower tier", labels=["tier"]
        )
        for tier, count in stats["pending_writes"].items():
            pending.add_metric([tier], count)
        yield pending
        yield from tier_rate_families(stats["rates"])
        yield from store_health_families(stats)
        yield from guard_families(stats["guard"], len(self._service.store.quarantines.entries()))
        yield from admission_families(stats)
        yield from live_curve_families(stats)
        per_tenant = {t: self._service.tenant_stats(t) for t in self._service.tenant_names}
        for name in _TENANT_COUNTERS:
            family = CounterMetricFamily(
                f"cachetier_tenant_{name}", f"{name} of each tenant", labels=["tenant"]
            )
            for tenant, figures in per_tenant.items():
                family.add_metric([tenant], figures[name])
            yield family
        causes = CounterMetricFamily(
            "cachetier_tenant_lookup_misses",
            "blocks each tenant's lookups missed, by cause and the tier it concerns",
            labels=["tenant", "cause", "tier"],
        )
        for tenant, counts in self._service.misses_by_cause().items():
            for (cause, tier), count in sorted(counts.items()):
                causes.add_metric([tenant, cause, tier], count)
        yield causes


def tier_counter_families(tiers: dict[str, dict[str, Any]]) -> Iterator[Metric]:
    """``cachetier_tier_<counter>{tier}`` for every counter of ``TierStats``.

    Args:
        tiers: each tier's ``stats()`` by tier name (``TieredStore.stats()["tiers"]``).
    """
    for name in _TIER_COUNTERS:
        family = CounterMetricFamily(
            f"cachetier_tier_{name}", f"{name} of each tier", labels=["tier"]
        )
        for tier, figures in tiers.items():
            family.add_metric([tier], figures.get(name, 0))
        yield family


def guard_families(guard: dict[str, dict[str, int]], held: int) -> Iterator[Metric]:
    """The restore guard's counters by tier (``TieredStore.stats()["guard"]``) and the
    quarantines held now."""
    docs = {
        "verified_blocks": "stored blocks compared with their recomputation",
        "mismatched_blocks": "compared blocks that did not match (wrong KV a checksum passed)",
        "quarantines": "namespaces quarantined in a tier after a mismatch",
        "quarantined_lookups": "lookups that passed over a tier quarantined for the namespace",
    }
    yield from _counters_by_tier("cachetier_guard_", docs, guard)
    yield GaugeMetricFamily("cachetier_quarantines_held", "quarantines held now", value=held)


def admission_families(stats: dict[str, Any]) -> Iterator[Metric]:
    """The admission policy's decisions by tier (``TieredStore.stats()["admission"]``): what
    each lower tier wrote and what it was spared."""
    tiers = stats.get("admission", {}).get("tiers", {})
    docs = {
        "admitted": "blocks a lower tier's admission let it write",
        "refused": "blocks a lower tier's admission kept out",
        "bytes_admitted": "bytes of the admitted blocks",
        "bytes_refused": "bytes of the refused blocks: the writes saved",
    }
    by_name = {name: {tier: counts[name] for tier, counts in tiers.items()} for name in docs}
    yield from _counters_by_tier("cachetier_admission_", docs, by_name)


def live_curve_families(stats: dict[str, Any]) -> Iterator[Metric]:
    """What more capacity would buy (``TieredStore.stats()["live_curve"]``), and the admission
    policy's current choice per filtered tier (``stats()["admission"]["choices"]``).

    Args:
        stats: ``TieredStore.stats()``.
    """
    curve = GaugeMetricFamily(
        "cachetier_tier_hit_ratio_at_capacity",
        "Block hit ratio the lookups so far would have had in an LRU tier of capacity_factor "
        "times this tier's capacity (ghosts on a hashed sample of keys)",
        labels=["tier", "capacity_factor"],
    )
    for tier, figures in stats.get("live_curve", {}).items():
        for factor, value in figures["hit_ratio"].items():
            curve.add_metric([tier, factor], value)
    yield curve
    choice = GaugeMetricFamily(
        "cachetier_admission_choice",
        "1 for the fixed policy a filtered tier admits as now (adaptive: its current choice)",
        labels=["tier", "policy"],
    )
    for tier, chosen in stats.get("admission", {}).get("choices", {}).items():
        for policy in FIXED_POLICIES:
            choice.add_metric([tier, policy], float(policy == chosen))
    yield choice


def _counters_by_tier(
    prefix: str, docs: dict[str, str], counts: dict[str, dict[str, int]]
) -> Iterator[Metric]:
    """A counter family per name of ``docs``, one series per tier of ``counts[name]``."""
    for name, doc in docs.items():
        family = CounterMetricFamily(f"{prefix}{name}", doc, labels=["tier"])
        for tier, count in counts.get(name, {}).items():
            family.add_metric([tier], count)
        yield family


def pin_families(tiers: dict[str, dict[str, Any]]) -> Iterator[Metric]:
    """Each tier's pinned blocks and bytes, and the bound on those bytes (``Tier.pin_stats``)."""
    families = {
        "pinned_blocks": "pinned blocks a tier holds (never evicted)",
        "pinned_bytes": "bytes of the pinned blocks a tier holds",
        "max_pinned_bytes": "most bytes of pinned blocks a tier may hold",
    }
    for name, doc in families.items():
        family = GaugeMetricFamily(f"cachetier_tier_{name}", doc, labels=["tier"])
        for tier, figures in tiers.items():
            family.add_metric([tier], figures.get(name, 0))
        yield family


def store_health_families(stats: dict[str, Any]) -> Iterator[Metric]:
    """What an operator alerts on besides hit rates: blocks the write queues dropped or failed
    to write (``TieredStore.stats()``'s own ``rejected`` and ``errors``), and each breaker's
    state (tiers behind a network: ``remote``, ``redis``).

    Args:
        stats: ``TieredStore.stats()``.
    """
    dropped = CounterMetricFamily(
        "cachetier_write_queue_dropped_blocks",
        "Blocks not written to a lower tier because its write queue was full",
    )
    dropped.add_metric([], stats.get("rejected", 0))
    yield dropped
    failed = CounterMetricFamily(
        "cachetier_write_queue_failed_blocks",
        "Blocks a background writer failed to write to a lower tier",
    )
    failed.add_metric([], stats.get("errors", 0))
    yield failed
    state = GaugeMetricFamily(
        "cachetier_tier_breaker_state",
        "1 for the state a tier's circuit breaker is in (closed, open, half_open), else 0",
        labels=["tier", "state"],
    )
    opens = CounterMetricFamily(
        "cachetier_tier_breaker_opens", "Times a tier's circuit breaker opened", labels=["tier"]
    )
    for tier, figures in stats["tiers"].items():
        breaker = figures.get("breaker")
        if breaker is None:
            continue  # a local tier (cpu, disk) has no service to break from
        for value in BreakerState:
            state.add_metric([tier, value.value], float(breaker["state"] == value.value))
        opens.add_metric([tier], breaker["num_opens"])
    yield state
    yield opens


def tier_rate_families(rates: dict[str, dict[str, Any]]) -> Iterator[Metric]:
    """The cost model's view of each tier (``TierRates.snapshot``): moving averages of its
    round-trip latency and read bandwidth, as measured on real lookups and gets."""
    latency = GaugeMetricFamily(
        "cachetier_tier_latency_seconds",
        "Moving average of one round trip to a tier (lookups)",
        labels=["tier"],
    )
    bandwidth = GaugeMetricFamily(
        "cachetier_tier_read_bytes_per_second",
        "Moving average of a tier's read bandwidth (real gets, round trips taken out)",
        labels=["tier"],
    )
    for tier, rate in rates.items():
        latency.add_metric([tier], rate["latency_ms"] / 1e3)
        if rate["read_gbps"] is not None:
            bandwidth.add_metric([tier], rate["read_gbps"] * 1e9)
    yield latency
    yield bandwidth


class _HttpConnectionCollector(Collector):
    def __init__(self, table: ConnectionTable, acceptors: list[HttpAcceptor]) -> None:
        self._table = table
        self._acceptors = acceptors

    def collect(self) -> Iterator[Metric]:
        table = self._table
        yield GaugeMetricFamily(
            "cachetier_http_connections", "HTTP connections open", value=table.num_open
        )
        yield GaugeMetricFamily(
            "cachetier_http_unauthenticated_connections",
            "HTTP connections open that have shown no valid token yet",
            value=table.num_unauthenticated,
        )
        shed = CounterMetricFamily(
            "cachetier_http_connections_shed",
            "HTTP connections the caps closed: connection_cap, unauthenticated_cap, "
            "tls_handshake_cap, unauthenticated_timeout, descriptors, tenant_share",
            labels=["reason"],
        )
        for reason, count in sorted(table.num_shed.items()):
            shed.add_metric([reason], count)
        yield shed
        yield CounterMetricFamily(
            "cachetier_http_connections_refused",
            "HTTP connections closed at their accept: every place held by a client with a token",
            value=table.num_refused,
        )
        yield from accept_families([(a.name, a.up, a.num_accept_errors) for a in self._acceptors])


def accept_families(listeners: list[tuple[str, bool, int]]) -> Iterator[Metric]:
    """``cachetier_listener_up`` and ``cachetier_accept_errors`` of each listener.

    Args:
        listeners: (name, accepting now, failed accepts so far) of each.
    """
    up = GaugeMetricFamily(
        "cachetier_listener_up",
        "1 while a listener accepts, 0 while it backs off after a failed accept",
        labels=["listener"],
    )
    errors = CounterMetricFamily(
        "cachetier_accept_errors",
        "accept() calls that failed (out of descriptors or memory, or any other error)",
        labels=["listener"],
    )
    for name, is_up, num_errors in listeners:
        up.add_metric([name], float(is_up))
        errors.add_metric([name], num_errors)
    yield up
    yield errors


class _TransferCollector(Collector):
    def __init__(self, transfer: TransferServer) -> None:
        self._transfer = transfer
        self._admission = transfer.admission

    def collect(self) -> Iterator[Metric]:
        yield from accept_families(self._transfer.listener_status())
        yield GaugeMetricFamily(
            "cachetier_transfer_unauthenticated_connections",
            "transfer connections before their hello",
            value=self._admission.num_unknown,
        )
        yield CounterMetricFamily(
            "cachetier_transfer_unauthenticated_dropped",
            "transfer connections dropped before their hello for a newer one (their budget "
            "was full)",
            value=self._admission.num_dropped,
        )


class RequestMetricsMiddleware:
    """Times every HTTP request into the ``ServerMetrics`` of the app's lifespan state.

    Plain ASGI (not ``BaseHTTPMiddleware``), so streamed answers pass through untouched.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        status = 500

        async def send_and_note(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_and_note)
        finally:
            metrics = scope.get("state", {}).get("metrics")
            if metrics is not None:
                # The route template, not the path: one series per endpoint, not per key.
                route = getattr(scope.get("route"), "path", "unmatched")
                metrics.observe(scope["method"], route, status, time.perf_counter() - start)
