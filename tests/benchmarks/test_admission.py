"""benchmarks.admission at its quick size: every figure is in the JSON line and agrees with the
replays it summarises, and the RAG trace it makes has the shape its docstring states (no
timings are checked)."""

from __future__ import annotations

import json
from collections import Counter
from typing import Any

import pytest

from benchmarks.admission import BYTES_TARGET, HIT_DELTA_TARGET, measure
from benchmarks.support.admission_traces import RagShape, rag_requests
from benchmarks.support.output import emit
from cachetier.admission import ADMISSION_POLICIES
from cachetier.report.replay import BLOCK_SIZE, ReplayTrace


@pytest.fixture(scope="module")
def result(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return measure(tmp_path_factory.mktemp("admission"), quick=True)


@pytest.mark.slow(reason="runs the admission benchmark's replays of both traces on disk tiers")
def test_the_json_line_carries_every_figure(
    result: dict[str, Any], capsys: pytest.CaptureFixture
) -> None:
    emit(result, as_json=True)
    line = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert line["default_policy"] == "adaptive" and line["policies"] == list(ADMISSION_POLICIES)
    assert line["targets"] == {
        "disk_bytes_written_vs_store_all_max": BYTES_TARGET,
        "hit_rate_delta_vs_store_all_min": HIT_DELTA_TARGET,
    }
    assert set(line["traces"]) == set(line["replays"]) == {"conversation", "rag"}
    assert line["traces"]["rag"]["shape"]["num_requests"] == 150
    assert line["traces"]["conversation"]["source"].endswith(".jsonl.gz")
    # store-all is its own baseline: it writes every block, so it misses the bytes target
    store_all = line["best_filter"]["all"]
    assert store_all["disk_bytes_written_vs_store_all_max"] == 1.0
    assert store_all["hit_rate_delta_vs_store_all_min"] == 0.0
    adaptive = [row for t in line["traces"].values() for row in t["adaptive"]]
    assert [r["disk_blocks"] for r in adaptive] == 2 * line["disk_capacities"]
    assert line["adaptive_margin_min"] == min(r["adaptive_margin"] for r in adaptive)
    assert line["adaptive_targets"]["adaptive_margin_min"] == -0.005
    # The quick traces are small enough to be replayed whole: the sampled curve is the exact one.
    for about in line["traces"].values():
        assert about["sampled_curve"]["sample_rate"] == 1.0
    assert line["sampled_curve_max_abs_error"] == 0.0
    assert line["report_conversation_trace_s"] is None  # not timed with --quick
    met = [p for p, f in line["best_filter"].items() if f["meets_both_targets"]]
    assert line["targets_met_by"] == met and "all" not in met


@pytest.mark.slow(reason="runs the admission benchmark's replays of both traces on disk tiers")
@pytest.mark.parametrize("trace", ["conversation", "rag"])
def test_each_trace_has_a_row_per_policy_and_capacity(result: dict[str, Any], trace: str) -> None:
    rows = result["replays"][trace]
    capacities = result["disk_capacities"]
    assert [(r["policy"], r["disk_blocks"]) for r in rows] == [
        (p, c) for p in ADMISSION_POLICIES for c in capacities
    ]
    about = result["traces"][trace]
    assert about["writes_dropped"] == 0  # the replay waits for the disk: every write landed
    assert 0 < about["num_distinct_blocks"] <= about["num_block_refs"]
    for before, row in zip([None, *rows], rows):
        if row["replayed_at_disk_blocks"] != row["disk_blocks"]:  # a disk that never filled
            assert before is not None and before["disk_evictions"] == 0
            assert before["replayed_at_disk_blocks"] == row["replayed_at_disk_blocks"]
        assert 0 <= row["disk_hit_ratio"] <= row["block_hit_ratio"] <= 1
        assert row["disk_bytes_written"] > 0
        if row["policy"] == "all":
            assert row["disk_bytes_written_vs_store_all"] == 1.0
            assert row["hit_rate_delta_vs_store_all"] == 0.0 and row["disk_refused_blocks"] == 0
    for policy, summary in about["policies"].items():
        mine = [r for r in rows if r["policy"] == policy]
        worst_bytes = max(r["disk_bytes_written_vs_store_all"] for r in mine)
        worst_hits = min(r["hit_rate_delta_vs_store_all"] for r in mine)
        assert summary["disk_bytes_written_vs_store_all_max"] == pytest.approx(
            worst_bytes, abs=1e-4
        )
        assert summary["hit_rate_delta_vs_store_all_min"] == pytest.approx(worst_hits, abs=1e-5)
        assert summary["meets_both_targets"] == (
            summary["meets_bytes_target"] and summary["meets_hit_rate_target"]
        )


@pytest.mark.slow(reason="runs the admission benchmark's replays of both traces on disk tiers")
def test_the_filters_refuse_blocks_and_write_less_on_the_rag_trace(result: dict[str, Any]) -> None:
    rows = result["replays"]["rag"]
    for row in rows:
        # adaptive starts as store-all: the quick trace is too short for it to switch
        if row["policy"] in ("second_hit", "tinylfu"):
            assert row["disk_refused_blocks"] > 0
            assert row["disk_bytes_written_vs_store_all"] < 1.0


def test_the_rag_trace_is_a_shared_prompt_a_document_and_a_question_of_its_own() -> None:
    shape = RagShape(num_requests=300, num_documents=40, seed=3)
    requests = rag_requests(shape)
    assert requests == rag_requests(shape)  # seeded
    assert len(requests) == 300
    ReplayTrace.from_requests(requests)  # chained prefix ids: it keys as a Mooncake trace does
    uses = Counter(h for r in requests for h in r.hash_ids)
    system = tuple(range(shape.system_blocks))
    shortest = shape.system_blocks + shape.min_document_blocks + 1
    longest = shape.system_blocks + shape.max_document_blocks + shape.max_question_blocks
    for request in requests:
        ids = request.hash_ids
        assert ids[: shape.system_blocks] == system
        assert shortest <= len(ids) <= longest
        assert uses[ids[-1]] == 1  # the question is its own
        assert -(-request.input_length // BLOCK_SIZE) == len(ids)  # the last block partial
    # a popular document is retrieved by many requests, a tail one by few
    documents = Counter(r.hash_ids[shape.system_blocks] for r in requests)
    assert max(documents.values()) >= 10 * min(documents.values())
    assert [r.timestamp_ms for r in requests] == sorted(r.timestamp_ms for r in requests)
    with pytest.raises(ValueError, match="max_document_blocks"):
        RagShape(min_document_blocks=9, max_document_blocks=8)
