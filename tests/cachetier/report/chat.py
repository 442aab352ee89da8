"""A chat-shaped trace for the sampled replays' tests: a system prompt in every request, then
conversations whose turns resend the previous turn."""

from __future__ import annotations

import random

from cachetier.report.replay import ReplayTrace, TraceRequest


def chat_trace(num_requests: int = 3_000, seed: int = 0) -> ReplayTrace:
    """A system prompt of 4 blocks in every request, then conversations whose turns resend
    the previous turn and add 1 to 4 blocks; recent conversations are picked more often."""
    rng = random.Random(seed)
    next_id = 4
    convs: list[list[int]] = []
    requests = []
    for i in range(num_requests):
        if not convs or rng.random() < 0.3:
            convs.append([0, 1, 2, 3])
        conv = convs[-1 - min(len(convs) - 1, int(rng.expovariate(1 / 20)))]
        if len(conv) > 24:  # a long chat ends; a new one starts
            conv = [0, 1, 2, 3]
            convs.append(conv)
        conv.extend(range(next_id, next_id + rng.randint(1, 4)))
        next_id = conv[-1] + 1
        requests.append(
            TraceRequest(i * 100, len(conv) * 512 - rng.randint(0, 400), 64, tuple(conv))
        )
    return ReplayTrace.from_requests(requests)
