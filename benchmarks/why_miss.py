"""What saying why a miss missed costs a lookup, with a million keys in each shadow structure.

``MissLedger`` and ``TokenIndex`` (``cachetier.misses``) are each sized for and filled with
``--tracked-keys`` random keys (1M by default), noted in batches as writers and evictions
note them; a full set replaces its oldest entry, so a table keeps most, not all, of as many
random keys as it has slots (``*_entries``). A ``TieredStore`` of a CPU tier over a disk tier
(a folder in the working directory) holds the first half of a 2,048-token prompt: 64 of its
128 records of 16 tokens. The token index holds the whole prompt under another namespace (an
older model build, float16 where the asker is bfloat16); the ledger remembers half of the
missed records as evicted by the CPU tier.

Timed in turn, round after round (``interleaved_medians``):

- ``lookup``: ``TieredStore.lookup`` of the prompt's 128 keys (64 hits, then the miss), the
  store's lookup as it is, with whatever attribution it does itself;
- ``explain_first``: ``MissLedger.explain`` and ``TokenIndex.holder`` of the first missed key,
  which is all a store needs to ask: a prefix cache serves nothing past it, so its cause is
  every later block's (both are asked, and both answer: an upper bound);
- ``explain_all``: the same for each of the 64 missed keys (``TokenIndex.holders``);
- ``token_keys``: ``token_keys`` of the prompt up to its first missed record (65 records),
  for an engine that computes token-only keys only when a lookup misses.

``why_miss_overhead`` = median ``explain_first`` / median ``lookup`` (target <= 0.02);
``why_miss_overhead_all_keys`` and ``token_keys_overhead`` likewise. The ``*_restart``
figures repeat the lookup and the explanations after a restart: an empty CPU tier, so every
hit is a file of the disk tier, found by a stat each. The structures' memory is given in all
and per tracked key.

    python -m benchmarks.why_miss --json [--tracked-keys 1000000] [--rounds 3000]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.support.output import emit
from benchmarks.support.timing import interleaved_medians
from cachetier.misses import MissLedger, NamespaceDescriptor, TokenIndex, token_keys
from cachetier.primitives.keys import BlockHash, KVLayout, Namespace, block_keys
from cachetier.record import KVBlock
from cachetier.store.tiered import TieredStore
from cachetier.tiers.cpu import CPUTier, CPUTierConfig
from cachetier.tiers.disk.tier import DiskTier, DiskTierConfig

RECORD_TOKENS = 16
PROMPT_TOKENS = 2048
LAYOUT = KVLayout("bfloat16", RECORD_TOKENS, 2, 2, 16)
NS = Namespace("why-miss-bench-v2", LAYOUT)
ASKING = NamespaceDescriptor.from_namespace(NS)
HOLDING = NamespaceDescriptor.from_namespace(
    Namespace("why-miss-bench-v1", KVLayout("float16", RECORD_TOKENS, 2, 2, 16))
)
FILL_BATCH = 4096


def _random_keys(rng: np.random.Generator, count: int) -> list[BlockHash]:
    raw = rng.bytes(32 * count)
    return [BlockHash(raw[i : i + 32]) for i in range(0, len(raw), 32)]


def _fill(ledger: MissLedger, index: TokenIndex, tracked_keys: int) -> None:
    """``tracked_keys`` distinct random keys into each, in batches."""
    rng = np.random.default_rng(0)
    stored_at = time.time() - 600
    for start in range(0, tracked_keys, FILL_BATCH):
        count = min(FILL_BATCH, tracked_keys - start)
        ledger.note(_random_keys(rng, count), "evicted", "disk", stored_at=stored_at)
        index.note(_random_keys(rng, count), HOLDING)


def _prompt_blocks(tokens: np.ndarray) -> list[KVBlock]:
    """The prompt's full records with zero payloads (a lookup reads no payload)."""
    shape = (LAYOUT.num_layers, 2, RECORD_TOKENS, LAYOUT.num_kv_heads, LAYOUT.head_dim)
    payload = bytes(LAYOUT.block_bytes)
    return [
        KVBlock(key, NS.fingerprint, LAYOUT.dtype, shape, RECORD_TOKENS, payload)
        for key in block_keys(NS, tokens)
    ]


def _timed(
    lookup: Callable[[], object], explain: dict[str, Callable[[], object]], rounds: int
) -> dict[str, float]:
    return interleaved_medians({"lookup": lookup, **explain}, rounds, warmup=20)


def measure(folder: Path, tracked_keys: int, rounds: int) -> dict[str, Any]:
    """The figures of the module docstring.

    Args:
        folder: an empty folder for the disk tier.
        tracked_keys: the size of each shadow structure, and how many keys fill it.
        rounds: timed rounds of each measured call.
    """
    ledger, index = MissLedger(tracked_keys), TokenIndex(tracked_keys)
    _fill(ledger, index, tracked_keys)
    tokens = np.random.default_rng(1).integers(0, 50_000, PROMPT_TOKENS)
    blocks = _prompt_blocks(tokens)
    keys, tkeys = [b.key for b in blocks], token_keys(tokens, RECORD_TOKENS)
    half = len(keys) // 2
    ledger.note(keys[half : half + half // 2], "evicted", "cpu", stored_at=time.time() - 120)
    index.note(tkeys, HOLDING)
    missed, missed_tokens = keys[half:], tkeys[half:]  # sliced once: the calls are timed
    first_key = missed[:1]
    explain = {
        "explain_first": lambda: (
            ledger.explain(first_key),
            index.holder(missed_tokens[0], ASKING),
        ),
        "explain_all": lambda: (ledger.explain(missed), index.holders(missed_tokens, ASKING)),
    }
    disk = DiskTier(DiskTierConfig(str(folder), 1 << 30, fsync=False))
    with TieredStore([CPUTier(CPUTierConfig(1 << 30)), disk]) as store:
        store.put_many(NS.id, blocks[:half])
        if not store.flush(timeout=60):
            raise RuntimeError("the disk tier did not take the prompt's records in time")

        def lookup() -> object:
            return store.lookup(NS.id, keys)

        if store.lookup(NS.id, keys).num_blocks != half:
            raise RuntimeError("the store does not hold the prompt's first half")
        upto_miss = tokens[: (half + 1) * RECORD_TOKENS]
        hashing = {"token_keys": lambda: token_keys(upto_miss, RECORD_TOKENS)}
        warm = _timed(lookup, {**explain, **hashing}, rounds)
        store.tiers[0].delete(NS.id, keys[:half])  # a restart: the CPU tier is empty
        if store.lookup(NS.id, keys).num_blocks != half:
            raise RuntimeError("the disk tier does not hold the prompt's first half")
        cold = _timed(lookup, explain, rounds)
    return {
        "tracked_keys": tracked_keys,
        "lookup_keys": len(keys),
        "lookup_hits": half,
        "missed_keys": len(keys) - half,
        "ledger_bytes": ledger.nbytes,
        "ledger_bytes_per_key": round(ledger.nbytes / tracked_keys, 2),
        "ledger_entries": len(ledger),
        "index_bytes": index.nbytes,
        "index_bytes_per_key": round(index.nbytes / tracked_keys, 2),
        "index_entries": len(index),
        "lookup_median_s": warm["lookup"],
        "explain_all_median_s": warm["explain_all"],
        "explain_first_median_s": warm["explain_first"],
        "token_keys_median_s": warm["token_keys"],
        "why_miss_overhead": round(warm["explain_first"] / warm["lookup"], 4),
        "why_miss_overhead_all_keys": round(warm["explain_all"] / warm["lookup"], 4),
        "token_keys_overhead": round(warm["token_keys"] / warm["lookup"], 4),
        "lookup_restart_median_s": cold["lookup"],
        "why_miss_overhead_restart": round(cold["explain_first"] / cold["lookup"], 4),
        "why_miss_overhead_all_keys_restart": round(cold["explain_all"] / cold["lookup"], 4),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--tracked-keys", type=int, default=1_000_000)
    parser.add_argument("--rounds", type=int, default=3000)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-why-miss-", dir=".") as tmp:
        emit(measure(Path(tmp), args.tracked_keys, args.rounds), args.json)


if __name__ == "__main__":
    main()
