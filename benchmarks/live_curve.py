"""The live capacity curve (issue 66, part 3): what it costs a sidecar, and how near it comes to
the report's curve.

- ``live_curve_overhead``: a real ``cachetier serve`` process with ``live_curve`` on and one with
  it off (same settings otherwise, both running, idle in turn), driven by a real client
  (``RemoteTier``) as an engine drives it: per request of the shipped conversation trace, a
  lookup of its blocks, a get of the hit ones and a put of the missed ones (``--block-bytes``
  each). Each round both arms serve the same ``--requests`` requests (the next ones of the
  trace), in turn, their order swapped every round; the figure is the median over rounds of
  (requests per second on / off) minus 1. Target: ``|x| <= 0.01``. Beside it,
  ``live_curve_store_overhead``: the same through a ``TieredStore`` in this process (no HTTP,
  so the curve's share of the work is larger, and the figure steadier on a busy machine).
- ``live_curve_vs_replay_abs_diff``: every request of the trace looked up, in order, through a
  real sidecar whose CPU tier holds the report's 10,000 blocks and disk 50,000 (blocks of 64
  bytes, one put first so the curve knows their size); then its live curve (0.5, 1, 2 and 4
  times each) against ``cachetier report``'s default (sampled) LRU curve at the same 8
  capacities: the largest absolute difference in block hit ratio. Target: ``<= 0.01``. Beside
  it, both against an exact LRU replay (``live_curve_vs_exact_abs_diff``,
  ``report_vs_exact_abs_diff``).

    python -m benchmarks.live_curve --json [--requests 150] [--rounds 9] [--block-bytes 16384]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.support.admission_traces import CONVERSATION_TRACE
from benchmarks.support.output import emit
from cachetier.admission.live_curve import CAPACITY_FACTORS, factor_label
from cachetier.primitives.keys import BlockHash
from cachetier.record import KVBlock
from cachetier.report.config import ReportConfig
from cachetier.report.hierarchy_replay import replay_for_report
from cachetier.report.inputs import load_trace
from cachetier.report.replay import ReplayTrace
from cachetier.store.config import StoreConfig, build_store
from cachetier.store.tiered import TieredStore
from cachetier.tiers.remote import RemoteTier, RemoteTierConfig
from tests.server.live import TOKENS, ProcessServer, call_json, serve_env

OVERHEAD_TARGET = 0.01
DIFF_TARGET = 0.01
CPU_BLOCKS, DISK_BLOCKS = 10_000, 50_000  # the report's defaults
REPLAY_BLOCK_BYTES = 64
NS = "bench-live-curve"
FINGERPRINT = b"\x01" * 32


def _server(folder: Path, live: bool, cpu_bytes: int, disk_bytes: int) -> ProcessServer:
    folder.mkdir(parents=True, exist_ok=True)
    env = serve_env(cpu_bytes=cpu_bytes, disk_bytes=disk_bytes, live_curve=str(live).lower())
    env["CACHETIER_LOG_LEVEL"] = "warning"
    return ProcessServer(["--data-dir", str(folder)], env).start()


def _block(key: BlockHash, nbytes: int) -> KVBlock:
    return KVBlock(key, FINGERPRINT, "uint8", (nbytes,), 512, bytes(nbytes))


class _Engine:
    """One engine's traffic: per request, lookup, get the hit blocks, put the missed ones."""

    def __init__(self, url: str, block_bytes: int) -> None:
        self.tier = RemoteTier(RemoteTierConfig(url=url, token=TOKENS["alice"], timeout_s=30))
        self.block_bytes = block_bytes

    def run(self, requests: Sequence[Sequence[BlockHash]]) -> float:
        """Requests per second over ``requests``."""
        start = time.perf_counter()
        for keys in requests:
            found = self.tier.contains_prefix(NS, keys)
            if found:
                self.tier.get_many(NS, keys[:found])
            missed = [_block(k, self.block_bytes) for k in keys[found:]]
            if missed:
                self.tier.put_many(NS, missed)
        return len(requests) / (time.perf_counter() - start)


def overhead(folder: Path, trace: ReplayTrace, args: argparse.Namespace) -> dict[str, Any]:
    """Alternate the arms; the median of the per-round ratios."""
    cpu_bytes, disk_bytes = 4096 * args.block_bytes, 16_384 * args.block_bytes
    servers = {
        live: _server(folder / f"live-{live}", live, cpu_bytes, disk_bytes)
        for live in (False, True)
    }
    try:
        engines = {live: _Engine(s.url, args.block_bytes) for live, s in servers.items()}
        warm = trace.keys[: args.requests]
        for engine in engines.values():
            engine.run(warm)  # connections, first stores
        ratios, rates = [], {False: [], True: []}
        for round_ in range(args.rounds):
            # Both arms serve the same requests, the next ones of the trace each round.
            first = (round_ + 1) * args.requests % len(trace.keys)
            requests = trace.keys[first : first + args.requests]
            order = (False, True) if round_ % 2 == 0 else (True, False)
            got = {live: engines[live].run(requests) for live in order}
            for live, rate in got.items():
                rates[live].append(rate)
            ratios.append(got[True] / got[False])
        stats = call_json(servers[True].url, "GET", "/v1/stats", token=TOKENS["ops"])[1]
        for engine in engines.values():
            engine.tier.close()
    finally:
        for server in servers.values():
            server.stop()
    return {
        "live_curve_overhead": statistics.median(ratios) - 1,
        "overhead_ratios": [round(r, 4) for r in ratios],
        "requests_per_s_off": round(statistics.median(rates[False]), 1),
        "requests_per_s_on": round(statistics.median(rates[True]), 1),
        "overhead_block_bytes": args.block_bytes,
        "overhead_sample_rates": {t: c["sample_rate"] for t, c in stats["live_curve"].items()},
    }


def store_overhead(folder: Path, trace: ReplayTrace, args: argparse.Namespace) -> dict[str, Any]:
    """The same traffic through a ``TieredStore`` in this process (no HTTP): the curve's own
    cost against the store's work alone, arms alternating as above."""
    stores = {
        live: build_store(
            StoreConfig(
                cpu_bytes=4096 * args.block_bytes,
                disk_path=str(folder / f"store-{live}"),
                disk_bytes=16_384 * args.block_bytes,
                fsync=False,
                live_curve=live,
            )
        )
        for live in (False, True)
    }
    ratios = []
    try:
        for round_ in range(args.rounds):
            first = (round_ + 1) * args.requests % len(trace.keys)
            requests = trace.keys[first : first + args.requests]
            order = (False, True) if round_ % 2 == 0 else (True, False)
            got = {live: _in_store(stores[live], requests, args.block_bytes) for live in order}
            ratios.append(got[True] / got[False])
    finally:
        for store in stores.values():
            store.close()
    return {
        "live_curve_store_overhead": statistics.median(ratios) - 1,
        "store_overhead_ratios": [round(r, 4) for r in ratios],
    }


def _in_store(store: TieredStore, requests: Sequence[Sequence[BlockHash]], nbytes: int) -> float:
    start = time.perf_counter()
    for keys in requests:
        found = store.lookup(NS, keys).num_blocks
        if found:
            store.get_many(NS, keys[:found])
        if found < len(keys):
            store.put_many(NS, [_block(k, nbytes) for k in keys[found:]])
    return len(requests) / (time.perf_counter() - start)


def live_replay(folder: Path, trace: ReplayTrace) -> tuple[dict[str, dict[str, float]], float]:
    """The trace's lookups through a real sidecar; its live curve and the replay's seconds."""
    server = _server(
        folder / "replay", True, CPU_BLOCKS * REPLAY_BLOCK_BYTES, DISK_BLOCKS * REPLAY_BLOCK_BYTES
    )
    tier = RemoteTier(RemoteTierConfig(url=server.url, token=TOKENS["alice"], timeout_s=30))
    try:
        # One block outside the trace: the store learns the block size before the first lookup.
        tier.put_many(NS, [_block(BlockHash(b"\xee" * 32), REPLAY_BLOCK_BYTES)])
        start = time.perf_counter()
        for keys in trace.keys:
            tier.contains_prefix(NS, keys)
        seconds = time.perf_counter() - start
        stats = call_json(server.url, "GET", "/v1/stats", token=TOKENS["ops"])[1]
    finally:
        tier.close()
        server.stop()
    return stats["live_curve"], seconds


def exact_lru(requests: Sequence[Sequence[bytes]], capacity: int) -> float:
    """Block hit ratio of one LRU of ``capacity`` blocks, the report's definition of a hit."""
    held: OrderedDict[bytes, None] = OrderedDict()
    hits = total = 0
    for keys in requests:
        run = 0
        while run < len(keys) and keys[run] in held:
            run += 1
        hits += run
        total += len(keys)
        for k in keys:
            if k in held:
                held.move_to_end(k)
            else:
                held[k] = None
                if len(held) > capacity:
                    held.popitem(last=False)
    return hits / total


def versus_replay(folder: Path, trace: ReplayTrace) -> dict[str, Any]:
    """The live curve against the report's and an exact replay at the same capacities."""
    live, seconds = live_replay(folder, trace)
    points = {
        (tier, factor_label(f)): round(f * blocks)
        for tier, blocks in (("cpu", CPU_BLOCKS), ("disk", DISK_BLOCKS))
        for f in CAPACITY_FACTORS
    }
    capacities = tuple(sorted(set(points.values())))
    config = ReportConfig(
        trace="<benchmark>",
        capacities=capacities,
        curve_policies=("lru",),
        admission_policies=(),
        quiet=True,
    )
    replays = replay_for_report(trace, config)
    report = dict(zip(config.curve_capacities, (p.block_hit_ratio for p in replays.curve["lru"])))
    rows = {}
    for (tier, label), capacity in points.items():
        exact = exact_lru(trace.keys, capacity)
        rows[f"{tier}x{label}"] = {
            "capacity_blocks": capacity,
            "live": round(live[tier]["hit_ratio"][label], 5),
            "report": round(report[capacity], 5),
            "exact": round(exact, 5),
        }
    return {
        "live_curve_vs_replay_abs_diff": max(abs(r["live"] - r["report"]) for r in rows.values()),
        "live_curve_vs_exact_abs_diff": max(abs(r["live"] - r["exact"]) for r in rows.values()),
        "report_vs_exact_abs_diff": max(abs(r["report"] - r["exact"]) for r in rows.values()),
        "live_sample_rates": {t: c["sample_rate"] for t, c in live.items()},
        "report_sample_rate": replays.sample_rate,
        "live_replay_lookups": len(trace.keys),
        "live_replay_s": round(seconds, 1),
        "points": rows,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--requests", type=int, default=150, help="per arm and round")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--block-bytes", type=int, default=16 << 10, help="overhead's blocks")
    parser.add_argument("--skip-overhead", action="store_true")
    parser.add_argument("--skip-replay", action="store_true")
    args = parser.parse_args()
    trace = load_trace(str(CONVERSATION_TRACE))
    result: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="bench-live-curve-") as tmp:
        if not args.skip_overhead:
            result.update(store_overhead(Path(tmp), trace, args))
            result.update(overhead(Path(tmp), trace, args))
        if not args.skip_replay:
            result.update(versus_replay(Path(tmp), trace))
    if "live_curve_overhead" in result:
        result["overhead_target_met"] = abs(result["live_curve_overhead"]) <= OVERHEAD_TARGET
    if "live_curve_vs_replay_abs_diff" in result:
        result["replay_target_met"] = result["live_curve_vs_replay_abs_diff"] <= DIFF_TARGET
    emit(result, args.json)


if __name__ == "__main__":
    main()
