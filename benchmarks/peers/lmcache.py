"""LMCache's storage layer (``lmcache.v1`` ``StorageManager``), driven the way its cache engine
drives it, for ``benchmarks.peers``. Imported only by the benchmark's sections, in ``.venv-peers``.

One ``PeerStore`` holds one ``StorageManager`` configured with exactly one storage tier, so a
get can only be served by the tier under test:

- ``cpu``: ``LocalCPUBackend`` (``local_cpu: true``);
- ``disk``: ``LocalDiskBackend`` under a folder (the CPU backend is only its staging pool);
- ``redis`` / ``server``: ``RemoteBackend`` with ``remote_url`` ``redis://...`` / ``lm://...``;
- ``cachetier``: our storage plugin (``cachetier.connectors.lmcache.backend``), loaded by LMCache's
own
  ``storage_plugins`` mechanism, with the cachetier settings given as ``plugin``.

A chunk enters LMCache as a ``MemoryObj`` from its allocator (``[2, layers, tokens, heads x dim]``
fp16, ``KV_2LTD``) holding exactly the bytes our block holds.
"""

from __future__ import annotations

import os

# Before lmcache is imported: it reports usage over the network unless told not to, and logs
# every backend call at INFO.
os.environ["LMCACHE_TRACK_USAGE"] = "false"
os.environ.setdefault("LMCACHE_LOG_LEVEL", "WARNING")

import socket
import subprocess
import sys
import time
from collections.abc import Sequence

import torch
from lmcache.utils import CacheEngineKey
from lmcache.v1.config import LMCacheEngineConfig
from lmcache.v1.event_manager import EventManager
from lmcache.v1.memory_management import MemoryFormat, MemoryObj
from lmcache.v1.metadata import LMCacheMetadata
from lmcache.v1.storage_backend.storage_manager import StorageManager

from benchmarks.peers.common import CHUNK_TOKENS, ChunkSet

BACKENDS = {
    "cpu": "LocalCPUBackend",
    "disk": "LocalDiskBackend",
    "redis": "RemoteBackend",
    "server": "RemoteBackend",
    "cachetier": "cachetier",
}
PLUGIN = {
    "storage_plugin.cachetier.module_path": "cachetier.connectors.lmcache.backend",
    "storage_plugin.cachetier.class_name": "CacheTierBackend",
}


class PeerStore:
    """One LMCache ``StorageManager`` with one tier, for one chunk shape.

    Args:
        tier: ``cpu``, ``disk``, ``redis`` or ``server``.
        chunks: the chunk shape this store holds (LMCache's metadata is per model shape).
        model_name: LMCache's key prefix (Redis keys and file names start with it).
        disk_path: folder of the disk tier.
        remote_url: ``redis://host:port/db`` or ``lm://host:port``.
        plugin: for ``cachetier``, its settings (``ConnectorConfig`` fields, without the
            ``cachetier.`` prefix of LMCache's extra_config).
        worker: this worker's id and the world size (tensor-parallel rank and size).
        pool_copies: LMCache's CPU memory pool (allocated whole, up front) holds this many
            copies of the chunk set: the stored or staged one, its write-back into the CPU
            backend after a single-key get, and the objects of a get in flight.
    """

    def __init__(
        self,
        tier: str,
        chunks: ChunkSet,
        model_name: str,
        *,
        disk_path: str | None = None,
        remote_url: str | None = None,
        pool_copies: int = 3,
        plugin: dict[str, object] | None = None,
        worker: tuple[int, int] = (0, 1),
    ) -> None:
        self.tier = tier
        self.location = BACKENDS[tier]
        self.model_name = model_name
        config = {
            "chunk_size": CHUNK_TOKENS,
            "local_cpu": tier == "cpu",
            "max_local_cpu_size": pool_copies * chunks.total_bytes / 2**30 + 0.25,
            "local_disk": disk_path,
            "max_local_disk_size": 8.0 if disk_path else 0.0,
            "remote_url": remote_url,
            "remote_serde": "naive",
        }
        if tier == "cachetier":
            settings = {f"cachetier.{k}": v for k, v in (plugin or {}).items()}
            config.update(storage_plugins=["cachetier"], extra_config={**PLUGIN, **settings})
        lay = chunks.layout
        self.metadata = LMCacheMetadata(
            model_name=model_name,
            world_size=worker[1],
            local_world_size=worker[1],
            worker_id=worker[0],
            local_worker_id=worker[0],
            kv_dtype=torch.float16,
            kv_shape=(lay.num_layers, 2, CHUNK_TOKENS, lay.num_kv_heads, lay.head_dim),
            chunk_size=CHUNK_TOKENS,
        )
        # [2, num_layers, tokens, num_kv_heads * head_dim]: LMCache's KV_2LTD chunk
        self.obj_shape = torch.Size(
            [2, lay.num_layers, CHUNK_TOKENS, lay.num_kv_heads * lay.head_dim]
        )
        self.manager = StorageManager(
            LMCacheEngineConfig.from_dict(config), self.metadata, EventManager()
        )
        if self.location not in self.manager.storage_backends:
            raise RuntimeError(f"LMCache did not create {self.location} (its log says why)")
        self.backend = self.manager.storage_backends[self.location]
        self.keys = [self.key_of(b.key) for b in chunks.blocks]

    def key_of(self, block_key: bytes) -> CacheEngineKey:
        """LMCache's key for one of our chunks: the same 256-bit hash as its chunk hash."""
        world_size, worker_id = self.metadata.world_size, self.metadata.worker_id
        return CacheEngineKey(
            self.model_name, world_size, worker_id, int.from_bytes(block_key, "big"), torch.float16
        )

    def stage(self, payloads: Sequence[bytes]) -> list[MemoryObj]:
        """Chunks as LMCache takes them: memory objects of its allocator holding the bytes."""
        objs = []
        for payload in payloads:
            obj = self.manager.allocate(self.obj_shape, torch.float16, fmt=MemoryFormat.KV_2LTD)
            assert obj is not None, "LMCache's CPU pool is too small for the chunk set"
            byte_view(obj)[:] = payload
            objs.append(obj)
        return objs

    def put(self, objs: Sequence[MemoryObj]) -> None:
        """Store the chunks and return once the tier holds them.

        ``batched_put`` only queues the writes of the disk and remote tiers. This waits until
        the tier reports every key (disk: its index; Redis: EXISTS of the metadata key, which
        LMCache writes after the payload key), or for ``lm://``, whose puts are never answered,
        until the backend has sent them all and one EXIST on the same connection is answered:
        the server handles a connection's messages in order, so every put before it is stored.
        For the disk and Redis waits the keys must be absent before the put (``forget``).
        """
        for obj in objs:
            obj.ref_count_up()  # batched_put releases one reference of each object it is given
        self.manager.batched_put(self.keys, list(objs), location=self.location)
        self.wait_stored()

    def wait_stored(self, timeout_s: float = 120.0) -> None:
        deadline = time.monotonic() + timeout_s
        if self.tier == "server":
            while self.backend.put_tasks:
                _check_deadline(deadline)
                time.sleep(0.0002)
            if not self.backend.contains(self.keys[-1]):
                raise AssertionError("LMCache's lm:// server does not hold a chunk it was sent")
        elif self.tier in ("disk", "redis"):
            pending = list(self.keys)
            while pending:
                pending = [k for k in pending if not self.backend.contains(k)]
                if pending:
                    _check_deadline(deadline)
                    time.sleep(0.0005)

    def get(self) -> list[MemoryObj | None]:
        """Every chunk, as ``StorageManager.batched_get`` returns it (the caller must release)."""
        return self.manager.batched_get(self.keys, location=self.location)

    def get_one_by_one(self) -> list[MemoryObj | None]:
        """Every chunk, one ``StorageManager.get`` call each (the caller must release)."""
        return [self.manager.get(key, location=self.location) for key in self.keys]

    def get_into(self, dests: Sequence[memoryview]) -> list[MemoryObj | None]:
        """Every chunk copied into the caller's buffers; the caller then releases the objects."""
        got = self.get()
        for obj, dest in zip(got, dests):
            if obj is not None:
                dest[:] = byte_view(obj)
        return got

    def redis_names(self) -> list[str]:
        """The Redis keys LMCache writes for these chunks (payload and metadata of each)."""
        return [k.to_string() + part for k in self.keys for part in ("kv_bytes", "metadata")]

    def count_found(self) -> int:
        """How many of the chunks this store's tier says it holds."""
        return sum(bool(self.backend.contains(k)) for k in self.keys)

    def close(self) -> None:
        if self.tier == "redis":
            # LMCache 0.5.6's Redis connector never finishes closing: its close() runs on the
            # manager's event loop and waits for its job executor, which needs that same loop.
            # Stopping the loop ends the manager's thread; the process exits after the section.
            self.manager.loop.call_soon_threadsafe(self.manager.loop.stop)
            self.manager.thread.join(timeout=10)
            return
        self.manager.close()


def _check_deadline(deadline: float) -> None:
    if time.monotonic() > deadline:
        raise TimeoutError("LMCache did not finish its writes in time")


def byte_view(obj: MemoryObj) -> memoryview:
    """The chunk's bytes inside an LMCache memory object, as a flat byte view (no copy)."""
    view = memoryview(obj.byte_array)
    return view if view.format == "B" else view.cast("B")


def release(objs: Sequence[MemoryObj | None]) -> None:
    for obj in objs:
        if obj is not None:
            obj.ref_count_down()


class LMServer:
    """LMCache's TCP cache server (``python -m lmcache.v1.server HOST PORT``) as a child process."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.url = f"lm://127.0.0.1:{port}"
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        env = {**os.environ, "LMCACHE_TRACK_USAGE": "false", "LMCACHE_LOG_LEVEL": "WARNING"}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "lmcache.v1.server", "127.0.0.1", str(self.port)],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 60
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                return
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("LMCache's server did not start") from None
                time.sleep(0.05)

    def kill(self) -> None:
        """SIGKILL: what a crash or an OOM kill does."""
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait(timeout=60)
            self.proc = None
