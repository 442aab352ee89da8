"""The traffic benchmark's pieces: the scaled window of the trace, the closed loop against a
real engine server, and the figures read from servers' answers, metrics and logs."""

from __future__ import annotations

import asyncio
import gzip
import json
from pathlib import Path

import pytest

from benchmarks.support import traffic_figures as figures
from benchmarks.support.fleet_live_client import Outcome, client_session, stream_completion
from benchmarks.support.traffic_drive import Answer, Endpoint, closed_loop
from benchmarks.support.traffic_trace import (
    TrafficRequest,
    ceiling_hit_rate,
    prompt_of,
    window,
    working_set_blocks,
    write_scaled_trace,
)
from cachetier.report.replay import TraceRequest, read_trace
from tests.engine.server.live import EngineServer, server_config

VOCAB = 49152


def trace(*rows: tuple[int, list[int]]) -> list[TraceRequest]:
    """Requests of (input_length, hash_ids), output 512 tokens each."""
    return [TraceRequest(i, n, 512, tuple(ids)) for i, (n, ids) in enumerate(rows)]


def test_an_id_is_the_same_tokens_everywhere_and_ids_differ() -> None:
    reqs = window(
        trace((1500, [0, 1, 2]), (2100, [0, 1, 2, 3, 4]), (600, [0, 9])),
        3,
        vocab_size=VOCAB,
        max_ids=8,
        tokens_per_id=32,
    )
    first, second, third = (r.prompt for r in reqs)
    assert first[:64] == second[:64]  # ids 0 and 1, full blocks in both
    assert first[:32] == third[:32] and first[32:64] != third[32:64]
    blocks = [second[i : i + 32] for i in range(0, 128, 32)]
    assert len(set(blocks)) == 4
    assert all(1000 <= t < VOCAB - 1000 for t in second)


def test_the_last_id_is_the_scaled_partial_block() -> None:
    # 1500 = 2 * 512 + 476: the last block holds 476/512 of a block, 30 of 32 tokens scaled.
    assert len(prompt_of(trace((1500, [0, 1, 2]))[0], VOCAB, 32)) == 64 + 30
    assert len(prompt_of(trace((1536, [0, 1, 2]))[0], VOCAB, 32)) == 96
    assert len(prompt_of(trace((1025, [0, 1, 2]))[0], VOCAB, 32)) == 65


def test_turns_follow_their_conversation_and_long_requests_are_left_out() -> None:
    rows = trace(
        (600, [0, 5]), (900, [0, 7]), (5000, [0, *range(100, 110)]), (1100, [0, 5, 6]), (300, [0])
    )
    reqs = window(rows, 4, vocab_size=VOCAB, max_ids=4)
    assert [r.hash_ids for r in reqs] == [(0, 5), (0, 7), (0, 5, 6), (0,)]
    assert [r.after for r in reqs] == [None, None, 0, None]
    assert [r.max_tokens for r in reqs] == [32] * 4  # 512 output tokens scaled by 32/512
    with pytest.raises(ValueError, match="sample has 4 requests of at most 4 hash ids; 5 were"):
        window(rows, 5, vocab_size=VOCAB, max_ids=4)


def test_a_sample_keeps_whole_conversations() -> None:
    rows = trace(
        *[
            (600 * (1 + t), [0, c, *range(1000 * c, 1000 * c + t)])
            for t in range(3)
            for c in range(1, 41)
        ]
    )
    reqs = window(rows, vocab_size=VOCAB, max_ids=8, sample_every=4)
    conversations = {r.conversation for r in reqs}
    assert 3 <= len(conversations) <= 25  # about 10 of 40
    assert len(reqs) == 3 * len(conversations)  # every turn of each one kept
    assert [r.index for r in reqs] == list(range(len(reqs)))
    assert window(rows, vocab_size=VOCAB, max_ids=8, sample_every=4) == reqs  # stable


def test_the_ceiling_counts_leading_seen_blocks_less_the_last_token_block() -> None:
    reqs = window(
        trace((1024, [0, 1]), (1024, [0, 1]), (2000, [0, 1, 2, 3])),
        3,
        vocab_size=VOCAB,
        max_ids=8,
    )
    # second: both ids seen, but its last block holds the token an engine computes (32 of 64);
    # third: ids 0 and 1 seen (64 of 32 * 3 + 29 tokens: 464 of 512 scaled).
    assert ceiling_hit_rate(reqs, 32) == pytest.approx((32 + 64) / (64 + 64 + 96 + 29))
    assert working_set_blocks(reqs) == 4


def test_the_scaled_trace_is_what_the_report_reads(tmp_path: Path) -> None:
    with gzip.open(Path("workloads/mooncake_conversation_trace.jsonl.gz"), "rt") as f:
        rows = [json.loads(next(f)) for _ in range(40)]
    source = [
        TraceRequest(r["timestamp"], r["input_length"], r["output_length"], tuple(r["hash_ids"]))
        for r in rows
    ]
    reqs = window(source, 10, vocab_size=VOCAB, max_ids=64)
    path = tmp_path / "window.jsonl"
    write_scaled_trace(reqs, path)
    back = read_trace(path, block_size=32)
    assert [r.hash_ids for r in back] == [r.hash_ids for r in reqs]
    assert [r.input_length for r in back] == [len(r.prompt) for r in reqs]


def test_the_closed_loop_keeps_order_turns_and_the_concurrency(tiny_model_dir: Path) -> None:
    server = EngineServer(server_config(tiny_model_dir)).start()
    try:
        prompts = [tuple(range(10 + i, 40 + i)) for i in range(6)]
        afters = [None, None, 0, None, 2, 1]
        reqs = [TrafficRequest(i, 0, afters[i], (i,), prompts[i], 3) for i in range(6)]
        answers, wall_s = asyncio.run(closed_loop(Endpoint(server.url, model="tiny"), reqs, 2))

        async def fleet_client() -> Outcome:  # the fleet benchmark reads streams the same way
            async with client_session() as session:
                return await stream_completion(session, server.url, prompts[0], 3)

        fleet = asyncio.run(fleet_client())
    finally:
        server.stop()
    assert [a.error for a in answers] == [None] * 6
    assert all(a.ttft_s is not None and len(a.token_ids) == 3 for a in answers)
    assert all(a.prompt_tokens == 30 for a in answers)
    assert [a.sent_s for a in answers] == sorted(a.sent_s for a in answers)
    for answer, after in zip(answers, afters):
        if after is not None:
            assert answer.sent_s >= answers[after].done_s
    for answer in answers:  # at most 2 in flight when each was sent
        in_flight = [a for a in answers if a.sent_s <= answer.sent_s < a.done_s]
        assert len(in_flight) <= 2
    assert 0 < wall_s
    assert fleet.error is None and fleet.ttft_s is not None and fleet.prompt_tokens == 30


def test_connector_log_lines_give_tokens_by_tier() -> None:
    log = "\n".join(
        [
            "INFO x cachetier: request cmpl-1-0 loaded 3/3 blocks (96 tokens) from {'disk': 2, "
            "'cpu': 1} in 4.0 ms",
            "INFO x cachetier: request cmpl-2-0 loaded 1/2 blocks (32 tokens) from {'cpu': 1} in "
            "1.0 ms; 1 failed, vLLM recomputes them",
            "INFO x cachetier: request cmpl-3-0 loaded 0/2 blocks (0 tokens) from no tier in 1 ms",
            "INFO request cmpl-4-0: recomputing 5 of 9 stored records (slow; est. TTFT 1 s)",
        ]
    )
    assert figures.connector_tiers(log) == {"disk": 64, "cpu": 64}
    assert figures.cost_refusals(log) == 5
    kv = "INFO [metrics.py:103] KV Transfer metrics: num_loaded_blocks=0, saved_bytes={}, load_s=0"
    assert figures.connector_saved_bytes("\n".join([kv.format(100), kv.format(23)])) == 123
    metrics = (
        'vllm:prompt_tokens_by_source_total{engine="0",model_name="m",source="local_cache_hit"} '
        "320.0\n"
        'vllm:prompt_tokens_by_source_total{engine="0",model_name="m",source="external_kv_transfer"}'
        " 128.0\n"
        'vllm:prompt_tokens_by_source_total{engine="0",model_name="m",source="local_compute"} 9.0\n'
    )
    assert figures.vllm_sources(metrics, "") == {"pool": 320, "external": 128}
    assert figures.vllm_sources(metrics, log) == {"pool": 320, "disk": 64, "cpu": 64}


def test_figures_and_the_headline() -> None:
    def answer(i: int, ttft: float, cached: int, tokens: list[int]) -> Answer:
        return Answer(i, 0.0, ttft, 1.0, tokens, prompt_tokens=100, cached_tokens=cached)

    base = [answer(0, 1.0, 0, [1, 2]), answer(1, 3.0, 50, [3])]
    ours = [answer(0, 0.5, 50, [1, 2]), answer(1, 0.5, 100, [4])]
    f_base, f_ours = figures.answer_figures(base, 4.0), figures.answer_figures(ours, 2.0)
    assert f_base["ttft_mean_s"] == 2.0 and f_base["ttft_p50_s"] == 2.0
    assert f_ours["prompt_tokens_computed"] == 50 and f_ours["hit_rate"] == 0.75
    f_ours.update(figures.outputs_against(ours, base))
    f_base.update(figures.outputs_against(base, base))
    assert f_ours["outputs_differing"] == 1 and not f_ours["outputs_identical"]
    head = figures.headline(
        {"vllm": f_base, "vllm+cachetier": f_ours}, "vllm", "vllm+cachetier", ceiling=0.8
    )
    assert head["prefill_work_ratio"] == pytest.approx(50 / 150, abs=1e-4)
    assert head["prefill_work_ratio_bound"] == pytest.approx(0.2 / 0.75, abs=1e-4)
    assert head["ttft_mean_vs_vllm"] == 0.25
    assert head["throughput_vs_vllm"] == 2.0
    assert head["ttft_vs_work_bound"] == pytest.approx(0.25 / 0.3333, abs=1e-3)
    assert head["outputs_identical"] is False and head["lmcache_ran"] is False
    assert figures.percentile([4.0, 1.0, 2.0, 3.0], 0.9) == pytest.approx(3.7)


def test_the_throughput_ceiling_is_the_prefill_share_a_cache_can_take() -> None:
    base = {"wall_s": 100.0, "prompt_tokens_computed": 100}
    # Prefill is half the baseline's time and the cache leaves 0.8 of it: the time falls to
    # 0.9, requests per second rise 1/0.9 times, and work x that is 0.8/0.9.
    got = figures.throughput_ceiling({"wall_s": 50.0}, base, 0.8)
    assert got["baseline_prefill_share"] == 0.5
    assert got["throughput_vs_work_bound_ceiling"] == pytest.approx(0.8 / 0.9, abs=1e-4)
    # All prefill: the ceiling is 1.0; a noisy share over 1 counts as 1.
    assert figures.throughput_ceiling({"wall_s": 120.0}, base, 0.8)[
        "throughput_vs_work_bound_ceiling"
    ] == pytest.approx(1.0)
    assert figures.throughput_ceiling({"error": "did not start"}, base, 0.8) == {}
    # The prefill-only run's one-token outputs are not held against the baseline's.
    ours = {**base, "outputs_identical": True, "hit_rate": 0.5, "ttft_mean_s": 1.0}
    ours.update(requests_per_s=1.0, ttft_p50_s=1.0, ttft_p90_s=1.0)
    head = figures.headline(
        {"vllm": ours, "vllm+cachetier": ours, figures.PREFILL_ONLY: {"wall_s": 50.0}},
        "vllm",
        "vllm+cachetier",
        ceiling=0.6,
    )
    assert head["outputs_identical"] is True and head["baseline_prefill_share"] == 0.5
