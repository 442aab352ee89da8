"""Scheduler side of the connector: which leading blocks of a request are stored, and the plan
of whole-block loads and saves the worker carries out each step.

A request's records are keyed with ``cachetier.primitives.keys.block_keys`` over its token ids in a
``Namespace(model fingerprint, canonical record layout, tenant + cache salt, layers)``, one per
KV cache group. A record holds ``record_tokens`` tokens, the same in every engine, and a vLLM
block ``block_size / record_tokens`` of them: block ``i`` is keys ``[i * n, (i + 1) * n)``.
vLLM takes a hit in whole blocks, and in every group at once (``windows``).

- ``get_num_new_matched_tokens`` asks the store how many blocks after vLLM's own prefix hit are
  stored, stopping one token short of the prompt (vLLM must compute at least one token), and
  reports the leading part that the cost model finds faster to load than to recompute (tier
  rates, the copy into vLLM's KV memory and prefill speed come from the worker's reports).
- ``update_state_after_alloc`` turns a hit into a load of those keys into the allocated blocks.
  A hit whose every block comes over a network (Redis, a sidecar) is loaded asynchronously by
  default (``load_async``): vLLM runs the others until the worker reports it loaded. With
  several groups every load is asynchronous: vLLM then takes failures by request only.
- ``build_connector_meta`` hands the step's loads to the worker, plus a save of every block
  whose last token this step computes; the worker saves after the forward, in the same step, so
  no block is ever freed while a save of it is pending and ``request_finished`` frees at once.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from vllm.logger import init_logger
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from cachetier.connectors.config import check_load_async
from cachetier.connectors.vllm.cpu_index import WorkerCPUIndex
from cachetier.connectors.vllm.guard import draw
from cachetier.connectors.vllm.kv_groups import StoredGroup
from cachetier.connectors.vllm.metadata import (
    BlockTransfer,
    CacheTierConnectorMetadata,
    StoredBlocks,
)
from cachetier.connectors.vllm.refusals import RefusalLearner
from cachetier.connectors.vllm.steps import cacheable, describe_step
from cachetier.connectors.vllm.tracked import Tracked
from cachetier.connectors.vllm.windows import WindowedLookup, first_saved_block
from cachetier.errors import CacheTierError
from cachetier.guard import GuardSampler, QuarantineList
from cachetier.primitives.keys import (
    BlockHash,
    KVLayout,
    Namespace,
    block_keys,
    record_layout,
    records_per_block,
)
from cachetier.primitives.kv_format import DEFAULT_RECORD_TOKENS
from cachetier.store.costmodel import CopyRate, CostModel, PrefillModel, TierRates
from cachetier.store.tiered import TieredStore

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

logger = init_logger("vllm.cachetier.scheduler")

_HIT_SOURCES = {"cpu": CacheHitSource.HOST, "disk": CacheHitSource.DISK}


class CacheTierScheduler:
    """The scheduler half of ``CacheTierConnector``.

    Args:
        store: the shared tiers (disk, Redis) to look blocks up in; ``None`` if the worker's CPU
            tier is the only tier.
        layout: the (canonical) layout of a vLLM block of this model.
        model_fingerprint: identity of the weights.
        tenant: tenant name; a request's cache salt is added to it.
        cpu_index_blocks: capacity of the worker's CPU tier in blocks (0 if it has none).
        cost_model: report only hits that load faster than they recompute; ``False`` reports
            every hit.
        chunk_tokens: vLLM's ``max_num_batched_tokens`` (a recompute runs in such chunks).
        load_async: which hits vLLM loads asynchronously: ``network`` (every block from a tier
            over a network), ``always`` or ``never`` (``ConnectorConfig.load_async``).
        record_tokens: tokens per record (``ConnectorConfig.record_tokens``); vLLM's block
            size must be a multiple of it.
        guard: which hits to verify by letting vLLM compute them (``None``: none).
        with_tokens: send loads' and saves' tokens to the worker, for vLLM's KV events.
        groups: each KV cache group with its block layout, where vLLM's hybrid manager made
            several or a sliding-window one (``cachetier.connectors.vllm.windows``); empty for
            one group of every layer, whose block layout is ``layout``.
    """

    def __init__(
        self,
        store: TieredStore | None,
        layout: KVLayout,
        model_fingerprint: str,
        tenant: str,
        cpu_index_blocks: int,
        *,
        cost_model: bool = True,
        chunk_tokens: int = 2048,
        load_async: str = "network",
        record_tokens: int = DEFAULT_RECORD_TOKENS,
        guard: GuardSampler | None = None,
        with_tokens: bool = False,
        groups: Sequence[tuple[StoredGroup, KVLayout]] = (),
    ) -> None:
        check_load_async(load_async)
        self._store = store
        self._with_tokens = with_tokens
        self._guard = guard
        # The worker's quarantines (it reports them): the store's lookups honour them, and the
        # worker's CPU tier, which this side sees through its index only, is checked here.
        self.quarantines = store.quarantines if store is not None else QuarantineList()
        self._load_async = load_async
        # The worker's CPU tier ("cpu") is in its own process, never over a network.
        self._network_tiers = frozenset(
            t.name for t in (store.tiers if store is not None else ()) if t.over_network
        )
        self._async_loads: list[BlockTransfer] = []
        self._layout = layout
        self._block_size = layout.block_size
        self._record_layout = record_layout(layout, record_tokens)
        self._per_block = records_per_block(layout.block_size, record_tokens)
        self._groups = [group for group, _ in groups]
        # Namespaces' layers and record layouts per group, the first group's first.
        self._group_layers = [group.layers for group in self._groups] or [""]
        self._group_layouts = [record_layout(lay, record_tokens) for _, lay in groups] or [
            self._record_layout
        ]
        self._windowed = any(group.window is not None for group in self._groups)
        # vLLM maps failed block ids back to requests for one group only: with several, every
        # load is asynchronous, so a failure is reported by request.
        self._by_request = len(self._groups) > 1
        self._model_fingerprint = model_fingerprint
        self._tenant = tenant
        self._cpu_index = WorkerCPUIndex(cpu_index_blocks)
        self._requests: dict[str, Tracked] = {}
        # Lookups here measure latency; reads and forwards happen in the worker, which reports
        # its rates and prefill step times back (``StoredBlocks``).
        self.rates = store.rates if store is not None else TierRates()
        self.prefill = PrefillModel()
        self.copy = CopyRate()
        self.cost = CostModel(self.rates, self.prefill, copy=self.copy, enabled=cost_model)
        self._chunk_tokens = chunk_tokens
        self.num_recomputed_by_choice_tokens = 0
        self._refusals = RefusalLearner(self.cost, self._requests)

    def namespace(self, cache_salt: str | None) -> Namespace:
        """The namespace of a request with this cache salt (of its first KV cache group)."""
        return self.namespaces(cache_salt)[0]

    def namespaces(self, cache_salt: str | None) -> list[Namespace]:
        """The namespace of each KV cache group of a request with this cache salt."""
        tenant = self._tenant if not cache_salt else f"{self._tenant}\0{cache_salt}"
        return [
            Namespace(self._model_fingerprint, lay, tenant, layers)
            for lay, layers in zip(self._group_layouts, self._group_layers, strict=True)
        ]

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int, bool]:
        """Tokens after vLLM's own ``num_computed_tokens`` that can be loaded, and whether
        vLLM should load them asynchronously (``load_async``)."""
        if not cacheable(request) or num_computed_tokens % self._block_size:
            return 0, False
        first = num_computed_tokens // self._block_size
        last = (request.num_tokens - 1) // self._block_size  # one token is left to compute
        tracked = self._track(request)
        if tracked.failed_from is not None:
            last = min(last, tracked.failed_from)
        if last <= first:
            return 0, False
        n = self._per_block
        keys = self._keys_upto(tracked, last * n)[first * n : last * n]
        windows = self._windowed_lookup(tracked) if self._windowed else None
        if windows is not None:
            _, spans = windows.hit(first, last)
            keys = keys[: sum(count for _, count in spans)]
        else:
            spans = self._lookup(tracked.namespace.id, keys)  # in records
        if tracked.verify or self._drawn(tracked, spans, keys):
            tracked.hit = (first, 0, {})  # vLLM computes it; its saves are compared
            return 0, False
        record_tokens = self._record_layout.block_size
        plan = self.cost.plan(
            spans,
            block_bytes=self._record_layout.block_bytes,
            block_size=record_tokens,
            cached_tokens=num_computed_tokens,
            num_tokens=request.num_tokens,
            chunk_tokens=self._chunk_tokens,
            prefix_only=True,  # vLLM takes a number of leading tokens
            request_id=request.request_id,
        )
        tracked.refused_plan = plan if plan.refused else None
        tracked.refused_compute_s = 0.0
        if all(tier != "cpu" for tier, _ in spans):
            # The shared tiers hold the whole hit, recomputed or not: saving the recomputed
            # blocks again would only write the same records over themselves. (The worker's
            # CPU tier is known from reports only, and may have evicted what it reported.)
            tracked.num_known_stored = first + plan.num_hit_blocks // n
        num_hit = plan.num_load_blocks // n  # vLLM loads whole blocks
        if windows is not None and num_hit:
            num_hit = windows.end_within(first, first + num_hit) - first
        by_tier: dict[str, int] = {}  # tokens
        left = num_hit * n
        for tier, count in spans:
            take = min(count, left)
            if take:
                by_tier[tier] = by_tier.get(tier, 0) + take * record_tokens
            left -= take
        tracked.hit = (first, num_hit, by_tier)
        tracked.hit_async = num_hit > 0 and (self._by_request or self._asynchronous(by_tier))
        if plan.num_recompute_blocks:
            self.num_recomputed_by_choice_tokens += plan.num_recompute_blocks * record_tokens
            logger.info(
                "request %s: recomputing %d of %d stored records (%s; est. TTFT %.3f s with "
                "%.3f s of compute, loading all %.3f s, margin %.2f)",
                request.request_id,
                plan.num_recompute_blocks,
                plan.num_hit_blocks,
                plan.reason,
                plan.est_ttft_s or 0.0,
                plan.est_compute_s or 0.0,
                plan.est_load_all_s or 0.0,
                plan.margin or 0.0,
            )
        if num_hit:
            logger.debug(
                "request %s: %d blocks stored after %d computed tokens (%s)",
                request.request_id,
                num_hit,
                num_computed_tokens,
                by_tier,
            )
        return num_hit * self._block_size, tracked.hit_async

    def _windowed_lookup(self, tracked: Tracked) -> WindowedLookup:
        """The hit over every KV cache group of this request (``windows``)."""
        n = self._per_block
        return WindowedLookup(
            self._groups,
            n,
            lambda group, num_blocks: self._keys_upto(tracked, num_blocks * n, group),
            lambda group, keys: self._lookup(tracked.namespaces[group].id, keys),
        )

    def _drawn(self, tracked: Tracked, spans: list[tuple[str, int]], keys: list[BlockHash]) -> bool:
        if tracked.guard_drawn:
            return False
        if spans:  # one draw per request, at its first hit
            tracked.guard_drawn = True
        verify = draw(self._guard, tracked.namespace.id, spans, keys)
        if verify is None:
            return False
        tracked.verify = verify
        logger.info(
            "request %s: verifying %d stored records by computing them (%s)",
            tracked.request.request_id,
            len(verify),
            sorted(set(verify.values())),
        )
        return True

    def _asynchronous(self, by_tier: dict[str, int]) -> bool:
        if self._load_async == "network":
            return all(tier in self._network_tiers for tier in by_tier)
        return self._load_async == "always"

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        """Plan the load of the hit into the blocks vLLM just allocated."""
        tracked = self._requests.get(request.request_id)
        if tracked is None and cacheable(request):
            tracked = self._track(request)
        if tracked is None:
            return
        first, num_hit, _ = tracked.hit
        tracked.num_stored_blocks = max(tracked.num_stored_blocks, first, tracked.num_known_stored)
        if not num_external_tokens:
            return
        num_blocks = num_external_tokens // self._block_size
        assert num_external_tokens % self._block_size == 0 and num_blocks <= num_hit, (
            f"vLLM asked to load {num_external_tokens} tokens of a {num_hit}-block hit"
        )
        group_block_ids = blocks.get_block_ids()
        end = first + num_blocks
        transfers = [
            self._load_of(tracked, group, group_block_ids[group], first, end)
            for group in range(len(self._group_layouts))
        ]
        if tracked.hit_async:
            # vLLM does not schedule the request until the worker reports it loaded, so the
            # load goes out with the next step's metadata, whatever that step runs.
            self._async_loads.extend(transfers)
        else:
            tracked.pending_loads.extend(transfers)
        tracked.num_stored_blocks = max(end, tracked.num_known_stored)

    def _load_of(
        self, tracked: Tracked, group: int, block_ids: Sequence[int], first: int, end: int
    ) -> BlockTransfer:
        """The load of blocks ``[first, end)`` of one KV cache group: where it keeps a window,
        of the blocks a hit ending at ``end`` needs (vLLM gave the others its null block)."""
        if self._groups and self._groups[group].window is not None:
            first = max(first, self._groups[group].first_needed_block(end * self._block_size))
        n = self._per_block
        namespace = tracked.namespaces[group]
        return BlockTransfer(
            tracked.request.request_id,
            namespace.id,
            namespace.fingerprint,
            tuple(self._keys_upto(tracked, end * n, group)[first * n : end * n]),
            tuple(block_ids[first:end]),
            **self._chain(tracked, first * n, end * n, load=True, group=group),
            group=group,
        )

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> CacheTierConnectorMetadata:
        """This step's loads and saves; consumes the pending loads."""
        meta = CacheTierConnectorMetadata(async_loads=self._async_loads)
        self._async_loads = []
        num_scheduled = scheduler_output.num_scheduled_tokens
        describe_step(scheduler_output, meta)
        if meta.step_tokens:
            self._refusals.step_planned(scheduler_output)
        for req_id in scheduler_output.preempted_req_ids or ():
            if req_id in self._requests:  # its blocks are freed; a resume brings new ones
                self._requests[req_id].group_block_ids = [[] for _ in self._group_layouts]
        for new in scheduler_output.scheduled_new_reqs:
            tracked = self._requests.get(new.req_id)
            if tracked is not None:
                tracked.group_block_ids = [list(ids) for ids in new.block_ids]
                self._plan(tracked, new.num_computed_tokens + num_scheduled[new.req_id], meta)
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            tracked = self._requests.get(req_id)
            if tracked is None:
                continue
            new_block_ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:  # new_block_ids is then the whole list
                tracked.group_block_ids = (
                    [list(ids) for ids in new_block_ids]
                    if new_block_ids
                    else [[] for _ in self._group_layouts]
                )
            elif new_block_ids is not None:
                for have, ids in zip(tracked.group_block_ids, new_block_ids, strict=True):
                    have.extend(ids)
            self._plan(tracked, cached.num_computed_tokens[i] + num_scheduled[req_id], meta)
        return meta

    def update_connector_output(self, report: Any) -> None:
        """Take the worker's report (``StoredBlocks``) of one step.

        Blocks that failed to load are recomputed by vLLM; they are saved again once they are.
        """
        if not isinstance(report, StoredBlocks):
            return
        for tokens, attention, seconds in report.steps:
            self.prefill.observe(tokens, attention, seconds)
            self._refusals.step_reported(seconds)
        for tier, rate in report.rates.items():
            self.rates.adopt(tier, rate)
        for nbytes, seconds in report.copies:
            self.copy.observe(nbytes, seconds)
        for tier, namespace_id, reason, writer in report.quarantined:
            self.quarantines.add(tier, namespace_id, reason, writer)
        self._cpu_index.update(report)
        for namespace_id, keys in report.failed.items():
            failed = set(keys)
            for tracked in self._requests.values():
                group = next(
                    (g for g, ns in enumerate(tracked.namespaces) if ns.id == namespace_id), None
                )
                if group is None:
                    continue
                stored = tracked.group_keys[group][: tracked.num_stored_blocks * self._per_block]
                bad = next((i for i, key in enumerate(stored) if key in failed), None)
                if bad is not None:
                    bad //= self._per_block  # the block that record is part of
                    tracked.num_stored_blocks = bad
                    if tracked.failed_from is None or bad < tracked.failed_from:
                        tracked.failed_from = bad

    def request_finished(self, request: Request) -> tuple[bool, dict[str, Any] | None]:
        """Forget the request. Its full blocks were saved in the steps that computed them, so
        ``(False, None)``: vLLM may free them now (no save is pending)."""
        self._requests.pop(request.request_id, None)
        return False, None

    def hit_sources(self, request: Request, num_external_tokens: int) -> dict[CacheHitSource, int]:
        """Split a hit's tokens by the tier that holds them."""
        tracked = self._requests.get(request.request_id)
        if not num_external_tokens:
            return {}
        if tracked is None or tracked.hit[1] * self._block_size != num_external_tokens:
            return {CacheHitSource.EXTERNAL_UNSPECIFIED: num_external_tokens}
        out: dict[CacheHitSource, int] = {}
        for tier, num_tokens in tracked.hit[2].items():
            source = _HIT_SOURCES.get(tier, CacheHitSource.EXTERNAL_UNSPECIFIED)
            out[source] = out.get(source, 0) + num_tokens
        return out

    def close(self) -> None:
        if self._store is not None:
            self._store.close()

    def _track(self, request: Request) -> Tracked:
        tracked = self._requests.get(request.request_id)
        if tracked is None:
            tracked = Tracked(request, self.namespaces(request.cache_salt))
            self._requests[request.request_id] = tracked
        return tracked

    def _keys_upto(self, tracked: Tracked, num_records: int, group: int = 0) -> list[BlockHash]:
        """The request's keys of its first ``num_records`` records in a KV cache group's
        namespace, extending the cached chain."""
        keys = tracked.group_keys[group]
        have = len(keys)
        if num_records > have:
            size = self._record_layout.block_size
            tokens = tracked.request.all_token_ids[have * size : num_records * size]
            parent = keys[-1] if keys else None
            keys.extend(block_keys(tracked.namespaces[group], list(tokens), parent=parent))
        return keys

    def _chain(
        self, tracked: Tracked, first: int, end: int, load: bool = False, group: int = 0
    ) -> dict[str, Any]:
        """Tokens, parent and position of records ``[first, end)`` of a KV cache group: a
        load's always (the worker checks its records by them), a save's if KV events want
        them."""
        if not (self._with_tokens or load):
            return {}
        size = self._record_layout.block_size
        tokens = tuple(tracked.request.all_token_ids[first * size : end * size])
        parent = tracked.group_keys[group][first - 1] if first else None
        return {"token_ids": tokens, "parent": parent, "first_position": first * size}

    def _lookup(self, namespace_id: str, keys: Sequence[BlockHash]) -> list[tuple[str, int]]:
        """``(tier, blocks)`` runs of the leading stored ``keys``, in order."""
        num_hit = 0
        if not self.quarantines.holds("cpu", namespace_id):
            num_hit = self._cpu_index.leading(namespace_id, keys)
        spans = [("cpu", num_hit)] if num_hit else []
        if self._store is None or num_hit == len(keys):
            return spans
        try:
            hit = self._store.lookup(namespace_id, keys[num_hit:])
        except (CacheTierError, OSError) as exc:  # tiers turn outages into misses; belt and braces
            logger.warning("cachetier lookup failed, treating it as a miss: %s", exc)
            return spans
        spans.extend((hit.tier_names[tier], end - start) for tier, start, end in hit.spans)
        return spans

    def _plan(
        self, tracked: Tracked, num_computed_after: int, meta: CacheTierConnectorMetadata
    ) -> None:
        meta.loads.extend(tracked.pending_loads)
        tracked.pending_loads = []
        # Only tokens already known (no draft tokens, no placeholders) are keyed and saved.
        num_full = min(num_computed_after, tracked.request.num_tokens) // self._block_size
        num_full = min(num_full, *(len(ids) for ids in tracked.group_block_ids))
        start = tracked.num_stored_blocks
        if num_full <= start:
            return
        for group in range(len(self._group_layouts)):
            first = start
            if self._groups:  # a window's blocks no hit needs are not written
                saved = first_saved_block(self._groups[group], tracked.request.num_prompt_tokens)
                first = max(first, saved)
            if first < num_full:
                meta.saves.append(self._save_of(tracked, group, first, num_full))
        tracked.num_stored_blocks = num_full

    def _save_of(self, tracked: Tracked, group: int, start: int, end: int) -> BlockTransfer:
        """The save of blocks ``[start, end)`` of one KV cache group."""
        n = self._per_block
        keys = self._keys_upto(tracked, end * n, group)[start * n : end * n]
        # A hit the guard drew compares the first group's records.
        verify = tuple(tracked.verify.pop(k, "") for k in keys) if tracked.verify else ()
        # A record whose end is past the prompt holds generated tokens (as our engine marks).
        size, prompt = self._record_layout.block_size, tracked.request.num_prompt_tokens
        generated = tuple((r + 1) * size > prompt for r in range(start * n, end * n))
        namespace = tracked.namespaces[group]
        return BlockTransfer(
            tracked.request.request_id,
            namespace.id,
            namespace.fingerprint,
            tuple(keys),
            tuple(tracked.group_block_ids[group][start:end]),
            verify if any(verify) else (),
            generated if any(generated) else (),
            **self._chain(tracked, start * n, end * n, group=group),
            group=group,
        )
