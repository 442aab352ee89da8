"""The sidecar server: remote-tier throughput against raw Redis, tail latency under concurrent
clients, and a load test with every read verified.

A real ``cachetier serve`` (uvicorn, CPU + disk tiers in a temp folder) runs as a child
process on 127.0.0.1; clients are ``RemoteTier``s in this process. Blocks are 256 tokens of
SmolLM2-135M KV (30 layers x K/V x 3 heads x 64 dims, fp16: 5.6 MiB each).

- ``remote_get_vs_redis``: GB/s of one batched ``RemoteTier.get_many`` of every block
  (decoded and checked) over GB/s of a redis-py pipeline GET of the same record bytes from the
  local Redis; interleaved medians of the same run. > 1 means the server path is faster.
- ``batched_vs_per_block_get``: the same batch as one request vs one request per block
  (all in flight at once through the async API): why the API has batch endpoints.
- ``p99_get_ms``: 16 clients (own tier, own connections, own thread) each fetching one
  5.6 MiB block at a time for ``--p99-seconds``.
- ``load_test``: 32 clients for 60 s, each putting (1-4 blocks) and getting (1-8 blocks) its
  own 16-token blocks at random, each read checked against the payload its key first held
  (records are immutable: a put of a key held already keeps the first record); then the server
  is restarted (SIGTERM, so it flushes) and every acknowledged block is read back. ``errors``,
  ``corrupt`` and ``lost_acknowledged`` must be 0; ``server_peak_rss_mib`` is the server's VmHWM.

    python -m benchmarks.server --json [--load-seconds 60]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
import threading
import time
from typing import Any

import redis

from benchmarks.support.kv_blocks import make_blocks
from benchmarks.support.output import emit
from benchmarks.support.server_load import run_load, verify_all
from benchmarks.support.sidecar import TOKEN, Server
from benchmarks.support.timing import interleaved_medians
from benchmarks.support.workdir import disk_work_dir
from cachetier.primitives.keys import Namespace
from cachetier.record import KVBlock, encode_record
from cachetier.tiers.remote import RemoteTier, RemoteTierConfig


def bench_throughput(
    server: Server, ns: Namespace, blocks: list[KVBlock], repeats: int, redis_url: str
) -> dict[str, float]:
    tier = RemoteTier(RemoteTierConfig(url=server.url, token=TOKEN, timeout_s=60))
    client = redis.Redis.from_url(redis_url)
    names = [f"bench-server-{os.getpid()}:{b.key.hex()}" for b in blocks]
    keys = [b.key for b in blocks]
    try:
        start = time.perf_counter()
        assert tier.put_many(ns.id, blocks) == len(blocks), "the server refused the blocks"
        put_s = time.perf_counter() - start
        records = [encode_record(b) for b in blocks]
        for name, record in zip(names, records):
            client.set(name, record)
        total = sum(map(len, records))

        def ours() -> None:
            got = tier.get_many(ns.id, keys)
            assert all(g is not None for g in got), "the server missed during the benchmark"

        def raw_pipeline() -> None:
            pipe = client.pipeline(transaction=False)
            for name in names:
                pipe.get(name)
            pipe.execute()

        def per_block() -> None:
            async def all_at_once() -> list:
                return await asyncio.gather(*[tier.aget_many(ns.id, [k]) for k in keys])

            assert all(g[0] is not None for g in asyncio.run(all_at_once()))

        t = interleaved_medians({"ours": ours, "base": raw_pipeline, "one": per_block}, repeats)
        assert tier.stats()["errors"] == 0
        return {
            "remote_get_vs_redis": t["base"] / t["ours"],
            "remote_get_gbps": total / t["ours"] / 1e9,
            "redis_pipeline_get_gbps": total / t["base"] / 1e9,
            "batched_vs_per_block_get": t["one"] / t["ours"],
            "remote_put_gbps": total / put_s / 1e9,
        }
    finally:
        client.delete(*names)
        client.close()
        tier.close()


def bench_p99(
    server: Server, ns: Namespace, blocks: list[KVBlock], num_clients: int, seconds: float
) -> dict[str, float]:
    samples: list[list[float]] = [[] for _ in range(num_clients)]
    misses = [0] * num_clients
    stop_at = time.monotonic() + seconds

    def client(i: int) -> None:
        tier = RemoteTier(RemoteTierConfig(url=server.url, token=TOKEN, timeout_s=60))
        try:
            n = i
            while time.monotonic() < stop_at:
                key = blocks[n % len(blocks)].key
                start = time.perf_counter()
                got = tier.get_many(ns.id, [key])[0]
                samples[i].append(time.perf_counter() - start)
                misses[i] += got is None
                n += 1
        finally:
            tier.close()

    threads = [threading.Thread(target=client, args=(i,)) for i in range(num_clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    every = sorted(s for per in samples for s in per)
    block_bytes = len(encode_record(blocks[0]))
    return {
        "p99_get_ms": 1e3 * every[min(len(every) - 1, int(0.99 * len(every)))],
        "p50_get_ms": 1e3 * statistics.median(every),
        "p99_clients": num_clients,
        "p99_gets": len(every),
        "p99_misses": sum(misses),
        "p99_aggregate_gbps": len(every) * block_bytes / seconds / 1e9,
    }


def bench_load(server: Server, args: argparse.Namespace) -> dict[str, Any]:
    start = time.monotonic()
    clients = run_load(server.url, TOKEN, args.load_clients, args.load_seconds, args.load_keys)
    elapsed = time.monotonic() - start
    peak_rss = server.peak_rss_mib()
    lost_during = sum(c.result.lost_acknowledged for c in clients)
    server.stop()  # SIGTERM: the server flushes its write queues before it exits
    server.start()
    verify_all(clients)
    for c in clients:
        c.close()
    results = [c.result for c in clients]
    return {
        "clients": args.load_clients,
        "seconds": round(elapsed, 1),
        "ops": sum(r.ops for r in results),
        "puts": sum(r.puts for r in results),
        "gets": sum(r.gets for r in results),
        "gbps": sum(r.bytes_moved for r in results) / elapsed / 1e9,
        "errors": sum(r.errors for r in results),
        "failed_puts": sum(r.failed_puts for r in results),
        "corrupt": sum(r.corrupt for r in results),
        "lost_acknowledged": sum(r.lost_acknowledged for r in results),
        "lost_acknowledged_during_run": lost_during,
        "acknowledged_blocks_checked_after_restart": sum(len(r.acked) for r in results),
        "server_peak_rss_mib": round(peak_rss, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--json", action="store_true", help="print one JSON object last")
    parser.add_argument("--mib", type=int, default=96, help="bytes per throughput batch, MiB")
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--p99-clients", type=int, default=16)
    parser.add_argument("--p99-seconds", type=float, default=10.0)
    parser.add_argument("--load-clients", type=int, default=32)
    parser.add_argument("--load-seconds", type=float, default=60.0)
    parser.add_argument("--load-keys", type=int, default=16, help="blocks each client owns")
    parser.add_argument("--no-fsync", action="store_true", help="server skips fsync per record")
    parser.add_argument(
        "--redis-url", default=os.environ.get("CACHETIER_REDIS_URL", "redis://127.0.0.1:6379/0")
    )
    parser.add_argument("--data-dir", default=None, help="parent of the server's temp folder")
    args = parser.parse_args()
    ns, blocks = make_blocks(256, args.mib << 20)
    with tempfile.TemporaryDirectory(dir=disk_work_dir(args.data_dir, "--data-dir")) as tmp:
        server = Server(tmp, fsync=not args.no_fsync)
        server.start()
        try:
            result: dict[str, Any] = {
                "block_tokens": 256,
                "block_mib": round(blocks[0].nbytes / (1 << 20), 2),
                "blocks_per_batch": len(blocks),
                "repeats": args.repeats,
                "server": "cachetier serve (uvicorn), CPU 4 GiB + disk tiers, "
                f"fsync={'off' if args.no_fsync else 'on'}, sync puts",
                "baseline": "redis-py pipeline GET of the same record bytes, local Redis",
            }
            result.update(bench_throughput(server, ns, blocks, args.repeats, args.redis_url))
            result.update(bench_p99(server, ns, blocks, args.p99_clients, args.p99_seconds))
            result["load_test"] = bench_load(server, args)
        finally:
            server.stop()
    emit(result, args.json)


if __name__ == "__main__":
    main()
