"""cachetier as LMCache 0.5.6's storage plugin, for ``benchmarks.plugins``: chunks found after a
restart, and batched get speed, against LMCache's own ``LocalDiskBackend``. Runs in
``.venv-peers``; every LMCache side is ``benchmarks.peers.lmcache.PeerStore`` (one
``StorageManager``, one tier), ours loaded through LMCache's ``storage_plugins``.

Chunks: ``benchmarks.peers``' SmolLM2 shape (30 layers, 3 KV heads, 64 dims, 256 tokens, fp16:
5.6 MiB), random-normal. Our plugin stores on a disk tier alone (no CPU tier), so both sides
read files through the page cache, which the writes left warm for both. A timed get is
``StorageManager.batched_get`` of every chunk (objects of LMCache's CPU pool, released after
the clock stops, when every one is compared byte for byte with what was put).

    .venv-peers/bin/python -m benchmarks.plugins.lmcache --work /tmp/x
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path
from typing import Any

from benchmarks.peers.common import ChunkSet, check_buffers, make_chunks
from benchmarks.peers.lmcache import PeerStore, byte_view, release
from benchmarks.peers.restart import count_lmcache
from benchmarks.support.children import module_command, run_json
from benchmarks.support.timing import interleaved_medians, settle

MODEL = "plugins-lmcache"  # LMCache's model name (key prefix) and our model fingerprint
SHAPE = "smollm2"


def ours(chunks: ChunkSet, folder: Path) -> PeerStore:
    plugin = {"disk_path": str(folder), "cpu_bytes": 0, "fsync": False, "model_fingerprint": MODEL}
    return PeerStore("cachetier", chunks, MODEL, plugin=plugin)


def theirs(chunks: ChunkSet, folder: Path) -> PeerStore:
    return PeerStore("disk", chunks, MODEL, disk_path=str(folder))


def put_all(store: PeerStore, chunks: ChunkSet) -> None:
    staged = store.stage(chunks.payloads)
    store.put(staged)
    release(staged)


def write(work: Path, num_chunks: int) -> dict[str, Any]:
    """Both sides store every chunk; this process then exits (the restart)."""
    chunks = make_chunks(SHAPE, num_chunks)
    for store in (ours(chunks, work / "ours"), theirs(chunks, work / "lmcache-disk")):
        put_all(store, chunks)
        store.close()
    return {"lmcache_chunks": num_chunks}


def read(work: Path, num_chunks: int) -> dict[str, Any]:
    """A fresh process counts what each side finds (every found chunk checked byte for byte)."""
    chunks = make_chunks(SHAPE, num_chunks)
    out = {}
    for name, store in (
        ("lmcache_found_after_restart", ours(chunks, work / "ours")),
        ("lmcache_own_disk_found_after_restart", theirs(chunks, work / "lmcache-disk")),
    ):
        out[name] = count_lmcache(store, chunks)
        store.close()
    return out


def speed(work: Path, num_chunks: int, repeats: int) -> dict[str, Any]:
    chunks = make_chunks(SHAPE, num_chunks, seed=1)
    sides = {
        "ours": ours(chunks, work / "speed-ours"),
        "lmcache_disk": theirs(chunks, work / "speed-lm"),
    }
    for store in sides.values():
        put_all(store, chunks)
    last: dict[str, list[Any]] = {}

    def get(name: str) -> None:
        if name in last:
            release(last.pop(name))
        last[name] = sides[name].get()

    settle()
    medians = interleaved_medians({name: (lambda n=name: get(n)) for name in sides}, repeats)
    for name, got in last.items():
        check_buffers([None if g is None else byte_view(g) for g in got], chunks.payloads, name)
        release(got)
    for store in sides.values():
        store.close()
    return {
        "lmcache_get_vs_lmcache_disk": medians["lmcache_disk"] / medians["ours"],
        "lmcache_get_ms": {k: 1e3 * v for k, v in medians.items()},
        "lmcache_chunk_bytes": chunks.chunk_bytes,
    }


def child(step: str, work: Path, num_chunks: int) -> dict[str, Any]:
    """One step in a fresh interpreter of this venv (so a restart is a real one)."""
    argv = module_command("benchmarks.plugins.lmcache", "--step", step, "--work", str(work))
    return run_json([*argv, "--chunks", str(num_chunks)], timeout=1200)


def measure(work: Path, num_chunks: int = 32, repeats: int = 9) -> dict[str, Any]:
    """Every LMCache figure of ``benchmarks.plugins``."""
    with tempfile.TemporaryDirectory(dir=work, prefix="lmcache-") as tmp:
        out = child("write", Path(tmp), num_chunks)
        out.update(child("read", Path(tmp), num_chunks))
        out.update(speed(Path(tmp), num_chunks, repeats))
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()))
    parser.add_argument("--chunks", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--step", choices=("write", "read"))
    args = parser.parse_args()
    if args.step == "write":
        result = write(args.work, args.chunks)
    elif args.step == "read":
        result = read(args.work, args.chunks)
    else:
        result = measure(args.work, args.chunks, args.repeats)
    print(json.dumps(result, sort_keys=True))


if __name__ == "__main__":
    main()
