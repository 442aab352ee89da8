"""benchmarks.fleet_sim at its quick size: the JSON line has every policy's figures, and they
agree with each other and with the run they summarise (no timing is checked)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from benchmarks.fleet_sim import QUICK_REQUESTS, QUICK_SIZES
from cachetier.fleet import POLICIES

ROOT = Path(__file__).resolve().parents[2]
FIGURES = ("mean_ttft_s", "p50_ttft_s", "p99_ttft_s", "load_imbalance", "utilization")


@pytest.fixture(scope="module")
def result() -> dict[str, Any]:
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.fleet_sim", "--quick", "--json"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_the_json_line_names_the_run(result: dict[str, Any]) -> None:
    assert result["command"] == "python -m benchmarks.fleet_sim --json --quick"
    assert result["trace"] == "mooncake_conversation_trace.jsonl.gz"
    assert result["num_requests"] == QUICK_REQUESTS
    assert result["sizes"] == list(QUICK_SIZES) and list(result["fleets"]) == ["4"]
    assert result["policies"] == list(POLICIES) and result["baseline"] == "round_robin"
    rates = result["rates"]
    assert set(rates["tiers"]) == {"disk", "redis"} and rates["bytes_per_token"] > 0
    assert set(rates["sources"]) == {"prefill", "bytes_per_token", "disk", "redis"}
    settings = result["settings"]
    assert settings["block_bytes"] == rates["bytes_per_token"] * settings["block_size"]


def test_every_policy_has_its_figures_and_its_ratios(result: dict[str, Any]) -> None:
    fleet = result["fleets"]["4"]
    assert set(fleet["policies"]) == set(POLICIES) and fleet["time_scale"] > 0
    base = fleet["policies"]["round_robin"]
    for policy, f in fleet["policies"].items():
        assert all(f[name] > 0 for name in FIGURES), policy
        assert f["p50_ttft_s"] <= f["p99_ttft_s"]
        assert sum(f["requests_per_replica"]) == QUICK_REQUESTS
        assert f["load_imbalance"] == pytest.approx(
            max(f["requests_per_replica"]) / (QUICK_REQUESTS / 4)
        )
        assert 0 <= f["token_hit_ratio"] <= 1
        assert f["token_hit_ratio"] == pytest.approx(sum(f["token_hit_ratio_by_medium"].values()))
        # the simulated TTFT is the chosen replica's estimate: the queue model and the
        # router's view of it agree
        assert f["max_estimate_error_s"] < 1e-6
        for name in ("mean_ttft", "p50_ttft", "p99_ttft"):
            assert f[f"{name}_vs_round_robin"] == pytest.approx(f[f"{name}_s"] / base[f"{name}_s"])
    assert base["load_imbalance"] == 1.0  # 300 requests in turn over 4 replicas
    best = min(fleet["policies"], key=lambda p: fleet["policies"][p]["mean_ttft_s"])
    assert fleet["best_mean_ttft_policy"] == best


def test_the_headline_repeats_the_fleet_figures(result: dict[str, Any]) -> None:
    target = result["fleets"]["4"]["policies"]["tier_aware"]
    assert result["tier_aware_mean_ttft_vs_round_robin_4"] == target["mean_ttft_vs_round_robin"]
    assert result["tier_aware_load_imbalance_4"] == target["load_imbalance"]
    met = result["best_mean_ttft_policy_4"] == "tier_aware" and target["load_imbalance"] <= 1.3
    assert result["targets_met"] is met
