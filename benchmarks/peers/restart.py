"""Restart persistence for ``benchmarks.peers``: how many stored chunks each side finds again.

- disk: ``write_disk`` stores every chunk set through our ``DiskTier`` and LMCache's
  ``LocalDiskBackend`` and its process exits; ``read_disk``, a fresh process, opens both over
  the same folders and counts the chunks each finds (every found chunk read back and compared
  byte for byte). LMCache's files are counted too: they are still there, its index is not.
- server: both servers get every chunk, both are killed with SIGKILL (a crash) and started again
  over the same data dir / port, and fresh clients count what they find.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from benchmarks.peers.common import ChunkSet, check_buffers
from benchmarks.peers.lmcache import LMServer, PeerStore, byte_view, release
from benchmarks.support.children import free_port
from benchmarks.support.sidecar import TOKEN, Server
from cachetier.tiers.base import Tier
from cachetier.tiers.disk.tier import DiskTier, DiskTierConfig
from cachetier.tiers.remote import RemoteTier, RemoteTierConfig

MODEL_NAME = "peers-restart"  # LMCache's key prefix; the same in the writing and reading process


def _lmcache_disk(root: Path, chunks: ChunkSet) -> PeerStore:
    return PeerStore("disk", chunks, MODEL_NAME, disk_path=str(root / f"lmcache-{chunks.name}"))


def _ours_disk(root: Path) -> DiskTier:
    # No fsync, like LMCache's disk backend: both survive a process exit, not a power cut.
    return DiskTier(DiskTierConfig(str(root / "ours"), 1 << 40, fsync=False))


def count_ours(tier: Tier, chunks: ChunkSet) -> int:
    """Chunks ``tier`` gives back, each checked byte for byte."""
    got = tier.get_many(chunks.namespace.id, [b.key for b in chunks.blocks])
    found = [(g.data, want) for g, want in zip(got, chunks.payloads) if g is not None]
    check_buffers([f[0] for f in found], [f[1] for f in found], "ours after restart")
    return len(found)


def count_lmcache(store: PeerStore, chunks: ChunkSet) -> int:
    """Chunks LMCache's tier reports and gives back, each checked byte for byte."""
    if store.count_found() == 0:
        return 0
    got = store.get()
    try:
        found = [(byte_view(g), want) for g, want in zip(got, chunks.payloads) if g is not None]
        check_buffers([f[0] for f in found], [f[1] for f in found], "LMCache after restart")
        return len(found)
    finally:
        release(got)


def write_disk(sets: list[ChunkSet], root: Path) -> dict[str, Any]:
    ours = _ours_disk(root)
    for chunks in sets:
        assert ours.put_many(chunks.namespace.id, list(chunks.blocks)) == len(chunks.blocks)
        theirs = _lmcache_disk(root, chunks)
        staged = theirs.stage(chunks.payloads)
        theirs.put(staged)  # returns once LMCache's index lists every chunk
        release(staged)
        theirs.close()
    ours.close()
    return {"stored": sum(len(c.blocks) for c in sets)}


def read_disk(sets: list[ChunkSet], root: Path) -> dict[str, Any]:
    ours = _ours_disk(root)
    out = {"ours_disk_found": 0, "lmcache_disk_found": 0, "lmcache_disk_files": 0}
    for chunks in sets:
        out["ours_disk_found"] += count_ours(ours, chunks)
        theirs = _lmcache_disk(root, chunks)
        out["lmcache_disk_found"] += count_lmcache(theirs, chunks)
        theirs.close()
        out["lmcache_disk_files"] += len(list((root / f"lmcache-{chunks.name}").glob("*.pt")))
    ours.close()
    return out


def restart_servers(sets: list[ChunkSet], root: Path) -> dict[str, Any]:
    ours_server = Server(str(root / "server"), fsync=False)  # acknowledged = written, not fsynced
    lm_server = LMServer(free_port())
    ours_server.start()
    lm_server.start()
    try:
        ours = RemoteTier(RemoteTierConfig(url=ours_server.url, token=TOKEN, timeout_s=60))
        for chunks in sets:
            assert ours.put_many(chunks.namespace.id, list(chunks.blocks)) == len(chunks.blocks)
            theirs = PeerStore("server", chunks, MODEL_NAME, remote_url=lm_server.url)
            staged = theirs.stage(chunks.payloads)
            theirs.put(staged)  # returns once the server answered for every chunk
            release(staged)
            theirs.close()
        ours.close()
        for proc in (ours_server.proc, lm_server.proc):
            assert proc is not None and proc.poll() is None, "a server died before the kill"
        ours_server.proc.kill()  # type: ignore[union-attr]
        ours_server.proc.wait(timeout=60)  # type: ignore[union-attr]
        ours_server.proc = None
        lm_server.kill()
        ours_server.start()
        lm_server.start()
        out = {"ours_server_found": 0, "lmcache_server_found": 0}
        ours = RemoteTier(RemoteTierConfig(url=ours_server.url, token=TOKEN, timeout_s=60))
        for chunks in sets:
            out["ours_server_found"] += count_ours(ours, chunks)
            theirs = PeerStore("server", chunks, MODEL_NAME, remote_url=lm_server.url)
            out["lmcache_server_found"] += count_lmcache(theirs, chunks)
            theirs.close()
        ours.close()
        return out
    finally:
        ours_server.stop()
        lm_server.kill()
