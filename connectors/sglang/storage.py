"""``CacheTierStorage``: cachetier's tiers as SGLang's HiCache L3 storage backend.

SGLang loads it with no patch of its own, through its dynamic backend path::

    python -m sglang.launch_server --model-path /models/llama --enable-hierarchical-cache \\
        --hicache-storage-backend dynamic \\
        --hicache-storage-backend-extra-config '{"backend_name": "cachetier",
            "module_path": "cachetier.connectors.sglang.storage", "class_name": "CacheTierStorage",
            "interface_v1": 1, "disk_path": "/var/cache/kv"}'

Every other key of that JSON is a setting of ``cachetier.connectors.config.ConnectorConfig``
(``disk_path``, ``redis_url``, ``remote_url``, ``tenant``, ``model_fingerprint``, ...); secrets (the
sidecar's token, a Redis password) come from the environment, never that JSON (``plugin_config``).

A backend that cannot start (a bad key or value, a tier that does not open, no model
fingerprint) logs why at ERROR and raises, which stops SGLang at start; with
``"fail_on_start_error": false`` it stays as a backend that stores nothing (every lookup a
miss, every write dropped), so SGLang serves without cachetier.
``interface_v1: 1`` makes SGLang call the zero-copy API (``batch_get_v1``/``batch_set_v1``:
pages move straight between its host pool and the tiers); without it SGLang calls the
key-based API with flat pages, which works too, with one more copy per page.

- **Keys.** SGLang names a page by its own chained hash of the tokens up to it. Each name is
  filed under a cachetier ``Namespace`` (``cachetier.primitives.keys.foreign_key``): the model's
  fingerprint (``model_fingerprint``, or the hash of SGLang's model folder), the shard this
  rank holds (TP rank for MHA, PP stage, context-parallel rank), the page layout and the
  tenant. Two models, shards or tenants never read each other's pages.
- **Pages.** A record holds one page in the canonical arrangement
(``cachetier.primitives.kv_format``), the
  format every cachetier connector writes, whatever SGLang's host layout (``layer_first``,
  ``page_first``, ``page_first_direct``, ``page_head``; MLA pools as one latent).
- **Writes** are acknowledged once the first tier holds them; lower tiers (disk, Redis, the
  sidecar) are written behind and flushed by ``close``.
- **Failures** of a tier are misses (the store counts them); a record that is not exactly what
  this pool holds (another namespace, shape or dtype) is a miss, never copied in.

SGLang 0.5.23 moves MHA and MLA KV through the v1 (or key-based) API; its v2 pool-transfer
API carries only extra pools (Mamba, SWA, sparse indexers), which this backend does not store:
``batch_get_v2`` and friends stay SGLang's ``NotImplementedError``.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from typing import Any

import torch
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
)

from cachetier.connectors.config import (
    fails_on_start_error,
    log_start_failure,
    model_folder_fingerprint,
    open_store,
    plugin_config,
)
from cachetier.connectors.reads import ThreadScratch, read_each
from cachetier.connectors.records import payload_block
from cachetier.connectors.sglang.pages import HostPoolPages
from cachetier.errors import CacheTierError
from cachetier.primitives.keys import BlockHash, Namespace, foreign_key
from cachetier.store.tiered import TieredStore
from cachetier.util.log_setup import share_handlers

log = logging.getLogger(__name__)

EXTRA_CONFIG = "--hicache-storage-backend-extra-config"
# Keys of the extra config that SGLang itself reads.
_SGLANG_KEYS = frozenset({"backend_name", "module_path", "class_name", "interface_v1"})


class CacheTierStorage(HiCacheStorage):
    """SGLang HiCache storage over a cachetier ``TieredStore`` (see the module docstring).

    Args:
        storage_config: what SGLang passes every backend (ranks, model, extra config).
        kwargs: SGLang's extra keyword arguments for dynamic backends (none are read).
    """

    def __init__(
        self, storage_config: HiCacheStorageConfig, kwargs: dict[str, Any] | None = None
    ) -> None:
        share_handlers("sglang")  # the core's warnings in sglang's own format
        settings = {
            k: v for k, v in (storage_config.extra_config or {}).items() if k not in _SGLANG_KEYS
        }
        self.store: TieredStore | None = None  # stays None: running without cachetier
        self.pages: HostPoolPages | None = None
        self.namespace: Namespace | None = None
        self._scratch = ThreadScratch()
        try:
            self._start(settings, storage_config)
        except Exception as exc:
            fatal = fails_on_start_error(settings)
            log_start_failure(exc, engine="SGLang", fatal=fatal)
            if fatal:
                # SGLang's factory logs and re-raises a dynamic backend's error, and its
                # scheduler exits on it at start (an attach at run time answers it instead).
                raise
            self.is_writer = False  # sets are acknowledged and dropped, gets all miss

    def _start(self, settings: dict[str, Any], storage_config: HiCacheStorageConfig) -> None:
        self.config = plugin_config(settings, os.environ, source=EXTRA_CONFIG)
        self.shard = shard_name(storage_config)
        if self.config.model_fingerprint:
            self.model_fingerprint = self.config.model_fingerprint
        elif storage_config.model_name:
            self.model_fingerprint = model_folder_fingerprint(
                storage_config.model_name, key=f"{EXTRA_CONFIG} model_fingerprint"
            )
        else:
            raise ValueError(f"SGLang named no model: set model_fingerprint in {EXTRA_CONFIG}")
        self.is_mla = bool(storage_config.is_mla_model)
        self.is_writer = bool(storage_config.is_storage_writer)
        self.store = open_store(self.config, with_cpu=True)

    @property
    def running(self) -> bool:
        """Whether cachetier started (``False``: SGLang runs without it, every get a miss)."""
        return self.store is not None

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """Read the host pool's layout; the namespace's layout comes from it."""
        super().register_mem_pool_host(mem_pool_host)
        if self.store is None:
            return
        self.pages = HostPoolPages.from_pool(mem_pool_host, mla=self.is_mla)
        fingerprint = self.model_fingerprint
        if self.shard:
            fingerprint = f"{fingerprint}/sglang:{self.shard}"
        self.namespace = Namespace(fingerprint, self.pages.kv_layout, self.config.tenant)
        log.info(
            "cachetier HiCache storage: %s pages of %d tokens, %s layout, namespace %s",
            self.pages.kv_layout.dtype,
            self.pages.page_size,
            self.pages.layout,
            self.namespace.id[:12],
        )

    # -- zero-copy API (``interface_v1``) --------------------------------------------------

    def batch_exists(
        self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None = None
    ) -> int:
        """How many of ``keys``, from the first, are stored."""
        if self.store is None:
            return 0
        namespace, _ = self._ready()
        return self.store.contains_prefix(namespace.id, self._keys(keys))

    def batch_get_v1(
        self,
        keys: list[str],
        host_indices: torch.Tensor,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> list[bool]:
        """Read pages into the host pool at ``host_indices``; per key, whether it was read.

        Only the leading run of stored pages is read (SGLang uses no page after a miss)."""
        if self.store is None:
            return [False] * len(keys)
        _, pages = self._ready()
        page_ids = pages.page_ids(host_indices, len(keys))
        found = self._read(keys, lambda at, got: pages.load([page_ids[at]], [got]))
        return [i < found for i in range(len(keys))]

    def batch_set_v1(
        self,
        keys: list[str],
        host_indices: torch.Tensor,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> list[bool]:
        """Store the host pool's pages at ``host_indices``; per key, whether it was taken."""
        if self.store is None:
            return [True] * len(keys)  # dropped: a False would have SGLang warn on each write
        _, pages = self._ready()
        page_ids = pages.page_ids(host_indices, len(keys))
        if not self.is_writer:
            return [True] * len(keys)  # MLA pages are the same on every rank; one rank writes
        return self._put(keys, pages.save(page_ids))

    # -- key-based API (flat pages in the pool's layout) -----------------------------------

    def get(
        self, key: str, target_location: Any | None = None, target_sizes: Any | None = None
    ) -> torch.Tensor | None:
        """One page into ``target_location`` (a flat page, as ``get_dummy_flat_data_page``)."""
        return self.batch_get([key], [target_location])[0]

    def batch_get(
        self,
        keys: list[str],
        target_locations: Any | None = None,
        target_sizes: Any | None = None,
    ) -> list[torch.Tensor | None]:
        """Pages into the flat page tensors ``target_locations``; ``None`` from the first miss
        on."""
        if self.store is None:
            return [None] * len(keys)
        _, pages = self._ready()
        if target_locations is None or len(target_locations) != len(keys):
            raise ValueError("batch_get needs one target flat page per key")
        targets = list(target_locations)
        for target in targets:
            pages.page_tensor(target)  # raises before any read for a target of the wrong size

        found = self._read(keys, lambda at, got: pages.page_tensor(targets[at]).copy_(got))
        return [target if i < found else None for i, target in enumerate(targets)]

    def set(
        self,
        key: str,
        value: Any | None = None,
        target_location: Any | None = None,
        target_sizes: Any | None = None,
    ) -> bool:
        """Store one flat page (as ``get_data_page(index, flat=True)`` gives it)."""
        return self.batch_set([key], [value])

    def batch_set(
        self,
        keys: list[str],
        values: Any | None = None,
        target_locations: Any | None = None,
        target_sizes: Any | None = None,
    ) -> bool:
        """Store flat pages; whether every one was taken."""
        if self.store is None:
            return True
        _, pages = self._ready()
        if values is None or len(values) != len(keys):
            raise ValueError("batch_set needs one flat page per key")
        if not self.is_writer:
            return True
        payloads = [pages.page_tensor(value).contiguous() for value in values]
        return all(self._put(keys, payloads))

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    def clear(self) -> None:
        """Delete every page of this namespace from every tier."""
        if self.store is None:
            return
        namespace, _ = self._ready()
        self.store.clear(namespace.id)

    def close(self) -> None:
        """Flush the writes still queued for lower tiers, then close them."""
        if self.store is not None:
            self.store.close()

    # -- internals ------------------------------------------------------------------------

    def _ready(self) -> tuple[Namespace, HostPoolPages]:
        if self.namespace is None or self.pages is None:
            raise RuntimeError("SGLang has not registered its host pool with this backend yet")
        return self.namespace, self.pages

    def _keys(self, keys: Sequence[str]) -> list[BlockHash]:
        namespace, _ = self._ready()
        return [foreign_key(namespace, "sglang", key) for key in keys]

    def _read(self, keys: Sequence[str], into: Callable[[int, torch.Tensor], None]) -> int:
        """Read the pages of ``keys`` (``cachetier.connectors.reads.read_each``), handing each
        checked canonical payload to ``into(position, payload)``. Returns how many pages, from the
        first, were read. A page after a missing one may be copied too; SGLang uses only the
        leading run."""
        namespace, pages = self._ready()
        assert self.store is not None, "only called while cachetier runs"

        def land(position: int, payload: torch.Tensor) -> bool:
            into(position, payload)
            return True

        got = read_each(
            self.store, namespace, pages.kv_layout, self._keys(keys), land, self._scratch
        )
        return next((i for i, ok in enumerate(got) if not ok), len(got))

    def _put(self, keys: Sequence[str], payloads: Sequence[torch.Tensor]) -> list[bool]:
        namespace, pages = self._ready()
        assert self.store is not None, "only called while cachetier runs"
        layout = pages.kv_layout
        blocks = [
            payload_block(key, namespace.fingerprint, layout, payload)
            for key, payload in zip(self._keys(keys), payloads)
        ]
        try:
            stored = self.store.put_many(namespace.id, blocks)
        except CacheTierError as exc:
            log.warning("cachetier HiCache set failed: %s", exc)
            return [False] * len(keys)
        return [i < stored for i in range(len(keys))]


def shard_name(config: HiCacheStorageConfig) -> str:
    """Which part of the model's KV this rank holds, ``""`` for all of it.

    MHA heads are split over TP ranks; MLA's latent is the same on every TP rank. Pipeline
    stages hold different layers; context-parallel ranks different slices of each page.
    Data-parallel replicas hold the same KV and share pages.

    Args:
        config: SGLang's storage config of this rank.

    Returns:
        e.g. ``"tp1of4"``, ``"pp0of2,tp3of4"``.

    Raises:
        ValueError: a sharding this backend does not store (decode context parallel, heads
            split for a different TP size).
    """
    if config.dcp_size > 1:
        raise ValueError("cachetier's HiCache backend does not store decode-context-parallel pages")
    if config.should_split_heads:
        raise ValueError("cachetier's HiCache backend does not store heads split by tp_lcm_size")
    parts = []
    if config.pp_size > 1:
        parts.append(f"pp{config.pp_rank}of{config.pp_size}")
    if config.tp_size > 1 and not config.is_mla_model:
        parts.append(f"tp{config.tp_rank}of{config.tp_size}")
    if config.attn_cp_size > 1:
        parts.append(f"cp{config.attn_cp_rank}of{config.attn_cp_size}")
    return ",".join(parts)
