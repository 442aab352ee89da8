"""benchmarks.steps on a tiny model: single forwards timed by shape, the warm-up fit, SDPA forms."""

from __future__ import annotations

import argparse
from pathlib import Path

from benchmarks.steps import attention_ms, measure


def test_a_tiny_run_times_each_shape_and_prices_it_from_the_warm_up(tiny_model_dir: Path) -> None:
    args = argparse.Namespace(
        device="cpu",
        model=str(tiny_model_dir),
        repeats=2,
        shapes=["17@0", "40@24", "3@60"],
        attention=False,
    )
    result = measure(args)
    assert set(result["forward_ms"]) == {"17@0", "40@24", "3@60"}
    assert all(ms > 0 for ms in result["forward_ms"].values())
    # The engine's warm-up fits its prefill model before any request: its estimates are there.
    assert len(result["warm_up_fit"]) == 3
    assert set(result["predicted_ms"]) == set(result["forward_ms"])
    assert result["attention_ms"] is None


def test_the_bottom_right_bias_gives_the_masked_outputs() -> None:
    got = attention_ms("cpu", 1, ((24, 40), (7, 7)))
    assert set(got) == {
        "mask_24@40",
        "lower_right_24@40",
        "max_diff_24@40",
        "mask_7@7",
        "lower_right_7@7",
        "max_diff_7@7",
    }
    assert got["max_diff_24@40"] < 1e-5 and got["max_diff_7@7"] < 1e-5
