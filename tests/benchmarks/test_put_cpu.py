"""benchmarks.put_cpu: the CPU count it rests on, and the benchmark on a tiny scale beside
LMCache."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from benchmarks.support.timing import cpu_ns
from tests.children import run_peers


def test_cpu_ns_counts_the_cpu_this_process_spends() -> None:
    before_ns, before = cpu_ns(os.getpid()), time.process_time()
    while time.process_time() - before < 0.05:  # spin: CPU time, not a sleep
        pass
    spent_ns = cpu_ns(os.getpid()) - before_ns
    # The kernel's two counts of the same work: schedstat's nanoseconds and the ticks
    # process_time reads (its granularity is a tick: 10 ms at most).
    assert 0.04e9 <= spent_ns <= (time.process_time() - before + 0.02) * 1e9


def test_cpu_ns_of_a_process_that_is_gone_raises() -> None:
    with pytest.raises(FileNotFoundError):
        cpu_ns(2**22 + 1)  # above Linux's largest pid


@pytest.mark.lmcache
@pytest.mark.slow(reason="runs the put benchmark in the peers venv beside LMCache")
def test_every_side_is_timed_and_counted_beside_lmcache(tmp_path: Path) -> None:
    args = ("--shapes", "small", "--chunks", "2", "--repeats", "2", "--work", tmp_path, "--json")
    got = run_peers("benchmarks.put_cpu", *args)
    small = got["shapes"]["small"]
    assert small["cores"] == len(os.sched_getaffinity(0))
    for side in ("ours_put", "ours_put_memonly", "lmcache_put"):
        each = small[side]
        assert each["wall_ms"] > 0 and each["client_cpu_ms"] > 0 and each["server_cpu_ms"] > 0
        assert each["cpu_ms"] == pytest.approx(each["floor_ms"] * small["cores"])
    floor = small["lmcache_put"]["wall_ms"] / small["ours_put"]["floor_ms"]
    assert got["durable_floor_speedup_small"] == pytest.approx(floor, abs=1e-3)
    assert list(tmp_path.iterdir()) == []  # its folders are gone
