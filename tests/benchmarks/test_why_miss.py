"""benchmarks.why_miss at a tiny size: every figure is in its JSON line, and the structures'
memory is what their tables take (no timings are checked)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.support.output import emit
from benchmarks.why_miss import measure


def test_a_tiny_run_reports_every_figure(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    emit(measure(tmp_path, tracked_keys=8192, rounds=3), as_json=True)
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["tracked_keys"] == 8192
    assert result["ledger_bytes"] == 8192 * 16 + 8192 // 4
    assert result["index_bytes"] == 8192 * 10 + 8192 // 4
    assert (result["ledger_bytes_per_key"], result["index_bytes_per_key"]) == (16.25, 10.25)
    assert 0 < result["ledger_entries"] <= 8192 and 0 < result["index_entries"] <= 8192
    assert (result["lookup_keys"], result["lookup_hits"], result["missed_keys"]) == (128, 64, 64)
    for name in (
        "why_miss_overhead",
        "why_miss_overhead_all_keys",
        "token_keys_overhead",
        "why_miss_overhead_restart",
        "why_miss_overhead_all_keys_restart",
        "lookup_median_s",
        "lookup_restart_median_s",
        "explain_first_median_s",
        "explain_all_median_s",
        "token_keys_median_s",
    ):
        assert result[name] > 0, name
