"""The measurements of ``benchmarks.peers``: each runs ours and LMCache's side in one process,
in turn.

Every function takes a ``ChunkSet`` (the same bytes for both sides) and returns plain figures:
median seconds per batch under ``<side>_<op>`` (sides ``ours``, ``lmcache``, and ``raw`` for
the bare operation under a tier, a bound) and median minor page faults under ``..._minflt``.
Each read is compared byte for byte with what was stored, after its clock stops.

Timed operations (one call = the whole batch of chunks):

- ``get_ret``: the tier's get as each API returns it. Ours: ``get_many`` -> ``KVBlock``s (CPU: the
  stored immutable bytes, no copy; disk/Redis/server: fresh buffers, record checksum verified).
  LMCache: ``StorageManager.batched_get`` -> ``MemoryObj``s (CPU: the stored object, no copy;
  other tiers: a slot of its pre-allocated pool, nothing verified); their ``ref_count_down``
  runs after the clock stops.
- ``get_one``: as ``get_ret``, one chunk per call (ours ``get_many([key])``, LMCache
  ``StorageManager.get(key)``): the latency of a single chunk, the unit of the issue's probe.
- ``get_buf``: the chunks landed in one caller-owned, pre-faulted buffer (what a restore into a
  KV pool does). Ours: ``get_into`` (disk reads straight into it; other tiers copy). LMCache:
  ``batched_get`` then a copy of each object into the buffer.
- ``put``: store the batch and return once the tier holds it (ours: ``put_many`` returns after
  the write is acknowledged; LMCache: ``batched_put`` plus waiting for its queued writes, see
  ``PeerStore.put``). Keys are deleted before each sample, untimed (``lm://`` has no delete:
  LMCache's server puts overwrite).
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import redis

from benchmarks.peers.common import (
    ChunkSet,
    Destination,
    Timed,
    check_buffers,
    drop_from_page_cache,
    files_under,
    interleaved_checked,
    recv_exactly,
    resident_bytes,
)
from benchmarks.peers.lmcache import LMServer, PeerStore, byte_view, release
from benchmarks.support.children import REPO_ROOT, free_port
from benchmarks.support.sidecar import TOKEN, Server
from cachetier.protocol.sockets import BufferedSocket
from cachetier.record import encode_parts, encode_record
from cachetier.tiers.base import Tier
from cachetier.tiers.cpu import CPUTier, CPUTierConfig
from cachetier.tiers.disk.tier import DiskTier, DiskTierConfig
from cachetier.tiers.redis import RedisTier, RedisTierConfig
from cachetier.tiers.redis.resp import Endpoint, command
from cachetier.tiers.remote import RemoteTier, RemoteTierConfig


def get_runs(ours: Tier, theirs: PeerStore, chunks: ChunkSet, suffix: str = "") -> dict[str, Timed]:
    """The get measurements of one tier pair (see the module docstring)."""
    ns, keys, payloads = chunks.namespace.id, [b.key for b in chunks.blocks], chunks.payloads
    dest = Destination(chunks)

    def check_ours(got: list) -> None:
        check_buffers([None if g is None else g.data for g in got], payloads, "ours")

    def check_theirs(got: list) -> None:
        try:
            check_buffers([None if g is None else byte_view(g) for g in got], payloads, "LMCache")
        finally:
            release(got)

    def check_dest_theirs(got: list) -> None:
        try:
            if any(g is None for g in got):
                raise AssertionError("LMCache missed a chunk")
            dest.check()
        finally:
            release(got)

    def ours_one_by_one() -> list:
        return [ours.get_many(ns, [key])[0] for key in keys]

    return {
        f"ours_get_one{suffix}": Timed(ours_one_by_one, check_ours),
        f"lmcache_get_one{suffix}": Timed(theirs.get_one_by_one, check_theirs),
        f"ours_get_ret{suffix}": Timed(lambda: ours.get_many(ns, keys), check_ours),
        f"lmcache_get_ret{suffix}": Timed(theirs.get, check_theirs),
        f"ours_get_buf{suffix}": Timed(
            lambda: ours.get_into(ns, keys, dest.views), lambda _: dest.check(), dest.scrub
        ),
        f"lmcache_get_buf{suffix}": Timed(
            lambda: theirs.get_into(dest.views), check_dest_theirs, dest.scrub
        ),
    }


def ours_put_run(ours: Tier, chunks: ChunkSet) -> Timed:
    """Our ``put_many`` of the batch; keys deleted before each sample (untimed)."""
    ns, keys, blocks = chunks.namespace.id, [b.key for b in chunks.blocks], list(chunks.blocks)

    def check(stored: int) -> None:
        if stored != len(blocks) or ours.contains_prefix(ns, keys) != len(keys):
            raise AssertionError(f"ours stored {stored} of {len(blocks)} chunks")

    return Timed(lambda: ours.put_many(ns, blocks), check, lambda: ours.delete(ns, keys))


def put_runs(
    ours: Tier, theirs: PeerStore, chunks: ChunkSet, forget_theirs: Any
) -> dict[str, Timed]:
    """Put measurements; ``forget_theirs()`` removes LMCache's copies before each sample."""
    staged = theirs.stage(chunks.payloads)

    def check_theirs(_: None) -> None:
        if theirs.count_found() != len(chunks.blocks):
            raise AssertionError("LMCache does not hold every chunk after its put")

    return {
        "ours_put": ours_put_run(ours, chunks),
        "lmcache_put": Timed(lambda: theirs.put(staged), check_theirs, forget_theirs),
    }


def fill(ours: Tier, theirs: PeerStore, chunks: ChunkSet) -> None:
    """Store the chunk set on both sides (untimed)."""
    stored = ours.put_many(chunks.namespace.id, list(chunks.blocks))
    assert stored == len(chunks.blocks), f"ours stored {stored} of {len(chunks.blocks)} chunks"
    staged = theirs.stage(chunks.payloads)
    theirs.put(staged)
    release(staged)


def bench_cpu(chunks: ChunkSet, repeats: int) -> dict[str, Any]:
    ours = CPUTier(CPUTierConfig(capacity_bytes=4 << 30))
    theirs = PeerStore("cpu", chunks, f"peers-{os.getpid()}")
    try:
        fill(ours, theirs, chunks)
        runs = get_runs(ours, theirs, chunks)
        runs["raw_copy_get_buf"] = raw_copy_run(chunks)
        return interleaved_checked(runs, repeats * 4, warmup=3)
    finally:
        theirs.close()


def raw_copy_run(chunks: ChunkSet) -> Timed:
    """The bound of a one-thread get into a caller's buffer from memory: the chunks' bytes
    copied into it, one memoryview assignment each (what LMCache's get plus the copy does)."""
    dest = Destination(chunks)
    sources = [memoryview(p) for p in chunks.payloads]

    def copy_all() -> None:
        for view, source in zip(dest.views, sources):
            view[:] = source

    return Timed(copy_all, lambda _: dest.check(), dest.scrub)


def bench_disk(chunks: ChunkSet, repeats: int, tmp: Path) -> dict[str, Any]:
    ours = DiskTier(DiskTierConfig(str(tmp / "ours"), 1 << 40, fsync=False))
    theirs = PeerStore("disk", chunks, f"peers-{os.getpid()}", disk_path=str(tmp / "lmcache"))
    try:
        fill(ours, theirs, chunks)
        files = files_under(tmp)
        ours_files = [ours.path_of(chunks.namespace.id, b.key) for b in chunks.blocks]
        warm_runs = get_runs(ours, theirs, chunks)
        warm_runs["raw_read_get_ret"] = raw_read_run(ours_files, chunks)
        warm_runs["raw_readinto_get_buf"] = raw_readinto_run(ours_files, chunks)
        warm = interleaved_checked(warm_runs, repeats, warmup=2)

        def drop() -> None:
            drop_from_page_cache(files)

        cold_runs = get_runs(ours, theirs, chunks, suffix="_cold")
        cold_runs["raw_read_get_ret_cold"] = raw_read_run(ours_files, chunks)
        cold_runs["raw_readinto_get_buf_cold"] = raw_readinto_run(ours_files, chunks)
        for run in cold_runs.values():
            inner = run.before
            run.before = drop if inner is None else (lambda inner=inner: (inner(), drop()))
        drop()
        left = resident_bytes(files)
        cold = interleaved_checked(cold_runs, repeats, warmup=1)
        return {**warm, **cold, "resident_bytes_after_drop": left}
    finally:
        theirs.close()


def raw_readinto_run(paths: list[Path], chunks: ChunkSet) -> Timed:
    """The bound of a one-thread disk get into a caller's buffer: each record file's payload
    read straight into the buffer (one ``preadv`` at its offset), no header, no checksum."""
    dest = Destination(chunks)

    def read_all() -> None:
        for path, view in zip(paths, dest.views):
            fd = os.open(path, os.O_RDONLY)
            try:
                os.preadv(fd, [view], os.fstat(fd).st_size - view.nbytes)
            finally:
                os.close(fd)

    return Timed(read_all, lambda _: dest.check(), dest.scrub)


def raw_read_run(paths: list[Path], chunks: ChunkSet) -> Timed:
    """The bound of any reader that hands back fresh buffers: ``open().read()`` of our record
    files, one thread, nothing checked but (after the clock) that each ends with its payload."""

    def read_all() -> list[bytes]:
        out = []
        for path in paths:
            with open(path, "rb") as f:
                out.append(f.read())
        return out

    def check(got: list[bytes]) -> None:
        if not all(r.endswith(p) for r, p in zip(got, chunks.payloads)):
            raise AssertionError("a record file does not end with its chunk's bytes")

    return Timed(read_all, check)


def bench_redis(chunks: ChunkSet, repeats: int, redis_url: str) -> dict[str, Any]:
    prefix = f"peers-{os.getpid()}"
    ours = RedisTier(RedisTierConfig(url=redis_url, key_prefix=prefix, socket_timeout_s=30))
    theirs = PeerStore("redis", chunks, f"{prefix}-lmcache", remote_url=redis_url)
    client = redis.Redis.from_url(redis_url)
    try:
        fill(ours, theirs, chunks)
        runs = get_runs(ours, theirs, chunks)
        # The bound of any redis-py client: a pipeline GET of our records, nothing checked.
        names = [ours.storage_key(chunks.namespace.id, b.key) for b in chunks.blocks]
        runs["raw_pipeline_get_ret"] = Timed(lambda: _pipeline_get(client, names))
        runs["raw_sockets_get_buf"], close_raw = raw_resp_run(redis_url, names, chunks)
        try:
            out = interleaved_checked(runs, repeats, warmup=1)
        finally:
            close_raw()
        runs = put_runs(ours, theirs, chunks, lambda: client.delete(*theirs.redis_names()))
        # The bound of one redis-py pipeline: SET of our encoded records under other names.
        records = [encode_record(b) for b in chunks.blocks]
        raw_names = [f"{prefix}-raw:{i}" for i in range(len(records))]
        runs["raw_pipeline_put"] = Timed(
            lambda: _pipeline_set(client, raw_names, records),
            before=lambda: client.delete(*raw_names),
        )
        out.update(interleaved_checked(runs, repeats, warmup=1))
        return out
    finally:
        ours.clear(chunks.namespace.id)
        ours.close()
        client.delete(*theirs.redis_names())
        for match in (f"{prefix}-raw:*", f"{prefix}-lmcache*"):
            for name in client.scan_iter(match=match, count=1000):
                client.delete(name)
        client.close()
        theirs.close()


def raw_resp_run(redis_url: str, names: list[str], chunks: ChunkSet) -> tuple[Timed, Any]:
    """The floor of any Redis client here: pipelined GETs of our records over 4 bare sockets
    in 4 threads (as our tier spreads a batch), each reply read with ``recv_into`` into a
    buffer of its own; nothing parsed but the bulk length, nothing checked."""
    endpoint = Endpoint.from_url(redis_url, 5.0, 30.0)
    assert endpoint is not None and endpoint.host is not None, "a redis:// url over TCP"
    streams = 4
    groups = [list(range(i, len(names), streams)) for i in range(streams)]
    conns = [BufferedSocket.connect_tcp(endpoint.host, endpoint.port, 5.0, 30.0) for _ in groups]
    sizes = [len(encode_record(b)) for b in chunks.blocks]
    buffers = [memoryview(np.empty(n, dtype=np.uint8)) for n in sizes]
    threads = ThreadPoolExecutor(streams - 1)

    def fetch(group: int) -> None:
        io = conns[group]
        io.send([b"".join(command(b"GET", names[i].encode()) for i in groups[group])])
        for i in groups[group]:
            line = io.read_line()
            assert line == b"$%d" % sizes[i], line
            got = 0
            while got < sizes[i]:
                got += io.readinto(buffers[i][got:])
            io.skip(2)  # CRLF

    def fetch_all() -> None:
        futures = [threads.submit(fetch, g) for g in range(1, streams)]
        fetch(0)
        for future in futures:
            future.result()

    def check(_: None) -> None:
        if not all(bytes(b[-len(p) :]) == p for b, p in zip(buffers, chunks.payloads)):
            raise AssertionError("a record read raw does not end with its chunk's bytes")

    def close() -> None:
        threads.shutdown()
        for io in conns:
            io.close()

    return Timed(fetch_all, check), close


def raw_tcp_run(chunks: ChunkSet, port: int) -> tuple[Timed, Any]:
    """The floor of a TCP server on this machine: the same bytes from another process over one
    loopback connection, no protocol, straight into the caller's buffer (``serve_raw``)."""
    code = (
        f"from benchmarks.peers.common import serve_raw; serve_raw({chunks.name!r}, "
        f"{len(chunks.blocks)}, {port})"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=REPO_ROOT)
    deadline = time.monotonic() + 60
    while True:
        try:
            sock = socket.create_connection(("127.0.0.1", port))
            break
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the raw TCP sender did not start") from None
            time.sleep(0.05)
    dest = Destination(chunks)
    whole = memoryview(dest.array)

    def fetch() -> None:
        sock.sendall(b"g")
        recv_exactly(sock, whole)

    def stop() -> None:
        sock.close()
        proc.wait(timeout=30)

    return Timed(fetch, lambda _: dest.check(), dest.scrub), stop


def _pipeline_get(client: redis.Redis, names: list[str]) -> list:
    pipe = client.pipeline(transaction=False)
    for name in names:
        pipe.get(name)
    return pipe.execute()


def _pipeline_set(client: redis.Redis, names: list[str], records: list[bytes]) -> list:
    pipe = client.pipeline(transaction=False)
    for name, record in zip(names, records):
        pipe.set(name, record)
    return pipe.execute()


def bench_server(chunks: ChunkSet, repeats: int, tmp: Path) -> dict[str, Any]:
    """Our sidecar against ``lm://``. Ours over TCP (its transfer port: the like-for-like
    transport) and, as ``ours_unix_*``, over the Unix socket it offers engines on its host.
    Puts: ours acknowledges after its disk write (``ours_put``, the default) or, like LMCache's
    memory-only server, with the disk tier left out (``ours_put_memonly``)."""
    ours_server = Server(str(tmp / "server"), fsync=False)
    mem_server = Server(str(tmp / "server-mem"), fsync=False)
    mem_server.env["CACHETIER_DISK_BYTES"] = "0"
    # A Unix socket path must fit in 107 bytes: a short folder of its own.
    sock_dir = Path(tempfile.mkdtemp(prefix="ct-", dir="/tmp"))
    for server, name in ((ours_server, "ours.sock"), (mem_server, "mem.sock")):
        server.env["CACHETIER_TRANSFER_SOCKET"] = str(sock_dir / name)
    lm_server = LMServer(free_port())
    ours_server.start()
    mem_server.start()
    lm_server.start()

    def remote(server: Server, via_socket: bool) -> RemoteTier:
        config = RemoteTierConfig(
            url=server.url, token=TOKEN, timeout_s=60, transfer_socket=via_socket
        )
        return RemoteTier(config)

    ours, ours_mem = remote(ours_server, False), remote(mem_server, False)
    ours_unix, ours_mem_unix = remote(ours_server, True), remote(mem_server, True)
    theirs = PeerStore("server", chunks, f"peers-{os.getpid()}", remote_url=lm_server.url)
    try:
        fill(ours, theirs, chunks)
        for tier, kind in ((ours, "tcp:"), (ours_unix, "unix:")):
            tier.get_many(chunks.namespace.id, [chunks.blocks[0].key])  # finds its endpoint
            where = tier.stats()["transfer"]
            assert where and where.startswith(kind), f"transfers go to {where}, not {kind}"
        runs = get_runs(ours, theirs, chunks)
        unix = get_runs(ours_unix, theirs, chunks)
        runs["ours_unix_get_buf"] = unix["ours_get_buf"]
        runs["ours_unix_get_ret"] = unix["ours_get_ret"]
        runs["raw_tcp_get_buf"], stop_raw = raw_tcp_run(chunks, free_port())
        try:
            out = interleaved_checked(runs, repeats, warmup=1)
        finally:
            stop_raw()
        # lm:// has no delete: its puts overwrite (a dict entry replaced). Ours delete first,
        # untimed, so each put writes: the disk tier skips a record it already holds.
        # Two groups, each against its own LMCache samples: the disk writes of the durable
        # group leave the kernel writing pages back during whatever runs next.
        runs = put_runs(ours, theirs, chunks, None)
        durable = {"ours_put": runs.pop("ours_put")}
        for name, tier in (
            ("ours_put_memonly", ours_mem),
            ("ours_unix_put_memonly", ours_mem_unix),
        ):
            runs[name] = ours_put_run(tier, chunks)
        out.update(interleaved_checked(runs, repeats, warmup=1))
        durable["lmcache_put_durable_group"] = replace(runs["lmcache_put"], samples=[])
        durable["raw_write_put"] = raw_write_run(chunks, tmp / "raw-write")
        out.update(interleaved_checked(durable, repeats, warmup=1))
        tiers = (ours, ours_mem, ours_unix, ours_mem_unix)
        out["ours_errors"] = sum(t.stats()["errors"] for t in tiers)
        return out
    finally:
        for tier in (ours, ours_mem, ours_unix, ours_mem_unix):
            tier.close()
        theirs.close()
        ours_server.stop()
        mem_server.stop()
        lm_server.kill()
        shutil.rmtree(sock_dir, ignore_errors=True)


def raw_write_run(chunks: ChunkSet, folder: Path) -> Timed:
    """The bound of a put acknowledged after its disk write: our records written to files in
    one thread, one ``writev`` each (no rename, no fsync, as the server here), nothing else."""
    folder.mkdir(parents=True, exist_ok=True)
    records = [encode_parts(b) for b in chunks.blocks]

    def write_all() -> None:
        for i, parts in enumerate(records):
            fd = os.open(folder / f"{i}.ctkv", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                os.writev(fd, parts)
            finally:
                os.close(fd)

    def remove() -> None:
        for path in folder.iterdir():
            path.unlink()

    return Timed(write_all, before=remove)
