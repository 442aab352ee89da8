"""``CacheTierBackend``: cachetier's tiers as a storage plugin of LMCache 0.5.6.

LMCache loads it by module path, through its own ``storage_plugins`` mechanism (no patch)::

    # lmcache config (YAML or LMCACHE_* environment variables)
    chunk_size: 256
    storage_plugins: ["cachetier"]
    extra_config:
      storage_plugin.cachetier.module_path: cachetier.connectors.lmcache.backend
      storage_plugin.cachetier.class_name: CacheTierBackend
      cachetier.disk_path: /var/cache/cachetier/kv
      cachetier.cpu_bytes: 0

Every ``cachetier.<name>`` key is a setting of ``cachetier.connectors.config.ConnectorConfig``;
secrets come from the environment (``plugin_config``: LMCache logs its config).

A plugin that cannot start (a bad key or value, a tier that does not open, no model
fingerprint) logs why at ERROR and stops the process (``SystemExit``); with
``cachetier.fail_on_start_error: false`` it lets LMCache serve without it instead.

Why a storage plugin and not a remote connector (``remote_storage_plugins``): a plugin is a
backend LMCache's ``StorageManager`` calls synchronously with its own ``MemoryObj``s, so a get
reads a record and copies it straight into the object LMCache hands to the engine. A remote
connector sits behind LMCache's ``RemoteBackend``: serde, an asyncio hop per call, and its own
copies.

- **Keys.** LMCache names a chunk by a ``CacheEngineKey`` (model, world size, worker, chunk
  hash, dtype, request tags). Its string form is filed under a cachetier ``Namespace``
  (``cachetier.primitives.keys.foreign_key``) of the model's fingerprint
  (``cachetier.model_fingerprint``, or the hash of LMCache's model folder), the worker's shard
  (``tp<worker>of<world>``), the chunk layout and ``cachetier.tenant``.
- **Chunks** are stored in the canonical arrangement (LMCache's ``KV_2LTD``
  ``[2, layers, tokens, heads * dim]`` becomes ``[layers, 2, tokens, heads, dim]``; MLA's
  ``KV_MLA_FMT`` ``[1, layers, tokens, latent]`` becomes ``[layers, 1, tokens, 1, latent]``);
  a get reads each run of a record straight to its place in LMCache's object.
  Only full chunks are stored, like every cachetier block: LMCache recomputes a partial last
  chunk.
- **Puts** are done when ``batched_submit_put_task`` returns: the first tier holds them, the
  lower ones are written behind and flushed by ``close``.
- **Failures** of a tier are misses; a record that is not exactly a chunk of this namespace is
  a miss, never copied into LMCache's memory.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any

from lmcache.utils import CacheEngineKey
from lmcache.v1.memory_management import MemoryObj
from lmcache.v1.storage_backend.abstract_backend import StoragePluginInterface

from cachetier.connectors.config import (
    fails_on_start_error,
    log_start_failure,
    model_folder_fingerprint,
    open_store,
    plugin_config,
)
from cachetier.connectors.lmcache.chunks import ChunkFormat, chunk_format
from cachetier.connectors.records import check_record, payload_block
from cachetier.errors import CacheTierError
from cachetier.primitives.keys import Namespace, foreign_key
from cachetier.record import KVBlock
from cachetier.util.log_setup import share_handlers

log = logging.getLogger(__name__)

PREFIX = "cachetier."
SOURCE = "LMCache's extra_config (cachetier.*)"


class CacheTierBackend(StoragePluginInterface):
    """An LMCache storage backend over a cachetier ``TieredStore``.

    Args:
        dst_device: where LMCache wants gets (chunks are copied into its CPU objects).
        config: LMCache's engine config; ``extra_config["cachetier.<field>"]`` are ours.
        metadata: the model's shape, dtype, chunk size and this worker's rank.
        local_cpu_backend: LMCache's CPU backend, whose allocator gets allocate from.
        loop: LMCache's event loop (unused: every call here is synchronous).
    """

    def __init__(
        self,
        dst_device: str = "cpu",
        config: Any = None,
        metadata: Any = None,
        local_cpu_backend: Any = None,
        loop: asyncio.AbstractEventLoop | None = None,
    ) -> None:
        share_handlers("lmcache")  # the core's warnings in lmcache's own format
        super().__init__(dst_device, config, metadata, local_cpu_backend, loop)
        extra = dict(getattr(config, "extra_config", None) or {})
        settings = {k[len(PREFIX) :]: v for k, v in extra.items() if k.startswith(PREFIX)}
        try:
            self._start(settings, metadata, local_cpu_backend)
        except Exception as exc:
            fatal = fails_on_start_error(settings)
            message = log_start_failure(exc, engine="LMCache", fatal=fatal)
            if not fatal:
                raise  # LMCache logs it too, and serves without this plugin
            # LMCache 0.5.6's storage_plugin_launcher catches every Exception a plugin's
            # constructor raises, logs one line and serves without the plugin. SystemExit is
            # not an Exception: it passes LMCache (and vLLM's worker, which exits on it), so
            # the engine stops instead of serving without the tiers its config names. The
            # StorageManager has already started its event loop's thread (not a daemon): it is
            # stopped first, or the interpreter would wait for it forever on its way out.
            if loop is not None:
                loop.call_soon_threadsafe(loop.stop)
            raise SystemExit(message) from exc

    def _start(self, settings: dict[str, Any], metadata: Any, local_cpu_backend: Any) -> None:
        if metadata is None or local_cpu_backend is None:
            raise ValueError("LMCache passes its metadata and CPU backend to storage plugins")
        self.settings = plugin_config(settings, os.environ, source=SOURCE)
        fingerprint = self.settings.model_fingerprint or model_folder_fingerprint(
            metadata.model_name, key="extra_config['cachetier.model_fingerprint']"
        )
        self.format: ChunkFormat = chunk_format(metadata)
        if metadata.world_size > 1 and not metadata.use_mla:
            fingerprint = f"{fingerprint}/lmcache:tp{metadata.worker_id}of{metadata.world_size}"
        self.namespace = Namespace(fingerprint, self.format.layout, self.settings.tenant)
        self.store = open_store(self.settings, with_cpu=True)

    def __str__(self) -> str:
        return "CacheTierBackend"

    # -- lookups ---------------------------------------------------------------------------

    def contains(self, key: CacheEngineKey, pin: bool = False) -> bool:
        return self.batched_contains([key], pin) == 1

    def batched_contains(self, keys: list[CacheEngineKey], pin: bool = False) -> int:
        """How many of ``keys``, from the first, are stored."""
        return self.store.contains_prefix(self.namespace.id, self._keys(keys))

    def exists_in_put_tasks(self, key: CacheEngineKey) -> bool:
        return False  # puts are done when batched_submit_put_task returns

    # -- puts ------------------------------------------------------------------------------

    def batched_submit_put_task(
        self,
        keys: Sequence[CacheEngineKey],
        objs: list[MemoryObj],
        transfer_spec: Any = None,
        on_complete_callback: Callable[[CacheEngineKey], None] | None = None,
    ) -> list[Future] | None:
        """Store full chunks now (LMCache keeps its objects; these are copies)."""
        layout = self.format.layout
        blocks, stored = [], []
        for key, obj in zip(keys, objs):
            payload = self.format.to_canonical(obj)
            if payload is None:
                continue  # a partial chunk or another format: LMCache recomputes it
            blocks.append(
                payload_block(self._keys([key])[0], self.namespace.fingerprint, layout, payload)
            )
            stored.append(key)
        if blocks:
            try:
                self.store.put_many(self.namespace.id, blocks)
            except CacheTierError as exc:
                log.warning("cachetier LMCache put failed: %s", exc)
                return None
        if on_complete_callback is not None:
            for key in stored:
                on_complete_callback(key)
        return None

    # -- gets ------------------------------------------------------------------------------

    def get_blocking(self, key: CacheEngineKey) -> MemoryObj | None:
        return self.batched_get_blocking([key])[0]

    def batched_get_blocking(self, keys: list[CacheEngineKey]) -> list[MemoryObj | None]:
        """Each chunk in a new object of LMCache's allocator, or ``None`` (a miss).

        Objects are allocated first, and each record's runs are read straight to their place
        in its object (``ChunkFormat.runs``): no buffer in between, no transposing copy. A
        record that then fails a check leaves garbage in its object, which is released.
        """
        fmt = self.format
        out: list[MemoryObj | None] = [None] * len(keys)
        objs: list[tuple[int, MemoryObj]] = []
        for position in range(len(keys)):
            obj = self.local_cpu_backend.allocate(fmt.obj_shape, fmt.dtype, fmt.memory_format)
            if obj is None:
                log.warning("LMCache's CPU pool is full: chunks counted as misses")
                break
            objs.append((position, obj))
        wanted = self._keys([keys[p] for p, _ in objs])
        try:
            found = self.store.get_into(
                self.namespace.id, wanted, [fmt.runs(obj) for _, obj in objs]
            )
        except CacheTierError as exc:  # a tier the store could not turn into a miss
            log.warning("cachetier get failed, counted as misses: %s", exc)
            found = [None] * len(objs)
        for (position, obj), key, record in zip(objs, wanted, found):
            problem = "missing" if record is None else self._refuse(record, key)
            if problem is None:
                out[position] = obj
            else:
                if record is not None:
                    log.warning("cachetier record %s refused: %s", key.hex()[:12], problem)
                obj.ref_count_down()  # back to LMCache's pool
        return out

    def _refuse(self, record: KVBlock, key: bytes) -> str | None:
        return check_record(record, key, self.namespace.fingerprint, self.format.layout)

    # -- the rest of LMCache's interface ---------------------------------------------------

    def pin(self, key: CacheEngineKey) -> bool:
        return False  # tiers evict by their own policy; nothing is pinned

    def unpin(self, key: CacheEngineKey) -> bool:
        return False

    def remove(self, key: CacheEngineKey, force: bool = True) -> bool:
        return self.store.delete(self.namespace.id, self._keys([key])) > 0

    def touch_cache(self) -> None:
        return None  # reads refresh the tiers' LRU order themselves

    def get_allocator_backend(self) -> Any:
        return self.local_cpu_backend

    def close(self) -> None:
        """Flush the writes still queued for lower tiers, then close them."""
        self.store.close()

    def _keys(self, keys: Sequence[CacheEngineKey]) -> list[Any]:
        return [foreign_key(self.namespace, "lmcache", key.to_string()) for key in keys]
