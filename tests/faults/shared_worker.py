"""Child processes that share one disk tier folder, for ``test_shared_folder``.

    python -m tests.faults.shared_worker write <root> <capacity> <seed> <batches> <batch_blocks>
    python -m tests.faults.shared_worker reopen <root> <capacity> <stop file>
    python -m tests.faults.shared_worker read <root> <capacity> <seed> <count>
    python -m tests.faults.shared_worker churn <root> <capacity> <count> <stop file>
    python -m tests.faults.shared_worker watch <root> <count> <rounds>

Each prints ``ready`` once its tier is open, then one JSON line with what it did when it ends.
Block ``i`` of a seed is always the same bytes (``tests.faults.writer.crash_blocks``), so the
parent knows what every read must return.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from cachetier.record import KVBlock
from cachetier.tiers.disk.tier import DiskTier, DiskTierConfig
from tests.faults.writer import CRASH_NAMESPACE, crash_blocks

NS = CRASH_NAMESPACE.id
CHURN_SEEDS = (1001, 1002)  # the two versions ``churn`` puts under each of its keys


def churn_versions(count: int) -> tuple[list[KVBlock], list[KVBlock]]:
    """Two records under each of ``count`` keys: the first seed's blocks, and the same keys
    with the second seed's payloads."""
    first = crash_blocks(CHURN_SEEDS[0], count)
    other = crash_blocks(CHURN_SEEDS[1], count)
    second = [
        KVBlock(a.key, a.fingerprint, a.dtype, a.shape, a.num_tokens, b.data)
        for a, b in zip(first, other, strict=True)
    ]
    return first, second


def _tier(root: str, capacity: int) -> DiskTier:
    # The suite asserts that no put is refused: with four writers in flight over room for two
    # batches a put waits for others to land, and on a loaded CI machine (the whole suite on
    # two cores) a landing took over the default 5 s. The wait is what is tested, not its length.
    config = DiskTierConfig(root=root, capacity_bytes=capacity, fsync=True, admit_wait_s=120.0)
    return DiskTier(config)


def _ready() -> None:
    print("ready", flush=True)


def write(root: str, capacity: int, seed: int, num_batches: int, batch_blocks: int) -> dict:
    """Put ``num_batches`` batches; ``acked``: the blocks ``put_many`` said it stored."""
    blocks = crash_blocks(seed, num_batches * batch_blocks)
    tier = _tier(root, capacity)
    _ready()
    acked: list[int] = []
    failed = 0
    for start in range(0, len(blocks), batch_blocks):
        batch = blocks[start : start + batch_blocks]
        stored = tier.put_many(NS, batch)
        if stored == len(batch):
            acked.extend(range(start, start + len(batch)))
        failed += len(batch) - stored
    stats = tier.stats()
    tier.close()
    return {"acked": acked, "failed": failed, "stats": stats}


def reopen(root: str, capacity: int, stop_file: str) -> dict:
    """Open and close the folder again and again until ``stop_file`` appears."""
    opens = evictions = errors = 0
    _ready()
    while True:
        tier = _tier(root, capacity)
        opens += 1
        stats = tier.stats()
        evictions += stats["evictions"]
        errors += stats["errors"]
        tier.close()
        if Path(stop_file).exists():
            break
    return {"opens": opens, "evictions": evictions, "errors": errors}


def read(root: str, capacity: int, seed: int, count: int) -> dict:
    """Read every block of ``seed``; ``intact`` and ``wrong`` list what came back."""
    blocks = crash_blocks(seed, count)
    tier = _tier(root, capacity)
    _ready()
    got = tier.get_many(NS, [b.key for b in blocks])
    intact = [i for i, (g, b) in enumerate(zip(got, blocks)) if g is not None and _same(g, b)]
    wrong = [i for i, (g, b) in enumerate(zip(got, blocks)) if g is not None and not _same(g, b)]
    out = {"intact": intact, "wrong": wrong, "stats": tier.stats()}
    tier.close()
    return out


def churn(root: str, capacity: int, count: int, stop_file: str) -> dict:
    """Replace, delete and (through a small capacity) evict ``count`` keys until
    ``stop_file`` appears."""
    first, second = churn_versions(count)
    tier = _tier(root, capacity)
    _ready()
    rounds = 0
    while not Path(stop_file).exists():
        for version in (first, second):
            for start in range(0, count, 4):
                tier.put_many(NS, version[start : start + 4])
        tier.delete(NS, [b.key for b in first[rounds % 3 :: 3]])
        rounds += 1
    out = {"rounds": rounds, "stats": tier.stats()}
    tier.close()
    return out


def watch(root: str, count: int, rounds: int) -> dict:
    """Read ``churn``'s keys ``rounds`` times; every hit must be one of their two versions."""
    first, second = churn_versions(count)
    tier = _tier(root, 1 << 40)
    _ready()
    hits = misses = wrong = 0
    for i in range(rounds):
        keys = [b.key for b in first]
        if i % 2:
            dests = [memoryview(bytearray(len(b.data))) for b in first]
            got = tier.get_into(NS, keys, dests)
        else:
            got = tier.get_many(NS, keys)
        for g, a, b in zip(got, first, second, strict=True):
            if g is None:
                misses += 1
            elif _same(g, a) or _same(g, b):
                hits += 1
            else:
                wrong += 1
    out = {"hits": hits, "misses": misses, "wrong": wrong, "stats": tier.stats()}
    tier.close()
    return out


def _same(got: KVBlock, want: KVBlock) -> bool:
    return (
        bytes(got.key) == bytes(want.key)
        and got.fingerprint == want.fingerprint
        and tuple(got.shape) == tuple(want.shape)
        and bytes(got.data) == bytes(want.data)
    )


def main(argv: list[str]) -> int:
    kind, root, rest = argv[0], argv[1], argv[2:]
    if kind == "write":
        out = write(root, *(int(a) for a in rest))
    elif kind == "reopen":
        out = reopen(root, int(rest[0]), rest[1])
    elif kind == "read":
        out = read(root, *(int(a) for a in rest))
    elif kind == "churn":
        out = churn(root, int(rest[0]), int(rest[1]), rest[2])
    elif kind == "watch":
        out = watch(root, int(rest[0]), int(rest[1]))
    else:
        raise SystemExit(f"unknown kind {kind!r}")
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
