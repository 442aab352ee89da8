"""Fixtures of the engine tests: a scheduler of real parts at tiny sizes, driven without a model
(as vLLM's scheduler tests drive theirs)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Protocol

import pytest

from cachetier.engine.block_manager import BlockManager
from cachetier.engine.config import EngineConfig
from cachetier.engine.kv_cache import KVPool
from cachetier.engine.model_spec import ModelSpec
from cachetier.engine.sampling import SamplingParams
from cachetier.engine.scheduler import ScheduledSeq, Scheduler
from cachetier.engine.sequence import Sequence
from cachetier.engine.tier_bridge import TierBridge
from cachetier.primitives.keys import KVLayout, Namespace, record_layout
from cachetier.report.events import EventLog
from cachetier.store.costmodel import LoadPlan
from cachetier.store.tiered import TieredStore

# One layer, one KV head of 4 floats: a pool block of 4 tokens is 128 bytes.
TINY_SPEC = ModelSpec(
    architecture="LlamaForCausalLM",
    num_layers=1,
    hidden_size=4,
    intermediate_size=8,
    num_heads=1,
    num_kv_heads=1,
    head_dim=4,
    vocab_size=256,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    rope_scaling=None,
    max_position_embeddings=1024,
    tie_word_embeddings=False,
    bos_token_id=None,
    eos_token_ids=(),
)
OUTPUT_TOKEN = 255  # what every "sampled" token is


def tiny_layout(block_size: int) -> KVLayout:
    """The pool layout of ``TINY_SPEC`` in float32."""
    return KVLayout(
        "float32", block_size, TINY_SPEC.num_layers, TINY_SPEC.num_kv_heads, TINY_SPEC.head_dim
    )


class SchedulerRun:
    """A scheduler and the engine's part around it, with no model.

    A step "computes" the scheduled tokens by writing each token's id into its K/V slots of
    the pool (so a restored block shows whose tokens it holds), registers what was computed,
    gives each sequence whose tokens are all computed one more token, and finishes those that
    reached ``max_tokens`` (which saves their full blocks to the tiers, if any).
    """

    def __init__(self, scheduler: Scheduler, pool: KVPool) -> None:
        self.scheduler = scheduler
        self.pool = pool
        self.seqs: dict[str, Sequence] = {}

    @property
    def blocks(self) -> BlockManager:
        return self.scheduler.blocks

    def add(self, request_id: str, prompt: list[int], max_tokens: int = 16) -> Sequence:
        seq = Sequence(request_id, list(prompt), SamplingParams(max_tokens=max_tokens))
        self.seqs[request_id] = seq
        self.scheduler.add(seq)
        return seq

    def step(self) -> list[tuple[str, int]]:
        """One step; returns ``(request id, tokens computed)`` in the scheduler's order."""
        return self.compute(self.scheduler.schedule())

    def compute(self, scheduled: list[ScheduledSeq]) -> list[tuple[str, int]]:
        """What the engine does with a step the scheduler planned (``step`` without the
        ``schedule``, for tests that look in between)."""
        bs = self.scheduler.block_size
        for item in scheduled:
            seq, start = item.seq, item.seq.num_computed_tokens
            for pos in range(start, start + item.num_new):
                block = seq.block_table[pos // bs]
                self.pool.cache[block, :, :, pos % bs] = float(seq.token_ids[pos])
        for item in scheduled:
            before = item.seq.num_computed_tokens
            item.seq.num_computed_tokens += item.num_new
            self.scheduler.register_computed(item.seq, before)
        for item in scheduled:
            seq = item.seq
            if seq.num_computed_tokens < seq.num_tokens:
                continue
            seq.output_token_ids.append(OUTPUT_TOKEN)
            self.scheduler.extend_keys(seq)
            if len(seq.output_token_ids) >= seq.params.max_tokens:
                self.scheduler.finish(seq, "length")
        return [(item.seq.request_id, item.num_new) for item in scheduled]

    def tokens_in(self, block_id: int) -> list[int]:
        """The token ids whose K/V a pool block holds (what ``step`` wrote there)."""
        return [int(v) for v in self.pool.cache[block_id, 0, 0, :, 0, 0]]

    def waiting(self) -> list[str]:
        return [seq.request_id for seq in self.scheduler.waiting]

    def running(self) -> list[str]:
        return [seq.request_id for seq in self.scheduler.running]


MakeRun = Callable[..., SchedulerRun]


class Planner(Protocol):
    """What the scheduler asks of a ``CostModel``: a ``LoadPlan`` for a tier hit."""

    def plan(self, spans: list[tuple[str, int]], **kw: Any) -> LoadPlan: ...


@pytest.fixture
def make_run(tmp_path: Path) -> Iterator[MakeRun]:
    """Builds a ``SchedulerRun`` of ``num_blocks`` pool blocks of ``block_size`` tokens; over
    ``store`` (records of ``record_tokens`` tokens) if one is given, its hits planned by
    ``cost`` (a ``CostModel`` or a fixed ``Planner``; all loaded without one), with an event
    log at ``tmp_path / "events.jsonl"`` if ``events``; other keywords go to
    ``EngineConfig``."""
    closers: list[Callable[[], None]] = []

    def make(
        num_blocks: int = 8,
        *,
        block_size: int = 4,
        store: TieredStore | None = None,
        record_tokens: int | None = None,
        cost: Planner | None = None,
        events: bool = False,
        **config: Any,
    ) -> SchedulerRun:
        engine_config = EngineConfig("no-model", block_size=block_size, **config)
        pool = KVPool(
            TINY_SPEC, block_size, num_blocks * tiny_layout(block_size).block_bytes, "float32"
        )
        layout = record_layout(pool.layout, record_tokens or block_size)
        namespace = Namespace("scheduler-test", layout)
        bridge = TierBridge(store, namespace, pool) if store is not None else None
        on_evict = bridge.save if bridge is not None else None
        blocks = BlockManager(pool.num_blocks, on_evict=on_evict)
        log = EventLog(tmp_path / "events.jsonl") if events else None
        # The scheduler asks a planner for plans only (and a refusal's outcome, which a plan
        # without estimates never asks for).
        scheduler = Scheduler(
            engine_config,
            namespace,
            blocks,
            bridge,
            log,
            cost,  # type: ignore[arg-type]
        )
        closers.append(scheduler.close)
        if bridge is not None:
            closers.append(bridge.close)
        if log is not None:
            closers.append(log.close)
        return SchedulerRun(scheduler, pool)

    yield make
    for close in closers:
        close()
