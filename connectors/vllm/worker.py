"""Worker side of the connector: copy whole blocks between vLLM's paged buffers and the tiers.

Sync loads run in ``start_load_kv``, before the forward that reads them; async loads (requests
vLLM holds back until ``get_finished`` names them) run on one loader thread beside the forwards,
on CPU pages (on CUDA the pinned staging is shared with the saves, so they run in
``start_load_kv`` too, and are reported finished at once). Saves start in ``wait_for_save``, after
the forward wrote every layer. A record holds a block of every layer, so both work on whole
blocks at once rather than layer by layer. On CUDA a save's device-to-host copy runs on a side
stream and reaches the store at a later call, when its event has fired (``PagedKV.poll``); on
CPU it is stored at once.

A vLLM block of ``n`` records is saved as ``n`` records cut from its canonical payload and
restored by joining them (``cachetier.kernels.records``), so vLLM shares records with engines of
other block sizes. A block that cannot be restored (missing, corrupt, failed checksum, another
layout) is reported through ``take_failed_block_ids`` so vLLM recomputes it instead of reading
stale KV; the blocks after it in the same request are reported too, since a prefix is only
usable up to its first gap.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor

import torch
from vllm.logger import init_logger

from cachetier.connectors.records import check_record
from cachetier.connectors.vllm import timing
from cachetier.connectors.vllm.events import (
    CacheTierKVEvents,
    VllmEventSink,
    note_tokens,
    watch_store,
)
from cachetier.connectors.vllm.group_kv import GroupKV
from cachetier.connectors.vllm.guard import verify_saved
from cachetier.connectors.vllm.layouts import VllmArrangement
from cachetier.connectors.vllm.metadata import (
    BlockTransfer,
    CacheTierConnectorMetadata,
    StoredBlocks,
)
from cachetier.connectors.vllm.stats import CacheTierConnectorStats
from cachetier.errors import CacheTierError
from cachetier.guard import GuardSampler
from cachetier.guard.record_check import RecordCheck
from cachetier.kernels.staging import PendingSave
from cachetier.primitives.keys import BlockHash
from cachetier.primitives.kv_format import DEFAULT_RECORD_TOKENS
from cachetier.record import KVBlock
from cachetier.store.record_guard import RecordGuard
from cachetier.store.tiered import TieredStore

logger = init_logger("vllm.cachetier.worker")


# Keys a load left to be verified, waiting for vLLM's computed blocks: a request aborted before
# its blocks are saved leaves its keys here, so the oldest are dropped past this bound.
MAX_PENDING_KEYS = 1 << 16
CLOSE_COUNTERS = ("puts", "bytes_in", "hits", "bytes_out", "rejected", "evictions")
"""The tier counters the worker logs as it closes."""


class CacheTierWorker:
    """The worker half of ``CacheTierConnector``.

    Args:
        store: the tiers, fastest first; the worker owns it and closes it on ``close()``.
        arrangement: how this run's KV cells map onto canonical blocks.
        layer_names: attention layers in model order (the order of layers inside a record).
        record_tokens: tokens per record; vLLM's block size must be a multiple of it.
        events: where the store's block changes go as KV events, when vLLM publishes them
            (``cachetier.connectors.vllm.events``); ``None``: nothing is collected.
        record_check: the check of every loaded record against its tokens
            (``cachetier.store.record_guard``); ``None`` for none.
        guard: the worker's own draws of new writers to verify first; ``None`` for none.
        more_groups: the arrangement and layers of each further KV cache group, after the
            first's (``arrangement``, ``layer_names``), where vLLM's hybrid manager made several.
            With several groups a failed load is reported as its request's
            (``take_load_results``): vLLM cannot map block ids of several groups back.
        checked_groups: the groups whose first layer is the model's, which ``record_check``
            recomputes; the others' records are not checked against their tokens.
    """

    def __init__(
        self,
        store: TieredStore,
        arrangement: VllmArrangement,
        layer_names: Sequence[str],
        record_tokens: int = DEFAULT_RECORD_TOKENS,
        events: VllmEventSink | None = None,
        record_check: RecordCheck | None = None,
        guard: GuardSampler | None = None,
        more_groups: Sequence[tuple[VllmArrangement, Sequence[str]]] = (),
        checked_groups: Sequence[int] = (0,),
    ) -> None:
        self._store = store
        self._guard = guard
        self._record_guard = RecordGuard(store, record_check, guard)
        # Records a load did not use because their writer is verified first: compared with
        # vLLM's computed blocks when those are saved (key -> the tier that held it).
        self._verify_pending: dict[BlockHash, str] = {}
        # A load from a store with a CPU tier leaves the records there, just used (a CPU hit is
        # touched, a lower tier's is promoted): the scheduler's view of that tier must learn it.
        self._cpu_takes_loads = any(tier.name == "cpu" for tier in store.tiers)
        groups = [(arrangement, layer_names), *more_groups]
        self._groups = [
            GroupKV(a, names, record_tokens, i in checked_groups)
            for i, (a, names) in enumerate(groups)
        ]
        self._by_request = len(self._groups) > 1
        self._failed_loads: set[str] = set()
        self._failed_block_ids: set[int] = set()
        self._failed_req_ids: set[str] = set()
        self._report = StoredBlocks()
        self._stats = CacheTierConnectorStats()
        # The step's forward is timed from bind (before it) to save (after it), less our loads.
        self._step_start: float | None = None
        self._step_load_s = 0.0
        self._loaded_since_report = False
        # The loader thread's results meet the step's here: failed block ids, the report, the
        # stats and the requests whose async loads ended are all taken under this lock.
        self._lock = threading.Lock()
        self._loader: ThreadPoolExecutor | None = None
        self._finished_loads: set[str] = set()
        self._events = events
        self._tier_events = None if events is None else watch_store(store, events, record_tokens)

    def register_kv_caches(
        self, kv_caches: Mapping[str, torch.Tensor], aux: bytes | Sequence[bytes] = b""
    ) -> None:
        """Take vLLM's per-layer KV tensors (checked against each group's layout).

        Args:
            kv_caches: the tensors by layer name.
            aux: what every record's ``aux`` holds: the layers' fp8 scales
                (``layouts.fp8_scales``), ``b""`` for unscaled KV, one per group where there
                are several. A restored record with other side data is refused (recomputed).
        """
        auxes = [aux] * len(self._groups) if isinstance(aux, bytes) else list(aux)
        for group, group_aux in zip(self._groups, auxes, strict=True):
            paged = group.register(kv_caches, group_aux)
            logger.info(
                "cachetier: %d layers x %d blocks of %d tokens on %s (%s), %.2f MB per block, "
                "tiers %s",
                len(group.layer_names),
                paged.num_blocks,
                group.layout.block_size,
                paged.device,
                group.arrangement.kind,
                group.layout.block_bytes / 1e6,
                [tier.name for tier in self._store.tiers],
            )

    def step_started(self) -> None:
        """vLLM bound this step's metadata: its forward is about to run."""
        self._step_start = time.perf_counter()
        self._step_load_s = 0.0

    def load(self, meta: CacheTierConnectorMetadata) -> None:
        """Restore this step's planned blocks into the paged buffers (before the forward)."""
        start = time.perf_counter()
        try:
            self._load(meta)
        finally:
            self._step_load_s += time.perf_counter() - start

    def _load(self, meta: CacheTierConnectorMetadata) -> None:
        self._failed_req_ids.clear()
        for group in self._groups:
            self._store_saved(group.paged.poll())
            # These loads and this step's forward may write pages that earlier saves are still
            # copying out: order them after those copies (on the GPU; the host does not wait).
            group.paged.fence()
        for transfer in meta.loads:
            self._load_one(transfer)
        # A request's loads of every group end together: vLLM hears of it once.
        by_request: dict[str, list[BlockTransfer]] = {}
        for transfer in meta.async_loads:
            by_request.setdefault(transfer.req_id, []).append(transfer)
        for transfers in by_request.values():
            if self._groups[0].paged.device.type == "cpu":
                if self._loader is None:
                    self._loader = ThreadPoolExecutor(1, thread_name_prefix="cachetier-load")
                self._loader.submit(self._load_async, transfers)
            else:
                self._load_async(transfers)

    def _load_async(self, transfers: Sequence[BlockTransfer]) -> None:
        """One request's async loads, then the request reported finished, whatever happened:
        vLLM holds the request (and, if it was aborted meanwhile, its blocks) until then."""
        try:
            for transfer in transfers:
                self._load_one(transfer, asynchronous=True)
        except BaseException as exc:  # a thread's error would otherwise vanish
            logger.error(
                "cachetier: async load for request %s failed: %r", transfers[0].req_id, exc
            )
            with self._lock:
                for transfer in transfers:
                    self._failed_from(transfer, 0)
        finally:
            with self._lock:
                self._finished_loads.add(transfers[0].req_id)

    def take_finished_loads(self) -> set[str]:
        """Requests whose async loads ended since the last call (their failed blocks were
        handed to ``take_failed_block_ids`` first): ``take_load_results``' first part."""
        return self.take_load_results()[0]

    def take_load_results(self) -> tuple[set[str], set[str]]:
        """The requests whose async loads ended since the last call, and those of them whose
        load failed where there are several KV cache groups (vLLM then recomputes each from its
        start: it cannot map block ids of several groups back to a request)."""
        with self._lock:
            finished, self._finished_loads = self._finished_loads, set()
            failed = self._failed_loads & finished
            self._failed_loads -= failed
        return finished, failed

    def save(self, meta: CacheTierConnectorMetadata) -> None:
        """Store this step's completed blocks (after the forward wrote them)."""
        if self._step_start is not None and meta.step_tokens:
            forward_s = time.perf_counter() - self._step_start - self._step_load_s
            with self._lock:
                self._report.steps.append((meta.step_tokens, meta.step_attention, forward_s))
        self._step_start = None
        start = time.perf_counter()
        for transfer in meta.saves:
            if transfer.req_id in self._failed_req_ids:
                # Its forward attended over blocks that failed to load, so what it wrote is
                # wrong; vLLM recomputes it and the scheduler plans the save again.
                with self._lock:
                    self._report.failed.setdefault(transfer.namespace_id, []).extend(transfer.keys)
                continue
            self._save_one(transfer)
        copied = time.perf_counter()
        timing.add("wait_for_save.copy", copied - start)
        for group in self._groups:
            self._store_saved(group.paged.poll())
        timing.add("wait_for_save.store", time.perf_counter() - copied)

    def take_failed_block_ids(self) -> set[int]:
        """vLLM block ids whose load failed since the last call."""
        with self._lock:
            failed, self._failed_block_ids = self._failed_block_ids, set()
        return failed

    def take_report(self) -> StoredBlocks | None:
        """What was stored or failed since the last call, for the scheduler (or ``None``)."""
        with self._lock:
            report, self._report = self._report, StoredBlocks()
            loaded, self._loaded_since_report = self._loaded_since_report, False
        if loaded:
            report.rates = self._store.rates.measured()
        if (
            report.stored
            or report.failed
            or report.steps
            or report.rates
            or report.copies
            or report.quarantined
        ):
            return report
        return None

    def take_kv_events(self) -> CacheTierKVEvents | None:
        """The tiers' KV events since the last call, for vLLM to publish (``None``: none)."""
        events = self._events.take() if self._events is not None else []
        return CacheTierKVEvents(events) if events else None

    def take_stats(self) -> CacheTierConnectorStats | None:
        """Counters since the last call (``None`` if nothing happened)."""
        with self._lock:
            if self._stats.is_empty():
                return None
            stats, self._stats = self._stats, CacheTierConnectorStats()
        return stats

    def tier_stats(self) -> dict[str, object]:
        """The store's counters, per tier (``TieredStore.stats``)."""
        return self._store.stats()

    def close(self) -> None:
        """Finish loads and copies in flight, flush queued writes to the lower tiers and close
        them."""
        if self._loader is not None:
            self._loader.shutdown(wait=True)
        for group in self._groups:
            if group.registered is not None:
                self._store_saved(group.registered.drain())
        self._store.close()
        # What each tier took in over the process's life: what an operator (or a benchmark)
        # reads to see whether the lower tiers kept up with the saves.
        stats = self._store.stats()
        logger.info(
            "cachetier: tier counters at close: %s; %d blocks dropped from full write queues",
            {name: {k: t.get(k, 0) for k in CLOSE_COUNTERS} for name, t in stats["tiers"].items()},
            stats.get("rejected", 0),
        )

    def _load_one(self, transfer: BlockTransfer, *, asynchronous: bool = False) -> None:
        group = self._groups[transfer.group]
        start = time.perf_counter()
        if self._tier_events is not None:
            # A block restored from a lower tier is promoted into the first: its event there
            # carries these tokens.
            note_tokens(self._tier_events.tokens, transfer)
        try:
            restored = self._store.restore_prefix(
                transfer.namespace_id, list(transfer.keys), fingerprint=transfer.fingerprint
            )
            records, sources = list(restored.blocks), list(restored.sources)
        except (CacheTierError, OSError) as exc:
            logger.warning("cachetier: restore for request %s failed: %s", transfer.req_id, exc)
            records, sources = [], []
        good = self._admitted(transfer, records, sources)
        per_block = transfer.per_block
        num_good = len(good) // per_block  # whole vLLM blocks
        copy_s = 0.0
        if num_good:
            # ``write`` waits for the copy's end, so its time never counts as the forward's
            # (the prefill model's), and the scheduler's cost model adds what a loaded block
            # costs to copy in.
            copy_s = group.paged.write(
                transfer.block_ids[:num_good], group.block_payloads(good, per_block, num_good)
            )
        elapsed = time.perf_counter() - start
        by_tier: dict[str, int] = {}
        # By block, each counted where its first record came from.
        for source in sources[: num_good * per_block : per_block]:
            by_tier[source] = by_tier.get(source, 0) + 1
        with self._lock:
            if num_good:
                self._report.copies.append((num_good * group.layout.block_bytes, copy_s))
                self._stats.add(copy_s=copy_s)
                if self._cpu_takes_loads:
                    loaded = transfer.keys[: num_good * per_block]
                    self._report.stored.setdefault(transfer.namespace_id, []).extend(loaded)
            if num_good < len(transfer.block_ids):
                self._failed_from(transfer, num_good)
                if not asynchronous:
                    # This step's forward reads those blocks: what it writes is not saved.
                    # An async request's forward comes after vLLM has taken the failure in.
                    self._failed_req_ids.add(transfer.req_id)
            self._loaded_since_report = True
            self._stats.add(
                num_loaded_blocks=num_good,
                num_load_errors=len(transfer.block_ids) - num_good,
                num_async_loads=int(asynchronous),
                loaded_bytes=num_good * group.layout.block_bytes,
                load_s=elapsed,
                **{f"loaded_from_{tier}": count for tier, count in by_tier.items()},
            )
        logger.info(
            "cachetier: request %s loaded %d/%d blocks (%d tokens) from %s in %.1f ms%s%s",
            transfer.req_id,
            num_good,
            len(transfer.block_ids),
            num_good * group.layout.block_size,
            by_tier or "no tier",
            1e3 * elapsed,
            " (async)" if asynchronous else "",
            ""
            if num_good == len(transfer.block_ids)
            else f"; {len(transfer.block_ids) - num_good} failed, vLLM recomputes them",
        )

    def _admitted(
        self, transfer: BlockTransfer, records: Sequence[KVBlock], sources: Sequence[str]
    ) -> list[KVBlock]:
        """The leading loaded records that pass their checks: the record's own (key,
        fingerprint, layout), then by writer and against their tokens (``RecordGuard``);
        where it stops at a writer to verify, the rest wait for vLLM's computed blocks."""
        good: list[KVBlock] = []
        group = self._groups[transfer.group]
        for record, key in zip(records, transfer.keys, strict=False):
            problem = check_record(
                record, key, transfer.fingerprint, group.record_layout, group.aux
            )
            if problem is not None:
                logger.warning("cachetier: record %s... holds %s", key.hex()[:16], problem)
                break
            good.append(record)
        if not good:
            return good
        admitted = self._record_guard.admit(
            transfer.namespace_id,
            good,
            sources[: len(good)],
            # The check recomputes the model's first layer: only a group that starts with it.
            (transfer.token_ids or None) if group.starts_with_first_layer else None,
            transfer.first_position,
        )
        if admitted.verify:
            with self._lock:
                for key, tier in zip(
                    transfer.keys[admitted.count : len(good)], sources[admitted.count :]
                ):
                    self._verify_pending[key] = tier
                while len(self._verify_pending) > MAX_PENDING_KEYS:
                    self._verify_pending.pop(next(iter(self._verify_pending)))
        return good[: admitted.count]

    def _failed_from(self, transfer: BlockTransfer, index: int) -> None:
        """Report a load's blocks from ``index`` on as failed: to vLLM, which recomputes them,
        and to the scheduler, which stops counting them stored. Under ``_lock``."""
        if self._by_request:
            self._failed_loads.add(transfer.req_id)
        else:
            self._failed_block_ids.update(transfer.block_ids[index:])
        failed_keys = transfer.keys[index * transfer.per_block :]
        self._report.failed.setdefault(transfer.namespace_id, []).extend(failed_keys)

    def _save_one(self, transfer: BlockTransfer) -> None:
        try:
            paged = self._groups[transfer.group].paged
            paged.save(transfer.block_ids, (transfer, time.perf_counter()))
        except ValueError as exc:
            logger.warning("cachetier: save for request %s failed: %s", transfer.req_id, exc)
            with self._lock:
                self._report.failed.setdefault(transfer.namespace_id, []).extend(transfer.keys)

    def _store_saved(self, saved: Sequence[PendingSave]) -> None:
        """Hand finished copies to the store, and tell the scheduler what is stored."""
        for pending in saved:
            transfer, start = pending.tag  # type: ignore[misc]
            group = self._groups[transfer.group]
            records = group.records(transfer, pending.payloads)
            if transfer.verify_tiers or self._verify_pending:
                # Compared before storing: the tier's own record.
                began = verify_saved(
                    self._store,
                    transfer,
                    records,
                    group.record_layout.describe(),
                    self._verify_pending,
                    self._guard,
                )
                with self._lock:
                    self._report.quarantined.extend(began)
            if self._tier_events is not None:
                note_tokens(self._tier_events.tokens, transfer)
            try:
                stored = self._store.put_many(
                    transfer.namespace_id, records, generated=transfer.generated or None
                )
            except (CacheTierError, OSError) as exc:
                logger.warning("cachetier: save for request %s failed: %s", transfer.req_id, exc)
                stored = 0
            # put_many stores in the first tier now and queues the rest; the CPU tier (if
            # first) is what the scheduler cannot see by itself.
            with self._lock:
                done = self._report.stored if stored == len(records) else self._report.failed
                done.setdefault(transfer.namespace_id, []).extend(transfer.keys)
                self._stats.add(
                    num_saved_blocks=stored,
                    num_save_errors=len(records) - stored,
                    saved_bytes=stored * group.record_layout.block_bytes,
                    save_s=time.perf_counter() - start,
                )
            logger.debug(
                "cachetier: request %s saved %d/%d blocks", transfer.req_id, stored, len(records)
            )
