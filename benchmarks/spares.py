"""Puts into a full disk tier, written over the records it evicts (spare files) or into new
files, in one process (``cachetier.tiers.disk.spares``).

    python -m benchmarks.spares --json

Two disk tiers, each in a folder of its own, each full (capacity: ``--capacity-batches``
batches): one keeps spares (the default), one does not (``spare_bytes=0``). Each put is a
batch of ``--chunks`` new blocks, so each evicts about one batch, the steady state of a full
tier. The two are timed in turn (a, b, a, b), with fsync on as a tier's default and off as the
sidecar and bench-peers run it. ``*_speedup``: the median put without spares over the median
with them (> 1: spares are faster). Shapes as ``make bench-peers``: ``small`` (512 KiB
blocks) and ``smollm2`` (SmolLM2-135M, 5.6 MiB).
"""

from __future__ import annotations

import argparse
import itertools
import tempfile
from collections.abc import Callable
from typing import Any

from benchmarks.peers.common import SHAPES, make_chunks
from benchmarks.support.output import emit
from benchmarks.support.timing import interleaved_medians
from benchmarks.support.workdir import disk_work_dir
from cachetier.record import encode_record
from cachetier.tiers.disk.tier import DiskTier, DiskTierConfig


def full_tier_puts(
    shape: str, chunks: int, capacity_batches: int, fsync: bool, repeats: int, work: str | None
) -> dict[str, float]:
    """Median seconds of one batch's put into each full tier, and their ratio."""
    # One pool of distinct blocks, put round robin: a block comes back only after the tier has
    # evicted it (the pool holds more batches than the capacity).
    pool = make_chunks(shape, chunks * (capacity_batches + 2), seed=1).blocks
    batch_bytes = chunks * len(encode_record(pool[0]))
    namespace = make_chunks(shape, 1).namespace.id
    with tempfile.TemporaryDirectory(dir=work) as tmp:
        tiers = {
            name: DiskTier(
                DiskTierConfig(
                    f"{tmp}/{name}",
                    capacity_bytes=capacity_batches * batch_bytes,
                    fsync=fsync,
                    spare_bytes=spare_bytes,
                )
            )
            for name, spare_bytes in (("new_files", 0), ("spares", None))
        }

        def putter(tier: DiskTier) -> Callable[[], None]:
            batches = itertools.cycle([pool[i : i + chunks] for i in range(0, len(pool), chunks)])

            def put() -> None:
                batch = next(batches)
                if tier.put_many(namespace, batch) != len(batch):
                    raise RuntimeError(f"{tier.root}: a put was refused")

            return put

        runs = {name: putter(tier) for name, tier in tiers.items()}
        for _ in range(capacity_batches):  # fill both: every timed put then evicts
            for put in runs.values():
                put()
        medians = interleaved_medians(runs, repeats, warmup=1)
        for tier in tiers.values():
            tier.close()
    return {
        "new_files_ms": 1e3 * medians["new_files"],
        "spares_ms": 1e3 * medians["spares"],
        "speedup": medians["new_files"] / medians["spares"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--json", action="store_true", help="print one JSON object last")
    parser.add_argument("--chunks", type=int, default=16, help="blocks per put")
    parser.add_argument("--capacity-batches", type=int, default=8, help="tier size, in puts")
    parser.add_argument("--repeats", type=int, default=30, help="puts timed per tier")
    parser.add_argument("--work", help="folder for the tiers (default: the temp folder)")
    args = parser.parse_args()
    work = disk_work_dir(args.work, "--work")
    result: dict[str, Any] = {}
    for shape in SHAPES:
        for fsync in (False, True):
            label = f"{shape}_{'fsync' if fsync else 'no_fsync'}"
            got = full_tier_puts(
                shape, args.chunks, args.capacity_batches, fsync, args.repeats, work
            )
            result[f"{label}_new_files_ms"] = round(got["new_files_ms"], 3)
            result[f"{label}_spares_ms"] = round(got["spares_ms"], 3)
            result[f"{label}_speedup"] = round(got["speedup"], 3)
    result["chunks_per_put"] = args.chunks
    emit(result, args.json)


if __name__ == "__main__":
    main()
