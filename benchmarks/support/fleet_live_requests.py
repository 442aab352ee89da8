"""The requests ``benchmarks.bench_fleet`` replays: multi-turn sessions of the shipped
conversation trace as SmolLM2 token prompts, and the open-loop arrival schedule every policy is
given.

- A session is the requests whose second hash id is the same (the first id past the system
  prompt every request of the trace shares; a conversation's later turns resend it), as
  ``benchmarks.fleet_sim`` has it. Sessions are taken in the order of their first request, and
  only those of two turns or more whose first ``max_turns`` turns are all ``max_ids`` hash ids
  or fewer: a prompt must fit a CPU replica's minute, and a one-turn session has nothing to
  reuse. Their turns are replayed in trace order, so other sessions' turns come between two
  turns of one: what pushes a prompt out of a small pool into the tiers below.
- Each hash id becomes ``tokens_per_id`` tokens (the trace's ids stand for 512; 16, one engine
  block, keeps a prompt to the seconds a CPU prefill allows), the same tokens for the same id
  in every prompt (``cachetier.report.replay.synthetic_tokens``), drawn from the ordinary-word
  range of the vocabulary. The trace's ids are chained, so a repeated id is a repeated prefix
  of tokens and the engine's block keys of it repeat too.
- Arrivals are a Poisson process of a given rate (seeded): the same schedule for every policy.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from cachetier.report.replay import TraceRequest, synthetic_tokens
from cachetier.util.checks import positive_int

TOKENS_PER_ID = 16
TOKEN_LOW = 1000
"""Token ids below this, and this many at the top of the vocabulary, are left out: special
and rare tokens (``benchmarks.support.requests`` does the same)."""
WARMUP_ID_BASE = 1 << 40
"""Hash ids of the warm-up prompts: far past the trace's, so they share no block with it."""


@dataclass(frozen=True, slots=True)
class LiveRequest:
    """One request of the live replay.

    Args:
        trace_index: its position in the trace.
        session: its session (the second hash id, as text).
        turn: its turn in the session, from 0.
        hash_ids: the trace's hash ids of its prompt.
        prompt: its token ids.
    """

    trace_index: int
    session: str
    turn: int
    hash_ids: tuple[int, ...]
    prompt: tuple[int, ...]


def session_turns(trace: Sequence[TraceRequest]) -> dict[int, list[int]]:
    """Each session's requests (trace positions, in order), sessions in order of their first
    request; one-block requests belong to none."""
    sessions: dict[int, list[int]] = defaultdict(list)
    for index, request in enumerate(trace):
        if len(request.hash_ids) > 1:
            sessions[request.hash_ids[1]].append(index)
    return dict(sessions)


def pick_sessions(
    trace: Sequence[TraceRequest],
    num_sessions: int,
    *,
    skip: int = 0,
    max_ids: int,
    max_turns: int,
) -> list[list[int]]:
    """The sessions replayed (as the module says): each one's first ``max_turns`` trace
    positions, after the first ``skip`` eligible sessions.

    Raises:
        ValueError: the trace has fewer eligible sessions.
    """
    positive_int("num_sessions", num_sessions)
    eligible = []
    for turns in session_turns(trace).values():
        kept = turns[:max_turns]
        if len(kept) >= 2 and all(len(trace[i].hash_ids) <= max_ids for i in kept):
            eligible.append(kept)
    if len(eligible) < skip + num_sessions:
        raise ValueError(
            f"the trace has {len(eligible)} sessions of 2 to {max_turns} turns of at most "
            f"{max_ids} ids; {skip + num_sessions} were asked for"
        )
    return eligible[skip : skip + num_sessions]


def id_tokens(hash_ids: Sequence[int], vocab_size: int, tokens_per_id: int) -> list[int]:
    """The prompt of ``hash_ids``: ``tokens_per_id`` ordinary-word tokens per id, the same for
    the same id."""
    if vocab_size <= 2 * TOKEN_LOW:
        raise ValueError(f"vocab_size must be over {2 * TOKEN_LOW}, got {vocab_size}")
    words = vocab_size - 2 * TOKEN_LOW
    raw = synthetic_tokens(hash_ids, block_size=tokens_per_id, vocab_size=words)
    return (raw.reshape(-1).astype(np.int64) + TOKEN_LOW).tolist()


def live_requests(
    trace: Sequence[TraceRequest],
    sessions: Sequence[Sequence[int]],
    vocab_size: int,
    tokens_per_id: int = TOKENS_PER_ID,
) -> list[LiveRequest]:
    """Every turn of ``sessions`` as a request, in trace order."""
    turn_of = {
        index: (str(trace[index].hash_ids[1]), t) for s in sessions for t, index in enumerate(s)
    }
    out = []
    for index in sorted(turn_of):
        ids = trace[index].hash_ids
        session, turn = turn_of[index]
        prompt = tuple(id_tokens(ids, vocab_size, tokens_per_id))
        out.append(LiveRequest(index, session, turn, ids, prompt))
    return out


def warmup_prompts(
    count: int, num_ids: int, vocab_size: int, tokens_per_id: int
) -> list[list[int]]:
    """``count`` prompts of ``num_ids`` ids each that share no block with the trace or with
    each other: cold prefills to measure what the fleet serves without a cache."""
    positive_int("num_ids", num_ids)
    return [
        id_tokens(
            range(WARMUP_ID_BASE + i * num_ids, WARMUP_ID_BASE + (i + 1) * num_ids),
            vocab_size,
            tokens_per_id,
        )
        for i in range(count)
    ]


def poisson_arrivals(count: int, rate_per_s: float, seed: int = 0) -> list[float]:
    """``count`` arrival times (seconds from the first, which is 0) of a Poisson process."""
    if not rate_per_s > 0:
        raise ValueError(f"rate_per_s must be positive, got {rate_per_s}")
    if count <= 0:
        return []
    gaps = np.random.default_rng(seed).exponential(1.0 / rate_per_s, count - 1)
    return [0.0, *np.cumsum(gaps).tolist()]


def unique_ids(requests: Sequence[LiveRequest]) -> int:
    """Distinct hash ids over ``requests``: the blocks a fleet must hold to keep all of them."""
    return len({h for r in requests for h in r.hash_ids})


def reuse_ceiling(requests: Sequence[LiveRequest], tokens_per_id: int = TOKENS_PER_ID) -> float:
    """The token hit ratio of a cache that keeps everything and is always asked: per request, the
    leading hash ids some earlier request had (as a prefix), as tokens, less the last prompt
    token (engines compute it), over all prompt tokens. No routing policy can pass it.

    Args:
        requests: in the order they are sent.
        tokens_per_id: tokens per hash id.

    Returns:
        The ratio, in [0, 1).
    """
    seen: set[tuple[int, ...]] = set()
    hit = total = 0
    for request in requests:
        ids = request.hash_ids
        found = 0
        while found < len(ids) and ids[: found + 1] in seen:
            found += 1
        hit += min(found * tokens_per_id, len(request.prompt) - 1)
        total += len(request.prompt)
        seen.update(ids[: i + 1] for i in range(len(ids)))
    return hit / total if total else 0.0
