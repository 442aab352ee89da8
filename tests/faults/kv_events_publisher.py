"""A KV-event publisher in a process of its own, for attacks whose cost is its memory.

``python -m tests.faults.kv_events_publisher SETTINGS_JSON`` starts a ``KVEventPublisher`` with
the ``PublisherConfig`` fields in SETTINGS_JSON (plus ``num_batches`` and ``tokens_per_batch``
to fill its replay buffer with events of prompts that many tokens long), prints one JSON line
with its endpoints once every batch is sent, and runs until its stdin closes.
"""

from __future__ import annotations

import json
import random
import sys
import time
from dataclasses import asdict

from cachetier.kvevents import BlockStored, KVEventPublisher, PublisherConfig
from cachetier.primitives.keys import chain_keys

BLOCK_SIZE = 16


def main(argv: list[str]) -> None:
    settings = json.loads(argv[1])
    num_batches = settings.pop("num_batches")
    num_tokens = settings.pop("tokens_per_batch")
    publisher = KVEventPublisher(PublisherConfig(**settings), epoch=1)
    rng = random.Random(1)
    for _ in range(num_batches):
        tokens = [rng.randrange(1, 150_000) for _ in range(num_tokens)]
        keys = chain_keys(b"\x02" * 32, BLOCK_SIZE, tokens)
        event = BlockStored(tuple(keys), None, tuple(tokens), BLOCK_SIZE, "GPU")
        while not publisher.publish([event]):  # the queue is full: let the thread send
            time.sleep(0.01)
    while publisher.stats().next_seq < num_batches:
        time.sleep(0.01)
    where = {"endpoint": publisher.endpoint, "replay_endpoint": publisher.replay_endpoint}
    print(json.dumps(where), flush=True)
    sys.stdin.read()
    print(json.dumps(asdict(publisher.stats())), flush=True)
    publisher.close()


if __name__ == "__main__":
    main(sys.argv)
