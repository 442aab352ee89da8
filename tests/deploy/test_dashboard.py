"""The Grafana dashboard: well formed, provisioned by compose, and every query of it and of
docs/operations.md returns data from a real Prometheus scraping a live sidecar and engine
server."""

from __future__ import annotations

import copy
import json
from collections.abc import Iterator

import pytest
import yaml

from tests.deploy.dashboard_stack import LiveStack, check_queries, running_stack
from tests.deploy.local_stack import ROOT, load_compose
from tests.deploy.promql import (
    DATASOURCE_UID,
    PROMQL_DOC,
    check_dashboard,
    dashboard_queries,
    doc_queries,
    load_dashboards,
    prometheus_binary,
    substitute,
)

GRAFANA = ROOT / "deploy" / "grafana"


@pytest.fixture(scope="module")
def dashboards() -> dict[str, dict]:
    found = load_dashboards()
    assert found, "no dashboard JSON in deploy/grafana/dashboards"
    return found


def test_every_dashboard_is_well_formed(dashboards: dict[str, dict]) -> None:
    for name, dashboard in dashboards.items():
        assert check_dashboard(dashboard) == [], name
        assert len(dashboard_queries(dashboard)) >= 10, name


def test_a_broken_dashboard_is_reported(dashboards: dict[str, dict]) -> None:
    broken = copy.deepcopy(next(iter(dashboards.values())))
    panels = broken["panels"]
    panels[1]["id"] = panels[0]["id"]
    del panels[2]["datasource"]
    panels[3]["targets"][0]["expr"] = " "
    panels[4]["targets"] = []
    problems = "\n".join(check_dashboard(broken))
    assert "unique" in problems
    assert "does not use the datasource" in problems
    assert "has no expr" in problems
    assert "has no targets" in problems


def test_the_panels_cover_what_an_operator_watches(dashboards: dict[str, dict]) -> None:
    exprs = " ".join(q.expr for d in dashboards.values() for q in dashboard_queries(d))
    for metric in (
        "cachetier_tier_hits_total",  # hit rate per tier
        "cachetier_tenant_hits_total",  # per tenant
        "cachetier_engine_time_to_first_token_seconds_bucket",  # TTFT
        "cachetier_engine_restored_bytes_total",  # restore bandwidth
        "cachetier_write_queue_dropped_blocks_total",  # queue drops
        "cachetier_tier_evictions_total",
        "cachetier_tier_errors_total",
        "cachetier_tier_breaker_state",
        "cachetier_load_plans_total",  # the cost model's choices
        "cachetier_recomputed_by_choice_tokens_total",
        "cachetier_tier_hit_ratio_at_capacity",  # what more capacity would buy
        "cachetier_admission_choice",
    ):
        assert metric in exprs, metric


def test_compose_provisions_grafana_with_the_dashboard() -> None:
    grafana = load_compose()["services"]["grafana"]
    assert grafana["image"].startswith("grafana/grafana:") and ":latest" not in grafana["image"]
    assert grafana["ports"] == ["127.0.0.1:3000:3000"]
    assert "prometheus" in grafana["depends_on"]
    mounts = {v.split(":")[0]: v.split(":")[1:] for v in grafana["volumes"]}
    assert mounts["./deploy/grafana/provisioning"] == ["/etc/grafana/provisioning", "ro"]
    dashboards_mount = mounts["./deploy/grafana/dashboards"]
    assert dashboards_mount[1] == "ro"
    datasources = yaml.safe_load((GRAFANA / "provisioning/datasources/prometheus.yml").read_text())
    (source,) = datasources["datasources"]
    assert source["uid"] == DATASOURCE_UID and source["type"] == "prometheus"
    assert source["url"] == "http://prometheus:9090"  # the compose service, on its port
    providers = yaml.safe_load((GRAFANA / "provisioning/dashboards/cachetier.yml").read_text())
    (provider,) = providers["providers"]
    assert provider["options"]["path"] == dashboards_mount[0]


def test_readme_queries_come_from_promql_blocks_and_inline_code() -> None:
    text = "\n".join(
        [
            "Intro `cachetier_tier_hits_total` (a name, not a query), and inline:",
            "`sum(rate(cachetier_tier_hits_total[5m]))`",
            "```promql",
            "# hit rate",
            "sum(rate(cachetier_tenant_hits_total[5m]))",
            "  / sum(rate(cachetier_tenant_misses_total[5m]))",
            "",
            "cachetier_tier_used_bytes",
            "```",
            "```bash",
            "curl `echo cachetier_x(1)`",
            "```",
        ]
    )
    found = doc_queries(text)
    assert [q.expr for q in found] == [
        "sum(rate(cachetier_tenant_hits_total[5m])) / sum(rate(cachetier_tenant_misses_total[5m]))",
        "cachetier_tier_used_bytes",
        "sum(rate(cachetier_tier_hits_total[5m]))",
    ]
    where = "docs/operations.md"
    assert [q.where for q in found] == [f"{where}:5", f"{where}:8", f"{where}:2"]
    assert doc_queries(PROMQL_DOC.read_text()), "docs/operations.md has no PromQL to check"


def test_grafana_variables_are_replaced_and_unknown_ones_refused() -> None:
    expr = 'rate(x{tenant=~"$tenant"}[$__rate_interval]) + y{t="${tenant}"}'
    values = {"tenant": "engine", "__rate_interval": "5m"}
    assert substitute(expr, values) == 'rate(x{tenant=~"engine"}[5m]) + y{t="engine"}'
    with pytest.raises(KeyError, match=r"\$tenant"):
        substitute(expr, {"__rate_interval": "5m"})


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveStack]:
    with running_stack(tmp_path_factory.mktemp("dashboard-stack")) as stack:
        yield stack


@pytest.mark.slow(
    reason="starts Redis, the sidecar, an engine and Prometheus and waits for scrapes"
)
def test_every_dashboard_and_readme_query_returns_data(
    live: LiveStack, dashboards: dict[str, dict]
) -> None:
    assert live.load["load_requests_ok"] == live.load["load_requests"], live.load
    report = check_queries(live.prometheus, dashboards, PROMQL_DOC.read_text(), live.load)
    assert report.failures() == []
    assert report.dashboard_answers and report.readme_answers
    # The load did what the panels show: restores from the tiers, evictions, a tier error.
    values = {a.query.where: a.values for a in report.dashboard_answers}
    restore = next(v for w, v in values.items() if "Restore bandwidth" in w and w.endswith("A"))
    assert restore[0] > 0
    evictions = next(v for w, v in values.items() if "Evictions" in w and w.endswith("A"))
    assert max(evictions) > 0
    errors = next(v for w, v in values.items() if "Errors" in w and w.endswith("A"))
    assert max(errors) > 0
    # The live curve: every factor of every tier of known capacity, of both jobs, a ratio,
    # and never less at a larger capacity (LRU's stack property, on the same sample).
    curve = next(a for a in report.dashboard_answers if "What more capacity" in a.query.where)
    assert curve.num_series == 4 * 3, curve  # sidecar cpu and disk, engine cpu; 4 factors
    assert all(0 <= v <= 1 for v in curve.values), curve
    ratios = live.prometheus.api("/api/v1/query", query="cachetier_tier_hit_ratio_at_capacity")
    ratios = ratios["result"]
    by_tier: dict[tuple[str, str], dict[str, float]] = {}
    for series in ratios:
        labels = series["metric"]
        by_tier.setdefault((labels["job"], labels["tier"]), {})[labels["capacity_factor"]] = float(
            series["value"][1]
        )
    assert set(by_tier) == {
        ("cachetier-sidecar", "cpu"),
        ("cachetier-sidecar", "disk"),
        ("cachetier-engine", "cpu"),
    }, by_tier
    for points in by_tier.values():
        assert list(points) and sorted(points, key=float) == ["0.5", "1", "2", "4"], points
        line = [points[f] for f in ("0.5", "1", "2", "4")]
        assert line == sorted(line), points
    assert max(max(p.values()) for p in by_tier.values()) > 0, by_tier  # the load's repeats
    choice = next(a for a in report.dashboard_answers if "Admission: what" in a.query.where)
    assert choice.has_data and set(choice.values) == {1.0}, choice


@pytest.mark.slow(
    reason="starts Redis, the sidecar, an engine and Prometheus and waits for scrapes"
)
def test_a_misspelt_metric_or_variable_fails_the_check(
    live: LiveStack, dashboards: dict[str, dict]
) -> None:
    name, dashboard = next(iter(dashboards.items()))
    broken = json.loads(
        json.dumps(dashboard).replace("cachetier_tier_evictions_total", "cachetier_tier_evictons")
    )
    report = check_queries(live.prometheus, {name: broken}, "`sum(rate(cachetier_tier_hit[5m]))`")
    failures = report.failures()
    assert any("cachetier_tier_evictons" in f and "0 series" in f for f in failures), failures
    assert any("cachetier_tier_hit[" in f for f in failures), failures
    # A panel whose variable the dashboard does not define fails too.
    broken = copy.deepcopy(dashboard)
    broken["panels"][0]["targets"][0]["expr"] += " + on() vector($nosuch)"
    failures = check_queries(live.prometheus, {name: broken}, "").failures()
    assert any("$nosuch" in f for f in failures), failures


def test_a_missing_prometheus_names_the_package(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", "")
    with pytest.raises(FileNotFoundError, match="Debian's `prometheus` package"):
        prometheus_binary()
