"""Sampling parameters and the sampler (greedy, temperature, top-k, top-p, per-request seed)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How to pick tokens for one request (vLLM's names and defaults).

    Args:
        temperature: 0 is greedy.
        top_p: keep the smallest set of tokens whose probability adds up to this.
        top_k: keep this many most likely tokens; -1 keeps all.
        seed: seed of this request's own generator (reproducible sampling), None for random.
        max_tokens: most tokens to generate.
        stop_token_ids: tokens that end the request (besides EOS unless ``ignore_eos``).
        ignore_eos: keep going past the model's EOS token.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    max_tokens: int = 16
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"top_k must be -1 (all) or positive, got {self.top_k}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def sample(
    logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]
) -> list[int]:
    """One token per row of ``logits`` ``[S, vocab]`` (float32)."""
    out: list[int] = []
    greedy = logits.argmax(dim=-1).tolist()
    for row, (p, gen) in enumerate(zip(params, generators)):
        if p.greedy:
            out.append(greedy[row])
            continue
        scores = logits[row] / p.temperature
        if p.top_k > 0 and p.top_k < scores.shape[-1]:
            kth = torch.topk(scores, p.top_k).values[-1]
            scores = scores.masked_fill(scores < kth, float("-inf"))
        if p.top_p < 1.0:
            sorted_scores, order = torch.sort(scores, descending=True)
            cumulative = sorted_scores.softmax(-1).cumsum(-1)
            # Drop a token once the mass before it already reaches top_p (keeps at least one).
            drop = cumulative - sorted_scores.softmax(-1) >= p.top_p
            scores = scores.scatter(0, order[drop], float("-inf"))
        probs = scores.softmax(-1)
        out.append(int(torch.multinomial(probs, 1, generator=gen)))
    return out
