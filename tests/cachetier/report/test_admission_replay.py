"""Admission replays: store-all is the two-tier replay itself, second_hit's hits and writes on
the hand-made trace worked out by hand, the policy's memory scaled to tokens, and the
report's sweep and figure."""

from __future__ import annotations

from pathlib import Path

import pytest

from cachetier.admission import AdmissionConfig
from cachetier.report.admission_figure import admission_figure
from cachetier.report.admission_replay import (
    AdmissionReplay,
    replay_admission,
    replay_tracked_keys,
)
from cachetier.report.config import ReportConfig
from cachetier.report.hierarchy_replay import (
    ADMISSION_JOB,
    admission_capacities,
    replay_for_report,
    replay_hierarchy,
    run_report_job,
)
from cachetier.report.replay import ReplayTrace
from cachetier.report.sampled import sample_trace
from tests.cachetier.report import tiny
from tests.support import CONVERSATION_TRACE as CONVERSATION


@pytest.fixture
def tiny_trace(tmp_path: Path) -> ReplayTrace:
    return ReplayTrace.load(tiny.write_tiny_trace(tmp_path / "tiny.jsonl"))


def _replay(trace: ReplayTrace, name: str, **settings: object) -> AdmissionReplay:
    admission = AdmissionConfig(admission_policy=name, **settings)  # type: ignore[arg-type]
    return replay_admission(
        trace, admission, cpu_blocks=tiny.CPU_BLOCKS, disk_blocks=tiny.DISK_BLOCKS
    )


def test_store_all_is_the_two_tier_replay(tiny_trace: ReplayTrace) -> None:
    result = _replay(tiny_trace, "all")
    assert result.num_hit_blocks == sum(tiny.HIT_BLOCKS)
    assert result.num_blocks == tiny.NUM_BLOCKS
    assert result.num_hit_tokens == sum(sum(h.values()) for h in tiny.HIT_TOKENS)
    assert result.hit_blocks == {"cpu": 7, "disk": 4}
    # The CPU tier stores 1 2 3, 4 5, 6, 1 2 again (evicted), 4 5 again; the disk each once.
    assert result.blocks_written == {"cpu": 10, "disk": 6}
    assert result.admission_stats == {
        "admitted": 6,
        "refused": 0,
        "bytes_admitted": 6,
        "bytes_refused": 0,
    }
    assert result.memory_bytes == 0


def test_second_hit_on_the_hand_made_trace(tiny_trace: ReplayTrace) -> None:
    # 0: 1 2 3 seen once: the disk refuses them.    1: seen again: written (3).
    # 2: 1 2 held; 4 5 refused.                      3: 6 refused.
    # 4: 1 2 hit on disk (the CPU holds 4 5 6).      5: 1 2 hit in the CPU; 4 5 are in
    #    neither tier (store-all hit them on disk), seen again now: written (5 in all).
    result = _replay(tiny_trace, "second_hit")
    assert result.num_hit_blocks == 0 + 3 + 2 + 0 + 2 + 2
    assert result.hit_blocks == {"cpu": 7, "disk": 2}
    assert result.blocks_written == {"cpu": 10, "disk": 5}
    assert result.admission_stats == {
        "admitted": 5,
        "refused": 6,
        "bytes_admitted": 5,
        "bytes_refused": 6,
    }
    assert result.memory_bytes > 0


def test_the_policy_remembers_as_many_tokens_as_its_records_hold() -> None:
    assert replay_tracked_keys(AdmissionConfig(admission_tracked_keys=1_000_000), 512) == 31_250
    assert replay_tracked_keys(AdmissionConfig(admission_tracked_keys=64), 512, 16) == 2
    assert replay_tracked_keys(AdmissionConfig(admission_tracked_keys=1), 512) == 1


def _config(**overrides: object) -> ReportConfig:
    values: dict[str, object] = dict(
        trace="tiny.jsonl",
        cpu_blocks=tiny.CPU_BLOCKS,
        disk_blocks=tiny.DISK_BLOCKS,
        capacities=(1, 2),
        curve_policies=("lru",),
        num_workers=2,
        quiet=True,
    )
    values.update(overrides)
    return ReportConfig(**values)  # type: ignore[arg-type]


def test_the_report_replays_each_policy_at_each_disk_capacity(tiny_trace: ReplayTrace) -> None:
    config = _config(admission_policies=("tinylfu", "second_hit"))
    assert admission_capacities(config) == (3, 100)  # the curve's, from the CPU tier's up
    replays = replay_for_report(tiny_trace, config)
    assert list(replays.admission) == ["all", "tinylfu", "second_hit"]  # the baseline first
    assert replays.admission_capacities == (3, 100)
    for name, results in replays.admission.items():
        assert [r.disk_blocks for r in results] == [3, 100]
        assert {r.admission for r in results} == {name}
        whole = sample_trace(tiny_trace, 1.0)
        direct = run_report_job(whole, (ADMISSION_JOB + name, 100), config=config)
        assert results[1].num_hit_blocks == direct.num_hit_blocks
    assert replays.admission["all"][1].num_hit_blocks == sum(tiny.HIT_BLOCKS)

    fig = admission_figure(replays.admission, replays.admission_capacities, 3, "lru")
    assert fig["capacities"] == [3, 100]
    assert fig["disk_written_vs_all"]["all"] == [1.0, 1.0]
    assert fig["hit_rate_delta_vs_all"]["all"] == [0.0, 0.0]
    assert fig["disk_written_vs_all"]["second_hit"][1] == pytest.approx(5 / 6)
    assert fig["hit_rate_delta_vs_all"]["second_hit"][1] == pytest.approx((9 - 11) / 17)
    assert fig["blocks_written"]["second_hit"]["disk"][1] == 5


def test_no_admission_policies_no_admission_replays(tiny_trace: ReplayTrace) -> None:
    replays = replay_for_report(tiny_trace, _config(admission_policies=(), num_workers=1))
    assert replays.admission == {} and replays.admission_capacities == ()


def test_an_unknown_admission_policy_is_refused() -> None:
    with pytest.raises(ValueError, match="admission policy 'lfu' is not one of"):
        _config(admission_policies=("lfu",))


@pytest.mark.slow(reason="replays the whole conversation trace in the report and under store-all")
def test_store_all_is_the_report_s_replay_on_the_conversation_trace() -> None:
    trace = ReplayTrace.load(CONVERSATION)
    config = ReportConfig(trace=str(CONVERSATION), quiet=True)
    _, hits = replay_hierarchy(trace, config, ["t"] * len(trace.requests))
    result = replay_admission(
        trace,
        AdmissionConfig(admission_policy="all"),
        cpu_blocks=config.cpu_blocks,
        disk_blocks=config.disk_blocks,
    )
    assert result.num_hit_blocks == sum(hits)
