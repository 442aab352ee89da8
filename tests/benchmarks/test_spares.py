"""benchmarks.spares on a tiny scale: both full tiers take every put and are timed."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.spares import full_tier_puts


def test_both_full_tiers_take_every_put_and_are_timed(tmp_path: Path) -> None:
    got = full_tier_puts("small", 2, 2, fsync=False, repeats=3, work=str(tmp_path))
    assert got["new_files_ms"] > 0 and got["spares_ms"] > 0
    assert got["speedup"] == pytest.approx(got["new_files_ms"] / got["spares_ms"])
    assert list(tmp_path.iterdir()) == []  # its folders are gone
