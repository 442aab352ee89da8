"""The sampled admission replay of ``adaptive``: its ghost simulation sees what it sees in the
exact replay, whether the report's sample is denser than the simulation's own or sparser, so it
scores and switches alike; and the sampled replays stay close to the exact ones."""

from __future__ import annotations

import dataclasses

import pytest

from benchmarks.support.admission_traces import RagShape, rag_requests
from cachetier.admission import Adaptive, AdmissionConfig, AdmissionPolicy
from cachetier.report.admission_replay import (
    FILTERED_TIER,
    replay_filter,
    replay_tracked_keys,
    run_admission,
)
from cachetier.report.admission_sampled import replay_admission_sampled, sampled_filter
from cachetier.report.replay import ReplayTrace
from cachetier.report.sampled import sample_trace

CPU_BLOCKS, DISK_BLOCKS = 100, 300
# Few ghost keys: the simulation samples about 1 key in 6 here, between the report's samples
# below (1 cold key in 4, 1 in 16).
ADAPTIVE = AdmissionConfig(admission_policy="adaptive", admission_sample_keys=64)


@pytest.fixture(scope="module")
def rag() -> ReplayTrace:
    """A small RAG trace (a shared system prompt, a document by Zipf popularity, a one-off
    question), on which a filter beats store-all on a small disk: the simulation switches."""
    return ReplayTrace.from_requests(rag_requests(RagShape(num_requests=1_500, num_documents=600)))


def _simulation(trace: ReplayTrace, filter_: AdmissionPolicy) -> dict:
    assert isinstance(filter_, Adaptive)
    run_admission(trace, filter_, CPU_BLOCKS, DISK_BLOCKS, "lru")
    return filter_.simulation_state()[FILTERED_TIER]


# At 1 in 4 every key the simulation keeps is in the report's sample; at 1 in 16 most are not.
@pytest.mark.parametrize("rate", [0.25, 1 / 16])
def test_the_simulation_sees_what_it_sees_in_the_exact_replay(
    rag: ReplayTrace, rate: float
) -> None:
    sampled = sample_trace(rag, rate)
    tracked = replay_tracked_keys(ADAPTIVE, rag.block_size)
    exact_filter = replay_filter(ADAPTIVE, tracked, CPU_BLOCKS, DISK_BLOCKS)
    sampled_filter_ = sampled_filter(sampled, ADAPTIVE, tracked, CPU_BLOCKS, DISK_BLOCKS)
    exact = _simulation(rag, exact_filter)
    got = _simulation(sampled.trace, sampled_filter_)
    assert exact["choice"] != "all"  # it switched: there was something to get wrong
    # Every decayed score, to the last bit: the same keys, windows and filters.
    assert got == exact


def test_a_sample_without_keys_at_first_catches_the_simulation_up(rag: ReplayTrace) -> None:
    # The first requests' keys all left out of the sample: the disk tier is first asked later.
    head = [(), (), ()]
    sampled = sample_trace(rag, 1 / 16)
    late = dataclasses.replace(sampled.trace, keys=(*head, *sampled.trace.keys[3:]))
    late = dataclasses.replace(late, blocks=(*head, *sampled.trace.blocks[3:]))
    tracked = replay_tracked_keys(ADAPTIVE, rag.block_size)
    filter_ = sampled_filter(sampled, ADAPTIVE, tracked, CPU_BLOCKS, DISK_BLOCKS)
    got = _simulation(late, filter_)
    exact = _simulation(rag, replay_filter(ADAPTIVE, tracked, CPU_BLOCKS, DISK_BLOCKS))
    assert got == exact


@pytest.mark.parametrize("policy", ["second_hit", "tinylfu", "adaptive"])
def test_the_sampled_replay_is_close_to_the_exact_one(rag: ReplayTrace, policy: str) -> None:
    admission = dataclasses.replace(ADAPTIVE, admission_policy=policy)
    sampled, whole = sample_trace(rag, 0.25), sample_trace(rag, 1.0)
    got, want = (
        replay_admission_sampled(
            s, admission, cpu_blocks=CPU_BLOCKS, disk_blocks=DISK_BLOCKS, policy="lru"
        )
        for s in (sampled, whole)
    )
    assert want.num_blocks == got.num_blocks
    # A loose bound for a small trace: the admission benchmark measures the real ones.
    assert got.block_hit_ratio == pytest.approx(want.block_hit_ratio, abs=0.03)
