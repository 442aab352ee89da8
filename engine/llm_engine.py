"""``LLMEngine``: model + pool + block manager + scheduler + tier bridge, one ``step()`` at a
time."""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from cachetier.engine.block_manager import Block, BlockManager
from cachetier.engine.config import EngineConfig
from cachetier.engine.host_memory import keep_freed_memory
from cachetier.engine.kv_cache import KVPool
from cachetier.engine.model import ForwardBatch, LlamaModel, SeqSlice
from cachetier.engine.model_spec import ModelSpec
from cachetier.engine.sampling import SamplingParams, sample
from cachetier.engine.scheduler import Scheduler
from cachetier.engine.sequence import Sequence
from cachetier.engine.tier_bridge import TierBridge
from cachetier.engine.weights import load_weights, record_check_of
from cachetier.engine.windowed_bridge import WindowedTierBridge, windowed_supported
from cachetier.guard import GuardSampler
from cachetier.guard.record_check import RecordCheck
from cachetier.kvevents import MEDIUM_GPU, TierEvents
from cachetier.primitives.fingerprint import model_fingerprint
from cachetier.primitives.keys import BlockHash, Namespace, record_layout, torch_dtype
from cachetier.primitives.layer_sets import layer_sets
from cachetier.report.events import EventLog
from cachetier.store.costmodel import CopyRate, CostModel, PrefillModel
from cachetier.store.events import publish_store
from cachetier.store.tiered import TieredStore

log = logging.getLogger(__name__)

# Tokens of the warm-up's calibration forward (bounded by the step budget and the model's
# length): a few hundred, as chat prompts commonly are, and a fraction of loading the weights.
CALIBRATION_TOKENS = 512


@dataclass(slots=True)
class RequestOutput:
    """What a request produced (filled in as it runs; ``finished`` once it is done).

    ``cached_tokens_by_source`` says where its cached prompt tokens came from: ``pool`` (the
    engine's own blocks) or a tier name (``cpu``, ``disk``, ``redis``, ``remote``).
    ``ttft_breakdown`` says where ``ttft_s`` went (``cachetier.engine.sequence.TTFT_PARTS`` and
    ``other_s``); ``num_recomputed_hit_tokens`` are tokens the tiers held that the cost model
    chose to recompute. ``miss_tokens_by_cause`` says why the other prompt tokens were not
    served from cache (``cachetier.report.events.MISS_CAUSES``), ``miss_tier`` which tier
    the cause concerns where one does (the tier that evicted them, that is down...) and
    ``miss_detail`` the cause in words (how old an evicted block was, what part of a
    mismatched namespace differs).
    """

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    new_token_ids: list[int] = field(default_factory=list)
    finished: bool = False
    finish_reason: str | None = None
    num_cached_tokens: int = 0
    cached_tokens_by_source: dict[str, int] = field(default_factory=dict)
    ttft_s: float | None = None
    text: str = ""
    ttft_breakdown: dict[str, float] = field(default_factory=dict)
    num_recomputed_hit_tokens: int = 0
    miss_tokens_by_cause: dict[str, int] = field(default_factory=dict)
    miss_tier: str = ""
    miss_detail: str = ""


def engine_device(name: str) -> torch.device:
    """The torch device ``EngineConfig.device`` names.

    Raises:
        ValueError: a CUDA device that this torch cannot use (a CPU build, no GPU, an index
            past the last GPU).
    """
    device = torch.device(name)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {name!r}: this torch sees no CUDA device")
        index = device.index if device.index is not None else torch.cuda.current_device()
        if index >= torch.cuda.device_count():
            raise ValueError(f"device {name!r}: torch sees {torch.cuda.device_count()} GPU(s)")
        device = torch.device("cuda", index)
        # Triton launches on the current device, whatever its tensors' device says.
        torch.cuda.set_device(device)
    return device


class LLMEngine:
    """A paged engine over one model, optionally backed by a cachetier store.

    Args:
        config: engine settings.
        store: tiers that keep evicted and finished blocks (owned by the caller), or ``None``.
    """

    def __init__(self, config: EngineConfig, store: TieredStore | None = None) -> None:
        if config.num_threads is not None:
            torch.set_num_threads(config.num_threads)
        keep_freed_memory()  # activations reuse freed memory instead of faulting it in again
        self.device = engine_device(config.device)
        self.config = config
        folder = Path(config.model)
        self.spec = ModelSpec.from_folder(folder)
        weights = load_weights(folder)
        self.model = LlamaModel(
            self.spec, weights, torch_dtype(config.dtype), config.kernel_backend, self.device
        )
        record_check = record_check_of(folder, weights, config) if store is not None else None
        del weights
        self.pool = KVPool(
            self.spec,
            config.block_size,
            config.kv_cache_bytes,
            config.pool_dtype,
            config.kernel_backend,
            self.device,
        )
        # A sequence longer than the whole pool could never be scheduled: cap it there too.
        self.max_model_len = min(
            config.max_model_len or self.spec.max_position_embeddings,
            self.spec.max_position_embeddings,
            self.pool.num_blocks * config.block_size,
        )
        # One forward at a realistic prompt length: the cost model refuses no load whose
        # recompute is longer than a step it has measured, and an engine restarted over a full
        # folder may compute nothing but short suffixes for a long while.
        calibration = min(CALIBRATION_TOKENS, config.max_num_batched_tokens, self.max_model_len)
        warm_up = self.model.warm_up(
            self.pool.cache, self.pool.scales, calibration_tokens=calibration
        )
        # Keys and records are per record_tokens, whatever the pool's block size: a block of
        # several records is stored as that many (``TierBridge``).
        self.namespace = Namespace(
            model_fingerprint(folder),
            # Without tiers nothing is shared, and a block is its own record.
            record_layout(self.pool.layout, config.record_tokens if store else config.block_size),
            config.tenant,
        )
        # Restores into a GPU pool copy what the tiers read; that copy is timed once here (and
        # the pinned buffers it uses are set up, out of the first restore's way), then at
        # every restore, and weighed by the cost model with the tiers' reads.
        self.copy_rate = CopyRate()
        copy_timing = self.pool.time_restore_copy() if store is not None else None
        if copy_timing is not None:
            self.copy_rate.observe(*copy_timing)
        self.bridge = (
            _tier_bridge(store, self, config, record_check) if store is not None else None
        )
        self.kv_events: TierEvents | None = None  # the pool's KV events (``publish_events``)
        self.blocks = BlockManager(
            self.pool.num_blocks,
            on_evict=self._on_evict,
            on_allocate=self.pool.reset_scales if self.pool.scales is not None else None,
        )
        # Owned here (the config names a file, not an object): close() closes it.
        self.events = EventLog(config.event_log) if config.event_log is not None else None
        self.prefill_model, self.cost_model = _cost_model(
            config, store, warm_up, self.copy_rate, isinstance(self.bridge, WindowedTierBridge)
        )
        self.scheduler = Scheduler(
            config, self.namespace, self.blocks, self.bridge, self.events, self.cost_model
        )
        self._ids = itertools.count()
        self._seqs: dict[str, Sequence] = {}
        self.num_steps = 0
        self.num_prefill_tokens = 0
        self.num_decode_tokens = 0

    def close(self) -> None:
        """Wait for tier reads still running and close the event log, if any (the store
        belongs to the caller); idempotent."""
        self.scheduler.close()
        if self.bridge is not None:
            self.bridge.close()
        if self.events is not None:
            self.events.close()

    def publish_events(self, events: TierEvents, *, announce: bool = True) -> int:
        """Publish the pool's blocks (medium ``GPU``, as vLLM names its pool) and the tiers'
        (each under its name) as KV events from now on: a router's prefix index learns what
        this engine can compute from, and load.

        Args:
            events: where the events go; the pool's blocks' tokens are noted in its
                ``tokens``, so that the tiers' events of the same blocks carry them too.
            announce: first announce what the tiers hold (a restarted pod's disk).

        Returns:
            How many keys were announced.
        """
        self.kv_events = events
        size = self.namespace.block_size  # a record's tokens: a pool block may be several

        def registered(block: Block, parent: BlockHash | None, token_ids: Seq[int]) -> None:
            keys = _pool_keys(block)
            if len(token_ids) == len(keys) * size:
                # A block of several records: its first record's parent is not ``parent``.
                parents = [parent if len(keys) == 1 else None, *keys[:-1]]
                for i, key in enumerate(keys):
                    events.tokens.note(key, parents[i], token_ids[i * size : (i + 1) * size])
            events.stored_keys(MEDIUM_GPU, keys, size)

        self.blocks.on_register = registered
        if self.bridge is None:
            return 0
        store = self.bridge.store
        return publish_store(store.block_events, store.tiers, events, size, announce=announce)

    def _on_evict(self, blocks: list[Block]) -> None:
        if self.bridge is not None:
            self.bridge.save(blocks)
        if self.kv_events is not None:
            keys = [k for b in blocks if b.key is not None for k in _pool_keys(b)]
            self.kv_events.removed(MEDIUM_GPU, keys)

    def add_request(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
    ) -> str:
        """Queue a request.

        Raises:
            ValueError: empty prompt, token ids outside the vocabulary, a prompt that does not
                fit ``max_model_len``, or a duplicate request id.
        """
        params = params or SamplingParams()
        tokens = [int(t) for t in prompt_token_ids]
        if not tokens:
            raise ValueError("the prompt is empty")
        if min(tokens) < 0 or max(tokens) >= self.spec.vocab_size:
            raise ValueError(f"prompt token ids must be in [0, {self.spec.vocab_size})")
        if len(tokens) >= self.max_model_len:
            raise ValueError(
                f"the prompt has {len(tokens)} tokens; max_model_len is {self.max_model_len} "
                "(the model's limit, the config's, or what the KV pool holds)"
            )
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        if request_id in self._seqs:
            raise ValueError(f"request id {request_id!r} is already in use")
        seq = Sequence(request_id, tokens, params)
        self._seqs[request_id] = seq
        self.scheduler.add(seq)
        return request_id

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def abort_request(self, request_id: str) -> None:
        """Stop a request (waiting or running); its finished blocks are still saved."""
        seq = self._seqs.pop(request_id, None)
        if seq is None:
            return
        if seq in self.scheduler.waiting:
            self.scheduler.waiting.remove(seq)
            self.blocks.release(seq.block_table)
        elif seq in self.scheduler.running:
            self.scheduler.finish(seq, "abort")

    def step(self) -> list[RequestOutput]:
        """Schedule, run one forward, sample; returns an output per request that advanced."""
        scheduled = self.scheduler.schedule()
        if not scheduled:
            return []
        self.num_steps += 1
        bs = self.config.block_size
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        slices: list[SeqSlice] = []
        logits_rows: list[int] = []
        samplers: list[Sequence] = []
        prompt_seqs: list[Sequence] = []
        attention = 0.0
        for item in scheduled:
            seq, n = item.seq, item.num_new
            start = seq.num_computed_tokens
            row = len(ids)
            ids.extend(seq.token_ids[start : start + n])
            pos = range(start, start + n)
            positions.extend(pos)
            table = seq.block_table
            slots.extend(table[p // bs] * bs + p % bs for p in pos)
            context = start + n
            slices.append(
                SeqSlice(
                    row, n, context, torch.tensor(table[: -(-context // bs)], dtype=torch.long)
                )
            )
            if context == seq.num_tokens:
                logits_rows.append(row + n - 1)
                samplers.append(seq)
            attention += PrefillModel.attention_work(n, start)
            if n > 1 or seq.num_tokens == seq.num_prompt_tokens:
                self.num_prefill_tokens += n
                prompt_seqs.append(seq)
            else:
                self.num_decode_tokens += n
        batch = ForwardBatch(
            torch.tensor(ids, dtype=torch.long),
            torch.tensor(positions, dtype=torch.long),
            torch.tensor(slots, dtype=torch.long),
            tuple(slices),
            torch.tensor(logits_rows, dtype=torch.long),
        ).to(self.device)
        forward_start = time.perf_counter()
        logits = self.model.forward(batch, self.pool.cache, kv_scales=self.pool.scales)
        # Sampling runs on the host (each request's generator lives there); off the CPU this
        # copy also waits for the forward, so forward_s is its real time.
        logits = logits.cpu()
        forward_s = time.perf_counter() - forward_start
        if prompt_seqs:
            # Steps that compute prompts teach the cost model what a recompute costs; decode-only
            # steps would bias it towards the one-token case.
            self.prefill_model.observe(len(ids), attention, forward_s)
            for seq in prompt_seqs:
                seq.add_time("prefill_s", forward_s)
        for item in scheduled:
            before = item.seq.num_computed_tokens
            item.seq.num_computed_tokens += item.num_new
            self.scheduler.register_computed(item.seq, before)
        sample_start = time.perf_counter()
        new_tokens = sample(logits, [s.params for s in samplers], [s.generator for s in samplers])
        now = time.perf_counter()
        for seq in samplers:
            seq.add_time("sample_s", now - sample_start)
        outputs: list[RequestOutput] = []
        for seq, token in zip(samplers, new_tokens):
            seq.output_token_ids.append(token)
            if seq.first_token_s is None:
                seq.first_token_s = now
                self.scheduler.observe_outcome(seq)
            self.scheduler.extend_keys(seq)
            reason = self._stop_reason(seq, token)
            if reason is not None:
                self.scheduler.finish(seq, reason)
                self._seqs.pop(seq.request_id, None)
            outputs.append(self._output(seq, [token]))
        return outputs

    def _stop_reason(self, seq: Sequence, token: int) -> str | None:
        p = seq.params
        if not p.ignore_eos and token in self.spec.eos_token_ids:
            return "stop"
        if token in p.stop_token_ids:
            return "stop"
        if len(seq.output_token_ids) >= p.max_tokens or seq.num_tokens >= self.max_model_len:
            return "length"
        return None

    @staticmethod
    def _output(seq: Sequence, new: list[int]) -> RequestOutput:
        return RequestOutput(
            request_id=seq.request_id,
            prompt_token_ids=seq.prompt_token_ids,
            token_ids=list(seq.output_token_ids),
            new_token_ids=new,
            finished=seq.is_finished,
            finish_reason=seq.finish_reason,
            num_cached_tokens=seq.num_cached_tokens,
            cached_tokens_by_source=dict(seq.cached_tokens_by_source),
            ttft_s=seq.ttft_s,
            ttft_breakdown=seq.ttft_breakdown(),
            num_recomputed_hit_tokens=seq.num_recomputed_hit_tokens,
            miss_tokens_by_cause=dict(seq.miss_tokens_by_cause),
            miss_tier=seq.miss_tier,
            miss_detail=seq.miss_detail,
        )

    def stats(self) -> dict[str, Any]:
        """Engine counters (vLLM-style names) and the bridge's save / restore figures."""
        out: dict[str, Any] = {
            "num_blocks": self.blocks.num_blocks,
            "kv_cache_usage": self.blocks.usage(),
            "num_cached_blocks": self.blocks.num_cached_blocks,
            "num_evicted_blocks": self.blocks.num_evicted,
            "num_running": len(self.scheduler.running),
            "num_waiting": len(self.scheduler.waiting),
            "num_preemptions": self.scheduler.num_preemptions,
            "num_steps": self.num_steps,
            "num_prefill_tokens": self.num_prefill_tokens,
            "num_decode_tokens": self.num_decode_tokens,
        }
        if self.bridge is not None:
            s = self.bridge.stats
            out.update(
                saved_blocks=s.saved_blocks,
                restored_blocks=s.restored_blocks,
                restored_bytes=s.restored_bytes,
                restore_s=s.restore_s,
                save_s=s.save_s,
                restored_by_tier=dict(s.restored_by_tier),
            )
            out["record_guard"] = self.bridge.record_guard.stats.as_dict()
            shadow = self.bridge.shadow
            if shadow is not None:
                out["guard"] = {
                    "verified_requests": shadow.stats.verified_requests,
                    "verified_blocks": shadow.stats.verified_blocks,
                    "mismatched_blocks": shadow.stats.mismatched_blocks,
                    "quarantined": [
                        (q.tier, q.namespace, q.writer)
                        for q in self.bridge.store.quarantines.entries()
                    ],
                }
        if self.cost_model is not None:
            out["cost_model"] = {
                "enabled": self.cost_model.enabled,
                "recomputed_tokens": self.scheduler.num_recomputed_hit_tokens,
                "plans": dict(self.scheduler.num_plans_by_choice),
                "prefill": self.prefill_model.snapshot(),
                "tiers": self.cost_model.rates.snapshot(),
                "copy": self.copy_rate.snapshot(),
            }
        return out


def _tier_bridge(
    store: TieredStore, engine: LLMEngine, config: EngineConfig, record_check: RecordCheck | None
) -> TierBridge:
    """The engine's bridge to its tiers: layer sets with a window in records of their own
    (``WindowedTierBridge``) where the pool's blocks allow it, whole blocks otherwise."""
    guard = GuardSampler(config.guard_config()) if config.guard else None
    spec, pool, namespace = engine.spec, engine.pool, engine.namespace
    sets = layer_sets([spec.window_of(i) for i in range(spec.num_layers)], namespace)
    if any(s.window is not None for s in sets):
        per_block = config.block_size // namespace.block_size
        if windowed_supported(pool, per_block):
            return WindowedTierBridge(
                store,
                namespace,
                pool,
                sets,
                engine.copy_rate,
                guard,
                record_check,
                config.window_block_tokens,
            )
        log.warning(
            "cachetier: sliding-window layers stored whole (every block): windowed records "
            "need pool blocks of one record without fp8 scales"
        )
    return TierBridge(store, namespace, pool, engine.copy_rate, guard, record_check)


def _cost_model(
    config: EngineConfig,
    store: TieredStore | None,
    warm_up: list[tuple[int, float]],
    copy_rate: CopyRate,
    windowed: bool = False,
) -> tuple[PrefillModel, CostModel | None]:
    """The engine's measured prefill speed (seeded by the warm-up's forwards), weighed against
    the store's measured tier speeds for every tier hit (``kv_load_policy="always"`` loads
    without asking); no cost model without tiers. ``windowed`` (``WindowedTierBridge``): every
    hit is loaded, as its plans would recompute a hit's head over blocks holding some layers
    only."""
    prefill = PrefillModel()
    for num_tokens, seconds in warm_up:
        prefill.observe(num_tokens, PrefillModel.attention_work(num_tokens, 0), seconds)
    if store is None:
        return prefill, None
    enabled = config.kv_load_policy == "cost" and not windowed
    cost = CostModel(store.rates, prefill, copy=copy_rate, enabled=enabled)
    return prefill, cost


def _pool_keys(block: Block) -> list[BlockHash]:
    """The record keys a pool block holds (its own key where it is one record)."""
    assert block.key is not None, "only keyed blocks are published"
    return list(block.record_keys) if block.record_keys else [block.key]
