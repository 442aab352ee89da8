"""Traffic for the live-curve tests: chats that resend their history, and the plain LRU replay
their curve is checked against (one request: its leading held run hits, then all stored)."""

from __future__ import annotations

import hashlib
import random
from collections import OrderedDict


def key(n: int) -> bytes:
    return hashlib.sha256(n.to_bytes(8, "little")).digest()


def lru_hit_ratio(requests: list[list[bytes]], capacity: int) -> float:
    """The reference: one plain LRU, a request's hit its leading held run, then all stored."""
    held: OrderedDict[bytes, None] = OrderedDict()
    hits = total = 0
    for keys in requests:
        run = 0
        while run < len(keys) and keys[run] in held:
            run += 1
        hits += run
        total += len(keys)
        for k in keys:
            held.pop(k, None)
            held[k] = None
            if len(held) > capacity:
                held.popitem(last=False)
    return hits / total


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
