"""benchmarks.guard's pieces at a tiny size: every forgery is caught within the default first
verified hit and no answer differs from a cold one, an honest restart verifying every hit
quarantines nothing, and the overhead rounds report their figures. No timing is checked."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from benchmarks.guard import DEFAULT_GUARD, expected_overhead, run
from benchmarks.support.guard_engine import engine_overhead, honest_restart
from benchmarks.support.guard_rounds import ARMS
from benchmarks.support.guard_vllm import SALTS, vllm_forgeries
from benchmarks.support.guard_vllm_records import FIRST_LAYER, vllm_record_cases

pytestmark = [
    pytest.mark.slow(reason="runs the guard benchmark's tiny-model engines and vLLM-CPU forgeries")
]

# Prompts of the tiny model's vocabulary (256 tokens), 3 to 6 full blocks of 16 each.
TINY_REQUESTS = [[(i * k + 3) % 250 for i in range(40 + 16 * k)] for k in (3, 5, 7)]


def _check_cases(cases: list[dict], engine: str) -> None:
    assert {c["forgery"] for c in cases} == set(SALTS)
    for case in cases:
        assert case["engine"] == engine
        assert case["detected"] and case["verified_requests_to_detect"] == 1, case
        assert case["outputs_differing_from_cold"] == 0, case
        # Verified first; the second restored the first's own computed records, which took
        # the forged ones' place.
        assert case["served_from_tiers"] == 1, case


def test_the_quick_run_catches_every_forgery_of_our_engine(tmp_path: Path) -> None:
    args = argparse.Namespace(
        quick=True, no_vllm=False, records_only=False, record_requests=4, work_dir=str(tmp_path)
    )
    result = run(args)
    # Every record checked against its tokens: a buggy writer among honest ones, and records
    # gone bad after the first check, never reach an answer; another writer keeps serving.
    assert result["mixed_folder_wrong_answers"] == result["after_check_wrong_answers"] == 0
    assert result["record_check_requests"] == 4
    assert result["deep_layer_forgery_wrong_answers_expected"] == pytest.approx(4 * 0.999)
    assert result["honest_restores_after_quarantine"] > 0
    assert result["forgeries"] == result["forgeries_detected"] == len(SALTS)
    assert result["outputs_after_quarantine_differ_from_cold"] == 0
    assert result["vllm_forgeries_not_run"] == list(SALTS)  # --quick: our engine only
    assert result["guard_defaults"] == DEFAULT_GUARD
    _check_cases(result["forgery_cases"], "ours")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_an_honest_restart_verifying_every_hit_quarantines_nothing(
    tiny_model_dir: Path, tmp_path: Path, dtype: str
) -> None:
    row = honest_restart(tiny_model_dir, tmp_path, dtype, TINY_REQUESTS)
    assert row["verified_requests"] == len(TINY_REQUESTS)
    assert row["verified_blocks"] == sum(len(r) // 16 for r in TINY_REQUESTS)
    assert row["false_quarantines"] == row["mismatched_blocks"] == 0


def test_the_overhead_rounds_report_every_arm(tiny_model_dir: Path, tmp_path: Path) -> None:
    out = engine_overhead(tiny_model_dir, tmp_path, TINY_REQUESTS, 2, DEFAULT_GUARD, 4)
    assert set(out["engine_batch_s"]) == set(ARMS)
    assert all(len(seconds) == 2 for seconds in out["engine_batch_s"].values())
    for figure in ("guard_overhead_engine", "guard_first_batch_overhead_engine"):
        low, high = out[f"{figure}_interval"]
        assert low <= out[figure] <= high
    assert out["engine_restored_tokens_per_batch"] > 0  # the batches' hits were restores


@pytest.mark.vllm
@pytest.mark.model
def test_every_forgery_is_caught_through_vllm(smollm2_dir: Path, tmp_path: Path) -> None:
    """Through the connector in real vLLM-CPU: each forged prompt's first hit is computed and
    compared, its namespace quarantined in the disk tier, its second request computed too, and
    both answers are the cold ones; the worker logs one verification and one mismatch each."""
    _check_cases(vllm_forgeries(smollm2_dir, tmp_path, DEFAULT_GUARD), "vllm")
    log = (tmp_path / "vllm-guarded.log").read_text(errors="replace")
    assert log.count("verifying") == len(SALTS), log[-4000:]
    mismatches = [line for line in log.splitlines() if "does not match a recomputation" in line]
    assert len(mismatches) == len(SALTS), log[-4000:]


@pytest.mark.vllm
@pytest.mark.model
def test_a_trusted_writers_forged_records_never_answer_through_vllm(
    smollm2_dir: Path, tmp_path: Path
) -> None:
    """Through the connector in real vLLM-CPU, the guard at its defaults: a writer verified on
    an honest first hit, then its records of other prompts forged (each first-layer forgery
    once) before the process starts and after its first request. Every answer is the cold
    one; the first forged record is refused by the record check and its writer quarantined."""
    out = vllm_record_cases(smollm2_dir, tmp_path, DEFAULT_GUARD, len(FIRST_LAYER), deep=False)
    assert out["vllm_mixed_folder_wrong_answers"] == 0
    assert out["vllm_after_check_wrong_answers"] == 0
    assert "vllm_deep_layer_forgery_wrong_answers_measured" not in out
    log = (tmp_path / "vllm-records-mixed-after.log").read_text(errors="replace")
    assert "is not the KV of its tokens" in log, log[-4000:]
    assert "verifying" in log, log[-4000:]  # the first hit's new writer, in full


def test_the_expected_overhead_scales_the_first_batch_by_the_draws() -> None:
    figures = {
        "guard_first_batch_overhead_engine": 0.2,
        "guard_first_batch_overhead_engine_interval": [0.1, 0.3],
    }
    out = expected_overhead(figures, 16)
    # 16 requests drawn at 0.1% each, a drawn one costing what the first batch's did
    assert out["guard_overhead_expected_engine"] == pytest.approx(16 * 0.001 * 0.2)
    assert out["guard_overhead_expected_engine_interval"] == pytest.approx([0.0016, 0.0048])
    assert out["guard_overhead_expected"] == out["guard_overhead_expected_engine"]
