"""What a sidecar put costs in CPU, client and server together, against LMCache's ``lm://``.

``make bench-peers`` times puts; this says why a put acknowledged after its disk write
(``server_put_durable_speedup``) stays under 1.0 on a small machine. Each side puts the same 16
chunks, in turn, for ``--repeats`` rounds: our server with its disk tier (the default: the answer
comes after the disk write), ours with the disk tier left out (memory only, like LMCache's
server), and LMCache 0.5.6's own server. Per put it records the wall time and the CPU time of
the client (this process, every thread) and of that side's server process (every thread), read
from ``/proc/<pid>/task/*/schedstat`` (nanoseconds of CPU, not 10 ms ticks).

A put cannot finish before its CPU work is done on the cores it has, so with ``cores`` cores
``cpu / cores`` is the least wall time any overlap of its steps could reach. The figure
``durable_floor_speedup_<shape>`` is LMCache's median wall time over that floor for our
durable put: the most ``server_put_durable_speedup`` could be on this machine without doing
less work. ``cpu_vs_lmcache_<side>_<shape>`` is LMCache's CPU per put over ours (> 1: ours
spends less); LMCache's client CPU includes the harness's wait for its put, which LMCache
sends without an answer (``PeerStore.put`` polls every 0.2 ms), so these ratios lean our way.

    make setup-peers
    LMCACHE_TRACK_USAGE=false .venv-peers/bin/python -m benchmarks.put_cpu --json
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.peers.common import SHAPES, ChunkSet, Timed, interleaved_checked, make_chunks
from benchmarks.peers.lmcache import LMServer, PeerStore, release
from benchmarks.peers.sections import ours_put_run
from benchmarks.support.children import free_port
from benchmarks.support.output import emit
from benchmarks.support.sidecar import TOKEN, Server
from benchmarks.support.timing import cpu_ns
from benchmarks.support.workdir import disk_work_dir
from cachetier.tiers.remote import RemoteTier, RemoteTierConfig


def summary(ops: dict[str, Any], name: str, cores: int) -> dict[str, float]:
    """One side's medians per put, in milliseconds, and the wall-time floor of its CPU on
    ``cores`` (from ``interleaved_checked``'s samples of it)."""
    client, server = ops[f"{name}_client_cpu"], ops[f"{name}_server_cpu"]
    cpu = statistics.median(c + s for c, s in zip(client, server, strict=True)) / 1e9
    return {
        "wall_ms": 1e3 * ops[name],
        "client_cpu_ms": 1e3 * statistics.median(client) / 1e9,
        "server_cpu_ms": 1e3 * statistics.median(server) / 1e9,
        "cpu_ms": 1e3 * cpu,
        "floor_ms": 1e3 * cpu / cores,
    }


def measure(chunks: ChunkSet, repeats: int, work: Path) -> dict[str, Any]:
    """Every side's put, ``repeats`` rounds after one warm-up round (connections, pools and
    spares settle); sides alternate within a round so that drift hits them alike. Each put's
    CPU: this process's (the client, every thread) and its server's, read around the put.
    Each put returns once its server answered a request sent after the chunks (ours: the
    put's reply; LMCache: an EXIST on the same connection), so the server's work on them is
    counted; bookkeeping it does after answering may be left out."""
    durable = Server(str(work / "durable"), fsync=False)
    memonly = Server(str(work / "memonly"), fsync=False)
    memonly.env["CACHETIER_DISK_BYTES"] = "0"
    closers: list[Callable[[], None]] = []
    try:
        runs: dict[str, Timed] = {}
        server_pids: dict[str, int] = {}
        for name, server in (("ours_put", durable), ("ours_put_memonly", memonly)):
            server.start()
            closers.append(server.stop)
            assert server.proc is not None
            tier = RemoteTier(RemoteTierConfig(url=server.url, token=TOKEN, timeout_s=60))
            closers.append(tier.close)
            # ``before`` each put, untimed, deletes the chunks so that every put stores (our
            # disk tier skips a record it already holds).
            runs[name] = ours_put_run(tier, chunks)
            server_pids[name] = server.proc.pid
        runs["lmcache_put"], server_pids["lmcache_put"] = lmcache_run(chunks, closers)
        me = os.getpid()
        meters = {
            "client_cpu": lambda _: cpu_ns(me),
            "server_cpu": lambda name: cpu_ns(server_pids[name]),
        }
        ops = interleaved_checked(runs, repeats, warmup=1, meters=meters)
    finally:
        for close in reversed(closers):
            close()
    cores = len(os.sched_getaffinity(0))
    out: dict[str, Any] = {"cores": cores, "repeats": repeats}
    out.update({name: summary(ops, name, cores) for name in runs})
    return out


def lmcache_run(chunks: ChunkSet, closers: list[Callable[[], None]]) -> tuple[Timed, int]:
    """LMCache's storage manager putting the staged chunks to its own ``lm://`` server, and
    that server's pid."""
    server = LMServer(free_port())
    server.start()
    closers.append(server.kill)
    store = PeerStore("server", chunks, f"put-cpu-{os.getpid()}", remote_url=server.url)
    closers.append(store.close)
    staged = store.stage(chunks.payloads)
    closers.append(lambda: release(staged))  # before the store closes (closers run last first)
    assert server.proc is not None
    # LMCache's server overwrites its dict entries: nothing to forget before a put.
    return Timed(lambda: store.put(staged)), server.proc.pid


def figures(shapes: dict[str, dict[str, Any]]) -> dict[str, float]:
    """The ratios of the module docstring, per shape."""
    out: dict[str, float] = {}
    for shape, got in shapes.items():
        theirs = got["lmcache_put"]
        out[f"durable_floor_speedup_{shape}"] = theirs["wall_ms"] / got["ours_put"]["floor_ms"]
        out[f"durable_speedup_{shape}"] = theirs["wall_ms"] / got["ours_put"]["wall_ms"]
        for side in ("ours_put", "ours_put_memonly"):
            out[f"cpu_vs_lmcache_{side}_{shape}"] = theirs["cpu_ms"] / got[side]["cpu_ms"]
    return {k: round(v, 3) for k, v in out.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--chunks", type=int, default=16, help="chunks per put")
    parser.add_argument("--repeats", type=int, default=15, help="rounds, after one warm-up")
    parser.add_argument("--work", default=None, help="scratch folder (default: a temp one)")
    parser.add_argument("--json", action="store_true", help="print the result as JSON last")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(dir=disk_work_dir(args.work, "--work"), prefix="put-cpu-"))
    try:
        shapes = {
            shape: measure(make_chunks(shape, args.chunks), args.repeats, root / shape)
            for shape in args.shapes
        }
    finally:
        shutil.rmtree(root, ignore_errors=True)
    result: dict[str, Any] = figures(shapes)
    result["shapes"] = shapes
    emit(result, args.json)


if __name__ == "__main__":
    main()
