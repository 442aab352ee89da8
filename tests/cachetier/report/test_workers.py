"""Curve replays split over forked helpers give what one process gives, even if a helper dies."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from cachetier.report.replay import ReplayTrace
from cachetier.report.sampled import SampledTrace, sample_trace
from cachetier.report.workers import CurveRunner, run_job
from tests.cachetier.report import tiny

JOBS = [(name, capacity) for name in ("lru", "arc", "belady") for capacity in (1, 2, 3, 4, 100)]


@pytest.fixture
def trace(tmp_path: Path) -> SampledTrace:
    return sample_trace(ReplayTrace.load(tiny.write_tiny_trace(tmp_path / "tiny.jsonl")), 1.0)


def _hits(results: list) -> list[tuple[str, int | None, float, float]]:
    return [(r.policy, r.capacity_blocks, r.num_hit_blocks, r.num_hit_tokens) for r in results]


@pytest.mark.parametrize("num_workers", [1, 2, 3])
def test_helpers_change_nothing_but_the_wall_time(trace: SampledTrace, num_workers: int) -> None:
    seen: list[tuple[str, int]] = []
    runner = CurveRunner(trace, JOBS, num_workers)
    assert len(runner.helper_pids) == num_workers - 1
    results = runner.run(seen.append)
    assert _hits(results) == _hits([run_job(trace, job) for job in JOBS])
    assert sorted(seen) == sorted(JOBS)  # each job reported once, wherever it ran


def test_a_dead_helper_s_jobs_are_run_here(trace: SampledTrace) -> None:
    runner = CurveRunner(trace, JOBS, 2)
    (pid,) = runner.helper_pids
    os.kill(pid, signal.SIGKILL)
    results = runner.run()
    assert _hits(results) == _hits([run_job(trace, job) for job in JOBS])


def _count_requests(trace: SampledTrace, job: tuple[str, int]) -> tuple[str, int, int]:
    return (*job, len(trace.trace.requests))


@pytest.mark.parametrize("num_workers", [1, 2])
def test_a_runner_of_its_own_runs_every_job_once(trace: SampledTrace, num_workers: int) -> None:
    runner = CurveRunner(trace, JOBS, num_workers, _count_requests)
    assert runner.run() == [(*job, len(tiny.REQUESTS)) for job in JOBS]
