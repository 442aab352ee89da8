"""Tier throughput against the raw operation each tier wraps, measured in the same run.

Blocks: 16 tokens of SmolLM2-135M KV (30 layers x K/V x 3 heads x 64 dims, fp16: 360 KiB) and
256-token chunks (5.6 MiB). Every ratio is ours / baseline on the same bytes; > 1 means faster.

    python -m benchmarks.tiers --json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import tempfile
from pathlib import Path

import numpy as np
import redis

from benchmarks.support.children import REPO_ROOT, module_command
from benchmarks.support.kv_blocks import SMOLLM2, make_blocks
from benchmarks.support.output import emit
from benchmarks.support.timing import interleaved_medians, settle
from benchmarks.support.workdir import disk_work_dir
from cachetier.primitives.keys import KVLayout, Namespace, block_keys
from cachetier.record import KVBlock
from cachetier.tiers.cpu import CPUTier, CPUTierConfig
from cachetier.tiers.disk.tier import DiskTier, DiskTierConfig


def copy_into(dest: memoryview, buffers: list) -> None:
    """Copy buffers back to back into ``dest`` (what a restore into a KV pool does)."""
    offset = 0
    for buf in buffers:
        n = memoryview(buf).nbytes
        dest[offset : offset + n] = memoryview(buf).cast("B")
        offset += n


def bench_cpu(ns: Namespace, blocks: list[KVBlock], repeats: int) -> dict[str, float]:
    tier = CPUTier(CPUTierConfig(capacity_bytes=1 << 34))
    tier.put_many(ns.id, blocks)
    keys = [b.key for b in blocks]
    sources = [bytes(b.data) for b in blocks]  # the same bytes, held outside the tier
    total = sum(len(s) for s in sources)
    dest = memoryview(bytearray(total))

    def ours() -> None:
        got = tier.get_many(ns.id, keys)
        copy_into(dest, [g.data for g in got if g is not None])

    def memcpy() -> None:
        copy_into(dest, sources)

    t = interleaved_medians({"ours": ours, "base": memcpy}, repeats)
    return {
        "ratio": t["base"] / t["ours"],
        "gbps": total / t["ours"] / 1e9,
        "base_gbps": total / t["base"] / 1e9,
    }


def bench_disk(
    ns: Namespace, blocks: list[KVBlock], repeats: int, root: Path, compression: str = "none"
) -> dict[str, float]:
    tier = DiskTier(DiskTierConfig(str(root), 1 << 40, compression=compression, fsync=False))
    tier.put_many(ns.id, blocks)
    keys = [b.key for b in blocks]
    paths = [tier.path_of(ns.id, k) for k in keys]
    total = sum(p.stat().st_size for p in paths)
    raw = sum(memoryview(b.data).nbytes for b in blocks)

    def ours() -> None:
        got = tier.get_many(ns.id, keys)
        assert all(g is not None for g in got), "disk tier lost a block during the benchmark"

    def raw_read() -> list[bytes]:
        # Keeps every buffer until the batch is done, as the caller of a get does: reading into
        # fresh memory (page faults, zeroing) is part of handing back data the caller keeps.
        out = []
        for p in paths:
            with open(p, "rb") as f:
                out.append(f.read())
        return out

    def raw_read_discard() -> None:
        # Drops each buffer at once, so the allocator hands the same warm memory back every
        # time: a bound no reader that keeps its data can reach; reported for transparency.
        for p in paths:
            with open(p, "rb") as f:
                f.read()

    # Warm page cache: both sides read the same files from memory.
    t = interleaved_medians(
        {"ours": ours, "base": raw_read, "discard": raw_read_discard}, repeats, warmup=2
    )
    return {
        "ratio": t["base"] / t["ours"],
        "ratio_discard": t["discard"] / t["ours"],
        "gbps": raw / t["ours"] / 1e9,
        "base_gbps": total / t["base"] / 1e9,
        "stored_bytes": total,
        "raw_bytes": raw,
        "seconds": t["ours"],
    }


def bench_redis(ns: Namespace, blocks: list[KVBlock], repeats: int, url: str) -> dict[str, float]:
    from cachetier.tiers.redis import RedisTier, RedisTierConfig

    prefix = f"bench-{os.getpid()}"
    tier = RedisTier(RedisTierConfig(url=url, key_prefix=prefix))
    client = redis.Redis.from_url(url)
    try:
        tier.put_many(ns.id, blocks)
        keys = [b.key for b in blocks]
        names = [f"{prefix}:{ns.id}:{k.hex()}" for k in keys]
        total = sum(len(v) for v in client.mget(names) if v)

        def ours() -> None:
            got = tier.get_many(ns.id, keys)
            assert all(g is not None for g in got), "redis tier missed during the benchmark"

        def raw_pipeline() -> None:
            pipe = client.pipeline(transaction=False)
            for name in names:
                pipe.get(name)
            pipe.execute()

        t = interleaved_medians({"ours": ours, "base": raw_pipeline}, repeats)
        return {
            "ratio": t["base"] / t["ours"],
            "gbps": total / t["ours"] / 1e9,
            "base_gbps": total / t["base"] / 1e9,
        }
    finally:
        tier.clear(ns.id)
        tier.close()
        client.close()


def bench_hash(block_size: int = 16, num_tokens: int = 1 << 20, repeats: int = 5) -> float:
    ns = Namespace("bench", KVLayout("float16", block_size, **SMOLLM2))
    tokens = np.random.default_rng(0).integers(0, 49_152, num_tokens).tolist()  # a plain list
    t = interleaved_medians({"hash": lambda: block_keys(ns, tokens)}, repeats)
    return num_tokens / t["hash"]


def run_section(section: str, args: argparse.Namespace, tmp: str) -> dict[str, float]:
    """One measurement: ``cpu``, ``disk``, ``redis`` at 16 or 256 tokens, or ``lz4``."""
    total = args.mib << 20
    name, _, tokens = section.partition(":")
    if name == "lz4":
        ns, blocks = make_blocks(256, total, seed=1)
        plain = bench_disk(ns, blocks, args.repeats, Path(tmp) / "lz4-plain")
        settle()
        packed = bench_disk(ns, blocks, args.repeats, Path(tmp) / "lz4", compression="lz4")
        return {
            "lz4_ratio": packed["raw_bytes"] / packed["stored_bytes"],
            "lz4_get_vs_plain": plain["seconds"] / packed["seconds"],
        }
    ns, blocks = make_blocks(int(tokens), total)
    suffix = "" if tokens == "16" else "_256"
    if name == "cpu":
        r = bench_cpu(ns, blocks, args.repeats)
        return {f"cpu_get_vs_memcpy{suffix}": r["ratio"], f"cpu_get_gbps{suffix}": r["gbps"]}
    if name == "disk":
        r = bench_disk(ns, blocks, args.repeats, Path(tmp) / f"disk{tokens}")
        return {
            f"disk_get_vs_raw_read{suffix}": r["ratio"],
            f"disk_get_vs_raw_read_discarding{suffix}": r["ratio_discard"],
            f"disk_get_gbps{suffix}": r["gbps"],
        }
    if name == "redis":
        r = bench_redis(ns, blocks, args.repeats, args.redis_url)
        return {
            f"redis_get_vs_raw_pipeline{suffix}": r["ratio"],
            f"redis_get_gbps{suffix}": r["gbps"],
        }
    raise ValueError(f"unknown section {section!r}")


SECTIONS = ["cpu:16", "disk:16", "redis:16", "cpu:256", "disk:256", "redis:256", "lz4"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--json", action="store_true", help="print one JSON object last")
    parser.add_argument("--mib", type=int, default=96, help="bytes per measurement, MiB")
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument(
        "--redis-url", default=os.environ.get("CACHETIER_REDIS_URL", "redis://127.0.0.1:6379/0")
    )
    parser.add_argument(
        "--data-dir", default=None, help="folder for the disk tier (default: a temp dir)"
    )
    parser.add_argument("--section", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(dir=disk_work_dir(args.data_dir, "--data-dir")) as tmp:
        if args.section:  # a child run: one section, its figures as JSON
            print(json.dumps(run_section(args.section, args, tmp)))
            return
        result: dict[str, object] = {
            "mib_per_measurement": args.mib,
            "repeats": args.repeats,
            "disk_page_cache": "warm (files read twice before timing)",
            "disk_baseline": (
                "open().read() of each file, buffers kept for the batch like a get's result"
            ),
            "lz4_data": "random-normal fp16",
            "isolation": "each section runs in a fresh process; ours and its baseline share it",
        }
        for section in SECTIONS:
            # A fresh process per section: heap state left by one measurement (glibc's
            # dynamic mmap threshold) otherwise tilts the next one by up to 40%.
            cmd = module_command(
                "benchmarks.tiers",
                *("--section", section, "--mib", str(args.mib), "--repeats", str(args.repeats)),
                *("--redis-url", args.redis_url),
            )
            if args.data_dir:
                cmd += ["--data-dir", args.data_dir]
            out = subprocess.run(
                cmd, cwd=REPO_ROOT, check=True, capture_output=True, text=True
            ).stdout
            result.update(json.loads(out.strip().splitlines()[-1]))
        result["hash_tokens_per_s"] = bench_hash()
        result["hash_block_size"] = 16
    emit(result, args.json)


if __name__ == "__main__":
    main()
