"""A child process that puts blocks and prints an acknowledgement after each one is stored.

    python -m tests.faults.writer disk <root> <seed> <count>
    python -m tests.faults.writer remote <url> <seed> <count>   (token in CACHETIER_REMOTE_TOKEN)

Block ``i`` of a seed is always the same bytes (``crash_blocks``), so the parent can check
what it reads back after it has killed this process with SIGKILL at a random moment. A line
``ack <i>`` is printed (and flushed) only after ``put_many`` returned the block as stored: it
is the acknowledgement a caller of the tier would have acted on.
"""

from __future__ import annotations

import os
import sys

from cachetier.primitives.keys import KVLayout, Namespace
from cachetier.record import KVBlock
from tests.support import make_blocks

# 64 KiB per block: big enough that a kill can land in the middle of writing one.
CRASH_LAYOUT = KVLayout("float16", block_size=16, num_layers=4, num_kv_heads=4, head_dim=64)
CRASH_NAMESPACE = Namespace("crash-test-model", CRASH_LAYOUT)


def crash_blocks(seed: int, count: int) -> list[KVBlock]:
    """The blocks a writer of ``seed`` puts, in order."""
    return make_blocks(CRASH_NAMESPACE, count, seed=seed)


def main(argv: list[str]) -> int:
    kind, where, seed, count = argv[0], argv[1], int(argv[2]), int(argv[3])
    blocks = crash_blocks(seed, count)
    if kind == "disk":
        from cachetier.tiers.disk.tier import DiskTier, DiskTierConfig

        tier = DiskTier(DiskTierConfig(root=where, capacity_bytes=1 << 34, fsync=True))
    else:
        from cachetier.tiers.remote import RemoteTier, RemoteTierConfig

        tier = RemoteTier(RemoteTierConfig(url=where, token=os.environ["CACHETIER_REMOTE_TOKEN"]))
    print("ready", flush=True)
    for index, block in enumerate(blocks):
        if tier.put_many(CRASH_NAMESPACE.id, [block]) == 1:
            print(f"ack {index}", flush=True)
    print("done", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
