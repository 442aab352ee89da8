"""benchmarks.why_miss at a tiny size: its figures are there and the ledger's memory is what
its tables take (no timings are checked)."""

from __future__ import annotations

from pathlib import Path

from benchmarks.why_miss import measure


def test_a_tiny_run_reports_every_figure(tmp_path: Path) -> None:
    result = measure(tmp_path, tracked_keys=8192, rounds=3)
    assert result["ledger_bytes"] == 8192 * 12 + 8192 // 4
    assert result["lookup_keys"] == 128 and result["why_miss_overhead"] > 0
