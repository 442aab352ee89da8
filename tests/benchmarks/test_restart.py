"""benchmarks.restart's bookkeeping: which run stands for a mode, and the refault count."""

from __future__ import annotations

import pytest

from benchmarks.restart import median_run, refaulted_file_pages


def _runs(*ttfts: float) -> list[dict]:
    return [{"ttft_s": t, "tag": i} for i, t in enumerate(ttfts)]


def test_the_median_run_is_returned_whole() -> None:
    runs = _runs(0.185, 0.123, 0.098)
    assert median_run(runs) == {"ttft_s": 0.123, "tag": 1}  # its parts belong to one process
    assert median_run(_runs(5.9, 0.5, 0.48)) == {"ttft_s": 0.5, "tag": 1}  # an outlier is dropped


def test_an_even_count_takes_the_lower_middle_run_and_one_run_is_itself() -> None:
    assert median_run(_runs(4.0, 1.0, 3.0, 2.0))["ttft_s"] == 2.0
    assert median_run(_runs(7.0))["ttft_s"] == 7.0
    with pytest.raises(IndexError):
        median_run([])


def test_refaulted_file_pages_reads_the_kernels_counter() -> None:
    with open("/proc/vmstat") as f:  # the tests run on Linux, where the kernel keeps it
        kept = dict(line.split() for line in f)
    first = refaulted_file_pages()
    assert first >= int(kept["workingset_refault_file"])
    with open(__file__, "rb") as f:
        f.read()
    assert refaulted_file_pages() >= first
