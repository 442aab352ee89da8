"""One request as the scheduler and block manager see it."""

from __future__ import annotations

import enum
import time
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from cachetier.engine.sampling import SamplingParams
from cachetier.engine.tier_bridge import Restored
from cachetier.primitives.keys import BlockHash
from cachetier.store.costmodel import LoadPlan

TTFT_PARTS = ("queue_s", "lookup_s", "restore_read_s", "restore_copy_s", "prefill_s", "sample_s")
"""The parts of a request's TTFT the engine times: waiting to be admitted, the prefix lookup
(pool, tiers and the load plan), reading the hit from the tiers, copying what could not be read
in place, the forward passes that computed its prompt, and sampling its first token. What they
do not cover (other requests' steps, scheduling, Python between steps) is ``other_s``."""


@dataclass(slots=True)
class PendingRestore:
    """A tier read into a sequence's blocks, running on the bridge's thread.

    Args:
        future: the restore (``TierBridge.restore_in_background``).
        keys: the blocks asked for, in order.
        block_ids: the pool blocks they go to, one per key; nothing else may use them until
            the future is done.
        lookup_keys: every key the admission looked up (for the lookup event).
        num_pool_blocks: leading blocks the pool itself held.
        first: whether this is the request's first admission (its lookup is logged once).
        waiting_since_s: when the head was computed with the read not yet in (the request
            has waited for it since); ``None`` while it has not had to wait.
        first_block_index: the sequence's block index of ``keys[0]`` (where its records are
            found in ``Sequence.record_keys``).
    """

    future: Future[Restored]
    keys: list[BlockHash]
    block_ids: list[int]
    lookup_keys: list[BlockHash]
    num_pool_blocks: int
    first: bool
    waiting_since_s: float | None = None
    first_block_index: int = 0  # the sequence's block index of ``keys[0]``


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    """A request's tokens, its place in the pool and where its cached tokens came from."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_s: float = field(default_factory=time.perf_counter)
    status: SequenceStatus = SequenceStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    block_table: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    # Keys of the full records of all tokens so far (prompt and output), in order, and of the
    # full pool blocks: a block's key is its last record's (the chain covers every token up
    # to it), so with one record per block the two lists are alike.
    record_keys: list[BlockHash] = field(default_factory=list)
    block_keys: list[BlockHash] = field(default_factory=list)
    num_cached_tokens: int = 0
    cached_tokens_by_source: dict[str, int] = field(default_factory=dict)
    first_token_s: float | None = None
    finish_reason: str | None = None
    num_preemptions: int = 0
    generator: torch.Generator | None = None
    # Where the time to first token went, in seconds (``TTFT_PARTS``), filled as it runs.
    timings: dict[str, float] = field(default_factory=dict)
    # Hit blocks the cost model chose to recompute rather than load, and the seconds it
    # estimated the hit saved (against recomputing all of it).
    num_recomputed_hit_tokens: int = 0
    est_saved_s: float = 0.0
    # Tier hits the restore guard drew to verify (computed, then compared with the tier), and
    # tokens past the hit that a quarantined tier holds: the lookup event reports both.
    num_verified_tokens: int = 0
    # The guard's draw for its hit (``None``: no hit yet): made once per request, however
    # often a queued request is looked up again; ``True``: it is computed and compared.
    guard_draw: bool | None = None
    num_quarantined_tokens: int = 0
    # Why the tiers' run ended where it did (``PrefixHit.miss_cause``), and the tier concerned.
    miss_cause: str = ""
    miss_tier: str = ""
    miss_detail: str = ""  # the cause in words (``PrefixHit.miss_detail``)
    looked_up: bool = False  # whether the tiers were asked for it yet
    # Prompt tokens not served from cache, by cause (``cached_tokens._misses``).
    miss_tokens_by_cause: dict[str, int] = field(default_factory=dict)
    # The plan of its first admission: a refusal's real prefill time goes back to the model.
    load_plan: LoadPlan | None = None
    # (from, to): blocks loaded from the tiers sit at tokens [from, to), after blocks the
    # cost model chose to recompute; once ``num_computed_tokens`` reaches ``from`` it jumps.
    skip: tuple[int, int] | None = None
    # Leading blocks the tiers already hold (from its last lookup): computed again by choice,
    # they are not written back over the link the cost model avoided.
    num_stored_blocks: int = 0
    # The tier read of the loaded blocks at ``skip``, running while the blocks before them
    # are recomputed; ``None`` when there is none.
    pending_restore: PendingRestore | None = None

    def __post_init__(self) -> None:
        if self.params.seed is not None:
            self.generator = torch.Generator().manual_seed(self.params.seed)

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def block_token_ids(self, index: int, block_size: int) -> list[int]:
        """The tokens of block ``index`` (without joining the whole sequence's lists)."""
        start, end = index * block_size, (index + 1) * block_size
        prompt = self.prompt_token_ids
        if end <= len(prompt):
            return prompt[start:end]
        return (prompt[start:] + self.output_token_ids[max(start - len(prompt), 0) :])[
            : end - start
        ]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_s is None else self.first_token_s - self.arrival_s

    def add_time(self, part: str, seconds: float) -> None:
        """Add to one part of the TTFT breakdown (nothing once the first token is out)."""
        if self.first_token_s is None:
            self.timings[part] = self.timings.get(part, 0.0) + seconds

    def ttft_breakdown(self) -> dict[str, float]:
        """Every part of ``TTFT_PARTS`` plus ``other_s``, which make up ``ttft_s``; empty
        before the first token."""
        ttft = self.ttft_s
        if ttft is None:
            return {}
        out = {part: self.timings.get(part, 0.0) for part in TTFT_PARTS}
        out["other_s"] = max(0.0, ttft - sum(out.values()))
        return out
