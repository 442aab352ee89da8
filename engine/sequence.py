"""One request as the scheduler and block manager see it."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import torch

from cachetier.keys import BlockHash
from engine.sampling import SamplingParams


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
    # Keys of the full blocks of all tokens so far (prompt and output), in order.
    block_keys: list[BlockHash] = field(default_factory=list)
    num_cached_tokens: int = 0
    cached_tokens_by_source: dict[str, int] = field(default_factory=dict)
    first_token_s: float | None = None
    finish_reason: str | None = None
    num_preemptions: int = 0
    generator: torch.Generator | None = None

    def __post_init__(self) -> None:
        if self.params.seed is not None:
            self.generator = torch.Generator().manual_seed(self.params.seed)

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

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
