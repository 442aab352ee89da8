"""Traffic for the live-curve tests: chats that resend their history, and the plain LRU replay
their curve is checked against (the benchmark's: a request's leading held run hits, then all
its keys are stored)."""

from __future__ import annotations

import hashlib
import random

from benchmarks.live_curve import exact_lru as lru_hit_ratio  # the one reference LRU

__all__ = ["chats", "key", "lru_hit_ratio"]


def key(n: int) -> bytes:
    return hashlib.sha256(n.to_bytes(8, "little")).digest()


def chats(num_requests: int, seed: int) -> list[list[bytes]]:
    """Conversations that resend their history, plus one-off prompts sharing a system prompt."""
    rng = random.Random(seed)
    system = [key(i) for i in range(4)]
    histories: list[list[bytes]] = []
    out = []
    fresh = 1000
    for _ in range(num_requests):
        if histories and rng.random() < 0.6:
            history = rng.choice(histories)
        else:
            history = list(system)
            histories.append(history)
        history += [key(fresh + i) for i in range(rng.randint(1, 4))]
        fresh += 4
        out.append(list(history))
    return out
