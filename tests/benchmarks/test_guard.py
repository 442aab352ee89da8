"""benchmarks.guard at its quick size: every forgery of our engine is caught within the
default first verified hit, and no answer differs from a cold one (no timings are checked)."""

from __future__ import annotations

import argparse

import pytest

from benchmarks.guard import run

pytestmark = [pytest.mark.slow]


def test_the_quick_run_catches_every_forgery() -> None:
    args = argparse.Namespace(quick=True, no_vllm=True, pairs=1, num_requests=2)
    result = run(args)
    assert result["forgeries"] == result["forgeries_detected"] == 4
    assert result["outputs_after_quarantine_differ_from_cold"] == 0
    names = {c["forgery"] for c in result["engine_forgeries"]}
    assert names == {"k_and_v_swapped", "another_arrangement", "other_tokens", "another_model"}
    assert all(c["served_from_tiers"] == 0 for c in result["engine_forgeries"])
