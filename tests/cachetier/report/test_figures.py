"""Figures as plain dicts: hand-made lookups with known answers, and the hand-made trace."""

from __future__ import annotations

from pathlib import Path

import pytest

from cachetier.report.config import ReportConfig, log_capacities
from cachetier.report.curve import add_trace_figures
from cachetier.report.events import LookupEvent
from cachetier.report.figures import lookup_figures, pick_bin_s
from cachetier.report.hierarchy_replay import replay_for_report
from cachetier.report.replay import ReplayTrace
from tests.cachetier.report import tiny

EVENTS = [
    LookupEvent(100.0, "a", 1000, {"pool": 200, "cpu": 300}, 16, 10, 0.5),
    LookupEvent(130.0, "b", 500, {"disk": 100}, 16, 0, 1.0),
    LookupEvent(170.0, "a", 100, {}, 16, 0, 0.0),
]


def _figures(**kwargs: object) -> dict:
    args: dict = dict(prefill_tokens_per_s=100.0, prefill_source="a test", bin_s=60.0)
    args.update(kwargs)
    return lookup_figures(EVENTS, **args)


def test_hit_rate_over_time_bins_from_the_first_lookup() -> None:
    fig = _figures()["hit_rate_over_time"]
    assert fig["bin_start_s"] == [0.0, 60.0] and fig["t0_s"] == 100.0
    assert fig["num_lookups"] == [2, 1] and fig["num_tokens"] == [1500, 100]
    assert fig["token_hit_ratio"] == pytest.approx([600 / 1500, 0.0])
    by_source = fig["token_hit_ratio_by_source"]
    assert list(by_source) == ["pool", "cpu", "disk"]  # sources with no hits are left out
    assert by_source["pool"] == pytest.approx([200 / 1500, 0.0])
    assert by_source["disk"] == pytest.approx([100 / 1500, 0.0])


def test_per_tier_per_tenant_saved_and_alignment() -> None:
    figs = _figures()
    tier = figs["per_tier"]
    assert tier["sources"] == ["pool", "cpu", "disk"]
    assert tier["hit_tokens"] == [200, 300, 100]
    assert tier["share_of_prompt_tokens"] == pytest.approx([200 / 1600, 300 / 1600, 100 / 1600])

    tenant = figs["per_tenant"]
    assert tenant["tenants"] == ["a", "b"]  # most prompt tokens first
    assert tenant["num_lookups"] == [2, 1]
    assert tenant["num_tokens"] == [1100, 500] and tenant["hit_tokens"] == [500, 100]
    assert tenant["token_hit_ratio"] == pytest.approx([500 / 1100, 0.2])
    assert tenant["alignment_lost_tokens"] == [10, 0]
    assert tenant["net_saved_s"] == pytest.approx([5.0 - 0.5, 1.0 - 1.0])

    saved = figs["saved"]
    assert saved["hit_tokens"] == 600
    assert saved["saved_s"] == pytest.approx(6.0)
    assert saved["restore_s"] == pytest.approx(1.5)
    assert saved["net_saved_s"] == pytest.approx(4.5)
    assert saved["cumulative_net_saved_s"] == pytest.approx([4.5, 4.5])
    assert saved["cumulative_hit_tokens"] == [600, 600]
    assert "/ 100.0 prefill tokens per second" in saved["how"] and "a test" in saved["how"]

    lost = figs["alignment"]
    assert lost["alignment_lost_tokens"] == 10 and lost["num_lookups_with_loss"] == 1
    assert lost["share_of_matched_tokens"] == pytest.approx(10 / 610)
    assert lost["breakdown"]["cache"] == {
        "hit_pool": 200,
        "hit_cpu": 300,
        "hit_disk": 100,
        "alignment_lost": 10,
        "prefilled": 1600 - 600 - 10,
    }


def test_every_figure_says_how_it_is_computed() -> None:
    for name, fig in _figures().items():
        assert fig["title"] and len(fig["how"]) > 80, name


def test_bins_are_round_and_at_most_sixty() -> None:
    assert pick_bin_s(5.0) == 1.0
    assert pick_bin_s(3537.0) == 60.0
    assert pick_bin_s(4 * 3600.0) == 300.0
    assert _figures(bin_s=None)["hit_rate_over_time"]["bin_s"] == 2.0  # 70 s of lookups


def test_no_lookups_is_an_error() -> None:
    with pytest.raises(ValueError, match="no lookups"):
        lookup_figures([], prefill_tokens_per_s=1.0, prefill_source="")


def test_log_capacities() -> None:
    assert log_capacities() == (1000, 1900, 3700, 7200, 14000, 27000, 52000, 100000)
    assert log_capacities(10, 10, 3) == (10,)


def test_trace_figures_on_the_hand_made_trace(tmp_path: Path) -> None:
    trace = ReplayTrace.load(tiny.write_tiny_trace(tmp_path / "tiny.jsonl"))
    config = ReportConfig(
        trace="tiny.jsonl",
        cpu_blocks=tiny.CPU_BLOCKS,
        disk_blocks=tiny.DISK_BLOCKS,
        capacities=(1, 100),
        curve_policies=("lru",),
        quiet=True,
    )
    replays = replay_for_report(trace, config)
    figs = lookup_figures(
        replays.events, prefill_tokens_per_s=512.0, prefill_source="test", bin_s=2.0
    )
    add_trace_figures(figs, trace, replays, config, "lru")

    tier = figs["per_tier"]
    assert dict(zip(tier["sources"], tier["hit_tokens"])) == {"cpu": 3072, "disk": 1024}
    assert tier["block_hit_ratio"] == pytest.approx(11 / 17)
    assert tier["tier_capacity_blocks"] == {"cpu": 3, "disk": 100}

    over = figs["hit_rate_over_time"]  # bins [0,2) [2,4) [4,6) seconds
    assert over["num_tokens"] == [2200, 2112, 3072]
    assert over["token_hit_ratio"] == pytest.approx([1024 / 2200, 1024 / 2112, 2048 / 3072])
    assert over["block_hit_ratio"] == pytest.approx([3 / 6, 2 / 5, 6 / 6])
    assert over["ceiling_block_hit_ratio"] == pytest.approx([3 / 6, 2 / 5, 6 / 6])

    assert figs["saved"]["saved_s"] == pytest.approx(4096 / 512)
    lost = figs["alignment"]
    assert lost["alignment_lost_tokens"] == 76 + 2 * 512
    assert lost["breakdown"]["infinite cache"] == {
        "hit": 4096,
        "alignment_lost": 76 + 2 * 512,
        "prefilled": tiny.NUM_TOKENS - 4096 - 76 - 2 * 512,
    }

    curve = figs["capacity_curve"]
    assert curve["capacities"] == [1, 3, 100]
    assert curve["series"]["lru"][0] == 0.0  # one block: every request evicts its own prefix
    assert curve["series"]["lru"][2] == pytest.approx(11 / 17)
    assert curve["ceiling"] == pytest.approx(11 / 17)
    assert curve["token_series"]["lru"][2] == pytest.approx(4096 / tiny.NUM_TOKENS)
    assert curve["default_ge_lru_at_every_capacity"] is True
    assert "LRU itself" in curve["how"]


def test_load_or_recompute_counts_the_cost_models_choices() -> None:
    events = [
        *EVENTS,
        LookupEvent(
            180.0, "b", 900, {"remote": 160}, 16, 0, 0.2, recomputed_tokens=640, est_saved_s=0.0
        ),
        LookupEvent(190.0, "a", 900, {"disk": 800}, 16, 0, 0.1, est_saved_s=2.5),
    ]
    fig = lookup_figures(events, prefill_tokens_per_s=100.0, prefill_source="a test")[
        "load_or_recompute"
    ]
    # Loaded: every tier source (the pool's own hits are not a load).
    assert fig["loaded_tokens"] == 300 + 100 + 160 + 800
    assert fig["recomputed_by_choice_tokens"] == 640
    assert fig["num_lookups_with_recompute"] == 1
    assert fig["est_saved_s"] == pytest.approx(2.5)


def test_why_missed_sums_each_cause_and_says_what_old_logs_leave_unexplained() -> None:
    events = [
        LookupEvent(1.0, "a", 100, {"pool": 32}, miss_tokens={"evicted": 64, "partial_block": 4}),
        LookupEvent(2.0, "a", 100, {}, verified_tokens=96, miss_tokens={"partial_block": 4}),
        LookupEvent(3.0, "b", 50, {"disk": 16}),  # a log line from before causes were recorded
    ]
    fig = lookup_figures(events, prefill_tokens_per_s=100.0, prefill_source="a test")["why_missed"]
    by_cause = dict(zip(fig["causes"], fig["miss_tokens"]))
    assert by_cause["evicted"] == 64 and by_cause["partial_block"] == 8
    assert sum(by_cause.values()) == 72 and fig["verified_tokens"] == 96
    assert fig["unexplained_tokens"] == 250 - 48 - 72 - 96
    assert fig["share_of_misses"][fig["causes"].index("evicted")] == pytest.approx(64 / 202)
