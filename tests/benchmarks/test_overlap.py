"""benchmarks.overlap on a tiny model: a pool hit, every block read, and both at once."""

from __future__ import annotations

import argparse
from pathlib import Path

from benchmarks.overlap import measure


def test_a_tiny_run_times_a_pool_hit_the_reads_and_both(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    args = argparse.Namespace(tokens=100, rounds=2, device="cpu", model=str(tiny_model_dir))
    result = measure(args, str(tmp_path))
    assert result["prompt_tokens"] == 115
    num_blocks = 115 // 16  # the engine's default block size; only full blocks are stored
    assert result["restored_bytes"] > 0 and result["restored_bytes"] % num_blocks == 0
    for name in ("forward_s", "reads_s", "together_s"):
        assert len(result["runs_s"][name]) == 2
        assert result[name] > 0
    assert isinstance(result["overlap_saved_fraction"], float)
