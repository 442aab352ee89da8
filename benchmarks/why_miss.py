"""What saying why a miss missed costs a lookup, with the store's ledger full.

A store of a CPU tier over a disk tier (a folder on disk) holds the first half of a 2,048-token
prompt's records (64 of 128 keys of 16 tokens); its miss ledger (``cachetier.store.miss_ledger``)
is filled with ``--tracked-keys`` keys let go (1M by default). Each round times a bare lookup
of the prompt's keys (the tiers' own ``contains_prefix``, what every lookup pays) and the
store's explanation of its first missed key (``TieredStore.why_missed``), alternating; the
medians give ``why_miss_overhead`` = explanation / bare lookup (target <= 0.02), beside the
ledger's memory.

    python -m benchmarks.why_miss --json [--tracked-keys 1000000] [--rounds 2000]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.support.output import emit
from cachetier.primitives.keys import BlockHash, KVLayout, Namespace
from cachetier.store.miss_ledger import MissLedger
from cachetier.store.tiered import TieredStore
from cachetier.tiers.cpu import CPUTier, CPUTierConfig
from cachetier.tiers.disk.tier import DiskTier, DiskTierConfig
from tests.support import make_blocks

LAYOUT = KVLayout("float16", 16, 2, 2, 16)
NS = Namespace("why-miss-bench", LAYOUT)


def _fill(ledger: MissLedger, count: int) -> None:
    """``count`` distinct keys let go, in batches as writers and evictions note them."""
    batch = 4096
    for start in range(0, count, batch):
        keys = [BlockHash(i.to_bytes(8, "little") * 4) for i in range(start, start + batch)]
        ledger.note(keys, "evicted", "disk")


def measure(folder: Path, tracked_keys: int, rounds: int) -> dict[str, Any]:
    """The figures of the module docstring."""
    disk = DiskTier(DiskTierConfig(str(folder), 1 << 30, fsync=False))
    with TieredStore([CPUTier(CPUTierConfig(1 << 30)), disk]) as store:
        store.misses = MissLedger(tracked_keys)
        _fill(store.misses, tracked_keys)
        blocks = make_blocks(NS, 128)
        keys = [b.key for b in blocks]
        store.put_many(NS.id, blocks[:64])
        assert store.flush(timeout=30)
        bare, explain = [], []
        for _ in range(rounds):
            start = time.perf_counter()
            found = sum(t.contains_prefix(NS.id, keys) for t in store.tiers)
            bare.append(time.perf_counter() - start)
            start = time.perf_counter()
            store.why_missed(NS.id, keys[64])
            explain.append(time.perf_counter() - start)
        assert found == 128  # both tiers hold the first half
        return {
            "tracked_keys": tracked_keys,
            "ledger_bytes": store.misses.nbytes,
            "ledger_bytes_per_key": round(store.misses.nbytes / tracked_keys, 2),
            "lookup_keys": len(keys),
            "bare_lookup_median_s": statistics.median(bare),
            "explain_median_s": statistics.median(explain),
            "why_miss_overhead": round(statistics.median(explain) / statistics.median(bare), 4),
        }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--tracked-keys", type=int, default=1_000_000)
    parser.add_argument("--rounds", type=int, default=2000)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-why-miss-", dir=".") as tmp:
        emit(measure(Path(tmp), args.tracked_keys, args.rounds), args.json)


if __name__ == "__main__":
    main()
