"""``CacheTierConnector``: cachetier's tiers (CPU, disk, Redis) as a vLLM v1 KV connector.

Turn it on with::

    kv_transfer_config={
        "kv_connector": "CacheTierConnector",
        "kv_connector_module_path": "cachetier.connectors.vllm.connector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"disk_path": "/var/cache/kv", "cpu_bytes": 2 << 30},
    }

(keys of the extra config: ``cachetier.connectors.vllm.config.ConnectorConfig``). vLLM builds one
instance per role: the scheduler's plans loads and saves (``cachetier.connectors.vllm.scheduler``),
the worker's copies whole blocks (``cachetier.connectors.vllm.worker``); the metadata between them
is plain data, so they may live in one process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) or two.

Where vLLM publishes KV events (``--kv-events-config``), what the tiers store and let go of is
published with vLLM's own events, each tier as its medium (``cachetier.connectors.vllm.events``).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)
from vllm.logger import init_logger
from vllm.v1.kv_cache_interface import MLAAttentionSpec, get_kv_cache_spec_kind

from cachetier.connectors.config import (
    VLLM_PLUGIN_KEYS,
    ConnectorConfig,
    model_folder_fingerprint,
    open_store,
    plugin_config,
)
from cachetier.connectors.vllm.events import (
    SchedulerEvents,
    VllmEventSink,
    kv_events_enabled,
)
from cachetier.connectors.vllm.kv_groups import StoredGroup, storable_groups
from cachetier.connectors.vllm.layouts import VllmArrangement, fp8_scales, resolve
from cachetier.connectors.vllm.metadata import CacheTierConnectorMetadata
from cachetier.connectors.vllm.scheduler import CacheTierScheduler
from cachetier.connectors.vllm.stats import CacheTierConnectorStats
from cachetier.connectors.vllm.timing import timed
from cachetier.connectors.vllm.worker import CacheTierWorker
from cachetier.guard import GuardSampler
from cachetier.guard.first_layer import FirstLayer
from cachetier.guard.record_check import RecordCheck
from cachetier.util.log_setup import share_handlers

if TYPE_CHECKING:
    from collections.abc import Iterable

    from vllm.config import VllmConfig
    from vllm.distributed.kv_events import KVCacheEvent, KVConnectorKVEvents
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.metrics.cache_hit_source import CacheHitSource
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = init_logger("vllm.cachetier.connector")


class CacheTierConnector(KVConnectorBase_V1, SupportsHMA):
    """Persistent prefix KV in cachetier's tiers, for vLLM on CPU or CUDA (module docstring).

    It takes vLLM's hybrid KV cache manager (``SupportsHMA``): a model of sliding-window and
    full-attention layers keeps its KV cache groups, and each group's records hold its layers.

    Args:
        vllm_config: the engine's config; ``kv_transfer_config.kv_connector_extra_config``
            holds the ``ConnectorConfig`` keys.
        role: scheduler or worker.
        kv_cache_config: the engine's KV cache groups (``cachetier.connectors.vllm.kv_groups``).
    """

    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig | None = None,
    ) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        share_handlers("vllm")  # the core's warnings in vLLM's own format
        self._scheduler: CacheTierScheduler | None = None
        self._worker: CacheTierWorker | None = None
        self._events: SchedulerEvents | None = None
        try:
            self._start(vllm_config, role, kv_cache_config)
        except Exception as exc:
            # vLLM fails its start on it (a connector its kv_transfer_config names cannot be
            # left out, so there is no running without cachetier here); this line says so
            # where vLLM's own traceback may be far from the cause.
            logger.error(
                "cachetier's vLLM connector could not start (%s): %s. vLLM does not start "
                "without it; fix kv_connector_extra_config",
                role.name.lower(),
                exc,
            )
            raise

    def _start(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig | None,
    ) -> None:
        if kv_cache_config is None:
            raise ValueError("CacheTierConnector needs vLLM's KVCacheConfig (vLLM >= 0.11)")
        # Secrets from the environment: ``vllm serve`` logs its kv_transfer_config.
        config = plugin_config(
            self._kv_transfer_config.kv_connector_extra_config or {},
            os.environ,
            source="kv_connector_extra_config",
            keys=VLLM_PLUGIN_KEYS,
        )
        parallel = vllm_config.parallel_config
        if parallel.tensor_parallel_size * parallel.pipeline_parallel_size != 1:
            # Each rank holds a slice of the heads or layers; one key would name several slices.
            raise ValueError("CacheTierConnector supports tensor/pipeline parallel size 1 only")
        groups = _groups_of(kv_cache_config, vllm_config)
        self._groups = groups
        layout = groups[0][1].layout
        if getattr(self._kv_transfer_config, "kv_load_failure_policy", "recompute") != "recompute":
            logger.warning(
                "cachetier: kv_load_failure_policy is %r, so a block that cannot be restored "
                "(evicted, corrupt) fails its request; set it to 'recompute' to recompute it",
                self._kv_transfer_config.kv_load_failure_policy,
            )
        publish = kv_events_enabled(vllm_config)  # else nothing is collected
        if role == KVConnectorRole.SCHEDULER:
            fingerprint = config.model_fingerprint or _model_fingerprint(vllm_config)
            self._scheduler = CacheTierScheduler(
                open_store(config, with_cpu=False) if config.has_shared_tier else None,
                layout,
                fingerprint,
                config.tenant,
                # The worker's CPU tier holds records, several per block where they are smaller.
                config.store.cpu_bytes
                // sum(arrangement.layout.block_bytes for _, arrangement in groups)
                * len(groups)
                * (layout.block_size // config.record_tokens),
                cost_model=config.kv_load_policy == "cost",
                chunk_tokens=vllm_config.scheduler_config.max_num_batched_tokens,
                load_async=config.load_async,
                record_tokens=config.record_tokens,
                guard=GuardSampler(config.guard_config()) if config.guard else None,
                with_tokens=publish,
                groups=[(group, arrangement.layout) for group, arrangement in groups],
            )
            # The worker publishes every tier's changes, the shared ones included: its store
            # holds the same disk, Redis and sidecar tiers as this side's, which only looks
            # keys up (it stores, evicts and deletes nothing), so publishing this side's too
            # would tell each of those blocks twice.
            self._events = SchedulerEvents() if publish else None
            logger.info(
                "cachetier scheduler: model %s..., layout %s, tenant %r",
                fingerprint[:12],
                layout,
                config.tenant,
            )
        else:
            store = open_store(config, with_cpu=True)
            kind = get_kv_cache_spec_kind(kv_cache_config.kv_cache_groups[0].kv_cache_spec)
            (first, arrangement), *more = groups
            self._worker = CacheTierWorker(
                store,
                arrangement,
                first.layer_names,
                config.record_tokens,
                events=VllmEventSink.for_store(store, kind.value) if publish else None,
                record_check=record_check_of(config, vllm_config.model_config.model),
                guard=GuardSampler(config.guard_config()) if config.guard else None,
                more_groups=[(a, group.layer_names) for group, a in more],
                checked_groups=[
                    i for i, (g, _) in enumerate(groups) if g.layers.split(",")[0] in ("", "0")
                ],
            )

    @property
    def requires_kv_delivery(self) -> bool:
        # A best-effort cache: a save that never happens is only a later miss.
        return False

    # Worker side.

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        scales = [
            fp8_scales(self._vllm_config, group.layer_names, arrangement.layout)
            for group, arrangement in self._groups
        ]
        self._require_worker().register_kv_caches(kv_caches, scales)

    @timed("bind_connector_metadata")
    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        if self._worker is not None:
            self._worker.step_started()

    @timed("start_load_kv")
    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        """Copy this step's restored blocks into the paged buffers (all layers): the sync loads
        before returning (the forward reads them), the async ones on the worker's loader
        thread (``get_finished`` reports them)."""
        self._require_worker().load(self._metadata())

    @timed("get_finished")
    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """No sends to wait for (saves end within their step); the requests whose async loads
        ended since the last call, failed ones included (their failed blocks are reported by
        ``get_block_ids_with_load_errors`` in the same step or an earlier one)."""
        return None, self._require_worker().take_finished_loads() or None

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """``get_finished``'s loads, and those that failed: with several KV cache groups a
        failed load is reported by request (vLLM recomputes it from its start), never by
        block id (``get_block_ids_with_load_errors``), which vLLM refuses for several."""
        finished, failed = self._require_worker().take_load_results()
        return KVConnectorTransferResults(finished_recving=finished, failed_recving=failed)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Nothing to wait for: ``start_load_kv`` copied every layer already."""

    def save_kv_layer(
        self,
        layer_name: str,
        kv_layer: torch.Tensor,
        attn_metadata: AttentionMetadata,
        **kwargs: Any,
    ) -> None:
        """Nothing per layer: a record holds every layer of a block, so ``wait_for_save``
        copies whole blocks once the forward has written all layers."""

    @timed("wait_for_save")
    def wait_for_save(self) -> None:
        """Store the blocks this step completed, before vLLM may reuse them."""
        if self.has_connector_metadata():
            self._require_worker().save(self._metadata())

    @timed("get_block_ids_with_load_errors")
    def get_block_ids_with_load_errors(self) -> set[int]:
        """vLLM block ids whose load failed this step; vLLM recomputes them."""
        return self._require_worker().take_failed_block_ids()

    @timed("build_connector_worker_meta")
    def build_connector_worker_meta(self) -> Any:
        return self._require_worker().take_report()

    @timed("get_kv_connector_stats")
    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        return self._worker.take_stats() if self._worker is not None else None

    @timed("get_kv_connector_kv_cache_events")
    def get_kv_connector_kv_cache_events(self) -> KVConnectorKVEvents | None:
        """The tiers' KV events since the last step (where vLLM publishes KV events)."""
        return self._worker.take_kv_events() if self._worker is not None else None

    @classmethod
    def build_kv_connector_stats(
        cls, data: dict[str, Any] | None = None
    ) -> KVConnectorStats | None:
        return CacheTierConnectorStats(data=dict(data or {}))

    def tier_stats(self) -> dict[str, Any] | None:
        """The worker's tiers' counters (``TieredStore.stats``), ``None`` on the scheduler."""
        return self._worker.tier_stats() if self._worker is not None else None

    def shutdown(self) -> None:
        """Flush queued writes (disk, Redis) and close the tiers."""
        if self._worker is not None:
            self._worker.close()
        if self._scheduler is not None:
            self._scheduler.close()

    # Scheduler side.

    @timed("get_num_new_matched_tokens")
    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """Tokens after ``num_computed_tokens`` whose blocks are stored and worth loading, and
        whether to load them asynchronously."""
        return self._require_scheduler().get_num_new_matched_tokens(request, num_computed_tokens)

    @timed("update_state_after_alloc")
    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        self._require_scheduler().update_state_after_alloc(request, blocks, num_external_tokens)

    @timed("build_connector_meta")
    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return self._require_scheduler().build_connector_meta(scheduler_output)

    @timed("update_connector_output")
    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        self._require_scheduler().update_connector_output(connector_output.kv_connector_worker_meta)
        if self._events is not None:
            self._events.add(connector_output.kv_cache_events)

    def take_events(self) -> Iterable[KVCacheEvent]:
        """The workers' tier events of this step, for vLLM to publish beside its own."""
        return self._events.take() if self._events is not None else ()

    @timed("request_finished")
    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        """The request's full blocks were saved as they were computed: free them now."""
        return self._require_scheduler().request_finished(request)

    @timed("request_finished")
    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        """``request_finished`` where vLLM's hybrid KV cache manager is on: every group's
        blocks were saved (those a hit can use) as they were computed."""
        return self._require_scheduler().request_finished(request)

    def get_external_cache_hit_sources(
        self, request: Request, num_external_tokens: int
    ) -> dict[CacheHitSource, int]:
        return self._require_scheduler().hit_sources(request, num_external_tokens)

    def _metadata(self) -> CacheTierConnectorMetadata:
        meta = self._get_connector_metadata()
        assert isinstance(meta, CacheTierConnectorMetadata), f"foreign metadata {type(meta)}"
        return meta

    def _require_worker(self) -> CacheTierWorker:
        if self._worker is None:
            raise RuntimeError("worker-side method called on the scheduler-side connector")
        return self._worker

    def _require_scheduler(self) -> CacheTierScheduler:
        if self._scheduler is None:
            raise RuntimeError("scheduler-side method called on the worker-side connector")
        return self._scheduler


def _groups_of(
    kv_cache_config: KVCacheConfig, vllm_config: VllmConfig
) -> list[tuple[StoredGroup, VllmArrangement]]:
    """Each KV cache group cachetier stores (``cachetier.connectors.vllm.kv_groups``), with how
    its blocks map to canonical ones."""
    from vllm.platforms import current_platform

    block_size = vllm_config.cache_config.block_size
    out = []
    for group in storable_groups(kv_cache_config, vllm_config.model_config.model):
        spec = group.spec
        if spec.block_size != block_size:
            raise ValueError(
                f"KV spec block size {spec.block_size} != cache block size {block_size}"
            )
        arrangement = resolve(
            device_type=current_platform.device_type,
            is_mla=isinstance(spec, MLAAttentionSpec),
            dtype=spec.dtype,
            block_size=block_size,
            num_layers=len(group.layer_names),
            num_kv_heads=spec.num_kv_heads,
            head_size=spec.head_size,
            kv_cache_dtype=vllm_config.cache_config.cache_dtype,
        )
        out.append((group, arrangement))
    return out


def record_check_of(config: ConnectorConfig, model: str) -> RecordCheck | None:
    """The worker's check of every loaded record (``cachetier.guard.record_check``), its first
    layer read from the model folder vLLM loads; ``None`` where ``record_check`` is off or
    the folder cannot give it (said once at WARNING: loads go on unchecked by it)."""
    if not config.record_check:
        return None
    try:
        return RecordCheck(FirstLayer.from_folder(model), config.record_check_tokens)
    except (ValueError, OSError, KeyError) as exc:
        logger.warning(
            "cachetier: no per-record check of restored KV (record_check): the model folder "
            "%s cannot give the first layer's weights: %s",
            model,
            exc,
        )
        return None


def _model_fingerprint(vllm_config: VllmConfig) -> str:
    """Fingerprint of the weights vLLM loads (hashed once, then cached in the folder)."""
    model_config = vllm_config.model_config
    return model_folder_fingerprint(
        model_config.model,
        model_config.revision,
        key="kv_connector_extra_config['model_fingerprint']",
    )
