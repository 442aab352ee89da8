"""A Llama-family decoder (Llama, SmolLM2, Mistral, Qwen2) that reads and writes the paged pool.

Weights are Hugging Face's, by name; q/k/v and gate/up are fused into one matmul each. The math
follows transformers' LlamaModel step for step (RMSNorm in fp32, rotate-half RoPE), so logits
agree with it to float rounding. Sliding-window layers (Mistral, Qwen2 with use_sliding_window)
mask keys outside their window but keep every block, as vLLM does with its hybrid KV cache
manager off, so the pool and its records are those of full attention.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from cachetier.engine.kv_cache import dequantize_blocks, store_kv_fp8
from cachetier.engine.model_spec import ModelSpec
from cachetier.guard.first_layer import rope_inv_freq
from cachetier.kernels import common_prefix_blocks, merge_attention, paged_attention_decode
from cachetier.kernels.cpu_linear import linear, prepack
from cachetier.kernels.fused_ops import rms_norm, rope_angles, rope_store, silu_mul
from cachetier.kernels.native_prefill_attention import (
    PrefillChunk,
    PrefillPlan,
    paged_prefill_attention,
    plan_prefill,
)
from cachetier.kernels.torch_paged_attention import (
    CPU_FLASH_WITH_LSE,
    attend_unmasked,
    gather_layer_kv,
    window_mask,
    window_start,
)


@dataclass(frozen=True, slots=True)
class SeqSlice:
    """One sequence's part of a forward batch.

    Args:
        start: row of its first new token in the flattened batch.
        num_new: new tokens this step (1 for a decode).
        context_len: tokens whose KV it attends to after this step (cached + new).
        block_table: ``[num_blocks]`` int64 pool block ids covering ``context_len`` tokens.
    """

    start: int
    num_new: int
    context_len: int
    block_table: torch.Tensor


@dataclass(frozen=True, slots=True)
class ForwardBatch:
    """Flattened inputs of one step. ``logits_rows`` are the rows whose logits are wanted."""

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    slot_mapping: torch.Tensor  # [T] int64, slot = block_id * block_size + offset
    seqs: tuple[SeqSlice, ...]
    logits_rows: torch.Tensor  # [S] int64

    def to(self, device: torch.device) -> ForwardBatch:
        """The same batch with its token-level tensors on ``device``. The sequences' block
        tables stay on the host: the model reads them there to plan its kernel calls and moves
        what the kernels index with, so planning costs no device round trip."""
        if self.input_ids.device == device:
            return self
        return ForwardBatch(
            self.input_ids.to(device, non_blocking=True),
            self.positions.to(device, non_blocking=True),
            self.slot_mapping.to(device, non_blocking=True),
            self.seqs,
            self.logits_rows.to(device, non_blocking=True),
        )


def _rope_inv_freq(spec: ModelSpec) -> torch.Tensor:
    return rope_inv_freq(spec.head_dim, spec.rope_theta, spec.rope_scaling)


# Chunks of at most this many new tokens attend by grouped einsums, not SDPA, where the CPU
# flash kernel does not take them (off the CPU, or an fp8 pool).
_SMALL_CHUNK = 64

# Chunks of at least this many new tokens go to the native prefill kernel where it runs (CPU,
# float32, unquantised pool). Below it the kernel's packing of the whole context is not repaid
# by its faster tiles (measured, 2,048 cached tokens, 2 threads: 0.9-0.95x the torch path at
# 15-32 new tokens, 1.1x at 64, 1.2-1.4x at 128-1,024).
_NATIVE_PREFILL_MIN = 64

# Devices where SDPA gets K/V repeated per query head rather than ``enable_gqa``: on CUDA in
# fp32 the GQA form falls to a kernel several times slower on long prompts. The repeat is one
# small copy of the context.
_EXPAND_GQA_DEVICES = ("cuda",)


@dataclass(frozen=True, slots=True)
class _DecodeGroup:
    """Decoding sequences that attend together (same first pool block, where one exists)."""

    rows: torch.Tensor  # [B] rows of the batch
    tables: torch.Tensor  # [B, max_blocks] pool block ids, padded with 0
    context_lens: torch.Tensor  # [B]
    num_shared_blocks: int  # leading blocks of ``tables`` every row shares


def _decode_groups(
    decodes: list[SeqSlice], block_size: int, device: torch.device, *, fp8: bool
) -> list[_DecodeGroup]:
    # Sequences behind one shared system prompt hold the same leading pool blocks (prefix
    # cache): grouping by first block lets the kernel read those blocks once per group instead
    # of once per sequence (cascade attention). Sequences that share no full block with
    # another go together into one group with nothing shared: one kernel call for all of them,
    # not one each (32 unrelated decodes were 32 calls a layer, each with its own checks and
    # only num_kv_heads tasks for the threads). An fp8 pool dequantises per row, so it gets
    # one group and no sharing.
    by_first: dict[int, list[SeqSlice]] = {}
    for s in decodes:
        by_first.setdefault(-1 if fp8 else int(s.block_table[0]), []).append(s)
    groups, alone = [], []
    for members in by_first.values():
        group = _decode_group(members, block_size, device, share=not fp8)
        if group.num_shared_blocks:
            groups.append(group)
        else:
            alone.extend(members)
    if alone:
        groups.append(_decode_group(alone, block_size, device, share=False))
    return groups


def _decode_group(
    members: list[SeqSlice], block_size: int, device: torch.device, *, share: bool
) -> _DecodeGroup:
    tables = torch.zeros(len(members), max(len(s.block_table) for s in members), dtype=torch.long)
    for i, s in enumerate(members):
        tables[i, : len(s.block_table)] = s.block_table
    lens = torch.tensor([s.context_len for s in members], dtype=torch.long)
    shared = common_prefix_blocks(tables, lens, block_size) if share else 0
    rows = torch.tensor([s.start for s in members], dtype=torch.long)
    # Planned on the host (above), moved once for the kernels.
    return _DecodeGroup(
        rows.to(device, non_blocking=True),
        tables.to(device, non_blocking=True),
        lens.to(device, non_blocking=True),
        shared,
    )


class LlamaModel:
    """Weights plus a ``forward`` over a ``ForwardBatch`` and the paged pool."""

    def __init__(
        self,
        spec: ModelSpec,
        weights: dict[str, torch.Tensor],
        dtype: torch.dtype,
        kernel_backend: str = "auto",
        device: str | torch.device = "cpu",
    ) -> None:
        self.spec = spec
        self.dtype = dtype
        self.kernel_backend = kernel_backend
        self.device = torch.device(device)
        self.scale = spec.head_dim**-0.5

        def w(name: str) -> torch.Tensor:
            if name not in weights:
                raise ValueError(f"the model folder has no weight {name!r}")
            return weights[name].to(device=self.device, dtype=dtype).contiguous()

        self.embed = w("model.embed_tokens.weight")
        self.norm = w("model.norm.weight")
        # Projection weights are packed once for oneDNN where it runs them
        # (cachetier.kernels.cpu_linear).
        self.lm_head = prepack(w("lm_head.weight"))
        self.layers = []
        for i in range(spec.num_layers):
            p = f"model.layers.{i}."
            qkv = torch.cat([w(p + f"self_attn.{n}_proj.weight") for n in "qkv"]).contiguous()
            bias = None
            if spec.attention_bias:
                bias = torch.cat([w(p + f"self_attn.{n}_proj.bias") for n in "qkv"])
            self.layers.append(
                {
                    "in_norm": w(p + "input_layernorm.weight"),
                    "qkv": prepack(qkv),
                    "qkv_bias": bias,
                    "o": prepack(w(p + "self_attn.o_proj.weight")),
                    "post_norm": w(p + "post_attention_layernorm.weight"),
                    "gate_up": prepack(
                        torch.cat([w(p + "mlp.gate_proj.weight"), w(p + "mlp.up_proj.weight")])
                    ),
                    "down": prepack(w(p + "mlp.down_proj.weight")),
                }
            )
        self._inv_freq = _rope_inv_freq(spec).to(self.device)

    def warm_up(
        self,
        kv_cache: torch.Tensor,
        kv_scales: torch.Tensor | None = None,
        *,
        calibration_tokens: int = 0,
    ) -> list[tuple[int, float]]:
        """Throw-away forwards (their K/V go nowhere: slot -1), so that one-time set-up of the
        math libraries (thread pools, kernel selection) is not paid by the first request.

        Args:
            kv_cache: the pool (only block 0 is read).
            kv_scales: an fp8 pool's scales.
            calibration_tokens: one more forward of this many tokens where it is longer than
                the others: the cost model estimates no recompute longer than a step it has
                measured, so this is the prompt length it can judge from the start.

        Returns:
            ``(tokens, seconds)`` of the forwards after the first (which pays the set-up): a
            first measure of prefill speed before any request has run.
        """
        timings = []
        sizes = [1, _SMALL_CHUNK + 1, 4 * _SMALL_CHUNK]
        if calibration_tokens > sizes[-1]:
            sizes.append(calibration_tokens)
        for n in sizes:
            # Block 0 over and over: an fp8 pool's prefill reads its (zero-scaled) context.
            num_blocks = -(-n // kv_cache.shape[3])
            batch = ForwardBatch(
                torch.zeros(n, dtype=torch.long),
                torch.arange(n),
                torch.full((n,), -1, dtype=torch.long),
                (SeqSlice(0, n, n, torch.zeros(num_blocks, dtype=torch.long)),),
                torch.tensor([n - 1]),
            ).to(self.device)
            start = time.perf_counter()
            # The copy to the host waits for the device: the time is the forward's.
            self.forward(batch, kv_cache, kv_scales=kv_scales).cpu()
            timings.append((n, time.perf_counter() - start))
        return timings[1:]

    @torch.inference_mode()
    def forward(
        self,
        batch: ForwardBatch,
        kv_cache: torch.Tensor,
        all_logits: bool = False,
        *,
        kv_scales: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Run one step: write the new tokens' K/V into the pool and return logits.

        Args:
            batch: the step's tokens and where their K/V go (token tensors on the model's
                device, ``ForwardBatch.to``).
            kv_cache: the pool ``[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]``.
            all_logits: logits for every row instead of ``batch.logits_rows`` (tests).
            kv_scales: ``[num_blocks, num_layers, 2]`` float32 scales of an fp8 pool; ``None``
                for a pool in the compute dtype.

        Returns:
            ``[S, vocab]`` float32 logits (``[T, vocab]`` with ``all_logits``), on the model's
            device.
        """
        spec = self.spec
        hq, hk, d = spec.num_heads, spec.num_kv_heads, spec.head_dim
        eps, backend = spec.rms_norm_eps, self.kernel_backend
        x = self.embed[batch.input_ids]  # [T, hidden], the residual stream (updated in place)
        cos, sin = rope_angles(batch.positions, self._inv_freq)
        decodes = [s for s in batch.seqs if s.num_new == 1 and s.context_len > 1]
        groups = _decode_groups(
            decodes, kv_cache.shape[3], kv_cache.device, fp8=kv_scales is not None
        )
        others = [s for s in batch.seqs if not (s.num_new == 1 and s.context_len > 1)]
        plan = self._native_prefill_plan(others, kv_cache, kv_scales)
        # The prefill chunks' block tables on the pool's device, once for all layers.
        prefill_tables = [s.block_table.to(kv_cache.device, non_blocking=True) for s in others]
        # Each sublayer's output joins the residual stream inside the next RMSNorm (one pass
        # for add and norm, cachetier.kernels.fused_ops), so it is carried as ``delta`` until then.
        delta: torch.Tensor | None = None
        for index, layer in enumerate(self.layers):
            # The native prefill kernel has no window: a windowed layer prefills on the torch path.
            window = spec.window_of(index)
            h = rms_norm(x, layer["in_norm"], eps, delta, backend=backend)
            qkv = linear(h, layer["qkv"], layer["qkv_bias"])
            # q and k rotated in place in qkv; k and v written to the pool in the same pass.
            if kv_scales is None:
                rope_store(
                    qkv, cos, sin, hq, hk, kv_cache, index, batch.slot_mapping, backend=backend
                )
            else:
                rope_store(qkv, cos, sin, hq, hk, backend=backend)
            q = qkv[:, : hq * d].view(-1, hq, d)
            k = qkv[:, hq * d : (hq + hk) * d].view(-1, hk, d)
            v = qkv[:, (hq + hk) * d :].view(-1, hk, d)
            if kv_scales is not None:
                store_kv_fp8(k, v, kv_cache, kv_scales, index, batch.slot_mapping)
            attn = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # q is a strided view
            self._decode_attention(q, groups, kv_cache, index, kv_scales, attn, window)
            native = plan is not None and paged_prefill_attention(
                q, kv_cache, index, plan, self.scale, attn, window
            )
            for s, table in () if native else zip(others, prefill_tables):
                rows = slice(s.start, s.start + s.num_new)
                attn[rows] = self._prefill_attention(
                    q[rows], k[rows], v[rows], s, table, kv_cache, index, kv_scales, window
                )
            delta = linear(attn.view(-1, hq * d), layer["o"])
            h = rms_norm(x, layer["post_norm"], eps, delta, backend=backend)
            delta = linear(silu_mul(linear(h, layer["gate_up"]), backend=backend), layer["down"])
        if delta is not None:
            x.add_(delta)
        rows = x if all_logits else x[batch.logits_rows]
        return linear(rms_norm(rows, self.norm, eps, backend=backend), self.lm_head).float()

    def _decode_attention(
        self,
        q: torch.Tensor,
        groups: list[_DecodeGroup],
        kv_cache: torch.Tensor,
        layer: int,
        kv_scales: torch.Tensor | None,
        out: torch.Tensor,
        window: int | None,
    ) -> None:
        # Each decode group's rows of ``out`` ([T, hq, d], like q) from the paged decode kernel.
        for group in groups:
            if kv_scales is None:
                pool, pool_layer, tables = kv_cache, layer, group.tables
            else:
                # fp8: the decode reads a dequantised copy of the group's blocks, laid out as a
                # one-layer pool of its own, through the same kernel.
                deq = dequantize_blocks(
                    kv_cache, kv_scales, group.tables.flatten(), layer, self.dtype
                )
                pool, pool_layer = deq.unsqueeze(1), 0  # [B * max_blocks, 1, 2, bs, hk, d]
                tables = torch.arange(group.tables.numel(), device=deq.device).view_as(group.tables)
            out[group.rows] = paged_attention_decode(
                q[group.rows],
                pool,
                pool_layer,
                tables,
                group.context_lens,
                self.scale,
                num_shared_blocks=group.num_shared_blocks if window is None else 0,
                window=window,
                backend=self.kernel_backend,
            )

    def _native_prefill_plan(
        self,
        others: list[SeqSlice],
        kv_cache: torch.Tensor,
        kv_scales: torch.Tensor | None,
    ) -> PrefillPlan | None:
        # What the native prefill kernel reads for the step's chunks, once for all layers
        # (measured against the torch path, 2 threads: 1.2-1.5x at 15 new tokens after 2,048
        # or 4,096 cached, 1.1-1.3x at 32-128, 1.2-1.4x at 576-1,024). It reads K/V from the
        # pool, so an fp8 pool stays on the torch path.
        if kv_scales is not None or kv_cache.device.type != "cpu" or self.dtype != torch.float32:
            return None
        chunks = [PrefillChunk(s.start, s.num_new, s.context_len, s.block_table) for s in others]
        return plan_prefill(chunks, kv_cache.shape[3], kv_cache.shape[0])

    def _prefill_attention(
        self,
        q: torch.Tensor,
        k_new: torch.Tensor,
        v_new: torch.Tensor,
        s: SeqSlice,
        table: torch.Tensor,
        kv_cache: torch.Tensor,
        layer: int,
        kv_scales: torch.Tensor | None,
        window: int | None,
    ) -> torch.Tensor:
        # q: [n, hq, d]; attends to context [0, context_len) of which the last n are new, whose
        # blocks ``table`` (s.block_table on the pool's device) lists. Under a window the keys
        # before ``first`` are seen by none of the chunk's queries and are not read.
        n, cached = s.num_new, s.context_len - s.num_new
        if window is not None and s.context_len <= window:
            window = None  # every query sees every key before it: plain causal
        on_cpu_flash = CPU_FLASH_WITH_LSE is not None and q.device.type == "cpu"
        if cached and kv_scales is None and on_cpu_flash and window is None:
            return self._split_attention(q, k_new, v_new, s, kv_cache, layer)
        first = window_start(cached + 1, window)  # the chunk's first query sits at ``cached``
        if cached == 0 and kv_scales is None:
            k, v = k_new, v_new  # nothing cached: skip the gather from the pool
        elif kv_scales is None:
            k, v = gather_layer_kv(kv_cache, layer, table, s.context_len, first)
        else:
            # fp8 always reads the pool: attention sees the quantised K/V, the same whether a
            # prefix was computed here or restored from a tier.
            kv = dequantize_blocks(kv_cache, kv_scales, table, layer, self.dtype)
            kv = kv.transpose(0, 1).reshape(2, -1, *kv.shape[-2:])[:, first : s.context_len]
            k, v = kv[0], kv[1]
        # Query i sits at position cached + i: it sees keys up to itself, and under a window
        # none at or before cached + i - window. [n, context_len - first] bool.
        if n <= _SMALL_CHUNK:
            mask = None
            if cached or window is not None:
                mask = window_mask(n, s.context_len, first, window, q.device)
            return self._grouped_attention(q, k, v, mask)
        gqa = q.device.type not in _EXPAND_GQA_DEVICES
        if not gqa:
            group = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        # A leading batch dim of 1 matters: torch's CPU flash-attention kernel takes 4-D inputs
        # only; 3-D ones fall back to the math path, several times slower on a long chunk.
        # After a cached context the queries are the last n of the keys: causal aligned to the
        # bottom right. SDPA takes that as a bias object and on CUDA runs it with no mask in
        # memory (faster than the explicit [n, context] mask this replaced, with the same
        # outputs); on CPU it is materialised, as the mask was.
        bias = causal_lower_right(n, s.context_len) if cached else None
        if window is not None:  # no bias object for a window: an explicit mask
            bias = window_mask(n, s.context_len, first, window, q.device)
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1).unsqueeze(0),
            k.transpose(0, 1).unsqueeze(0),
            v.transpose(0, 1).unsqueeze(0),
            attn_mask=bias,
            is_causal=bias is None,
            scale=self.scale,
            enable_gqa=gqa,
        )
        return out[0].transpose(0, 1)

    def _split_attention(
        self,
        q: torch.Tensor,
        k_new: torch.Tensor,
        v_new: torch.Tensor,
        s: SeqSlice,
        kv_cache: torch.Tensor,
        layer: int,
    ) -> torch.Tensor:
        # New tokens after a cached context (a chunk of a long prompt, the suffix of a restored
        # one): every query sees all cached keys and the new keys up to itself.
        n, hq, d = q.shape
        hk = k_new.shape[1]
        group = hq // hk
        cached = s.context_len - n
        assert CPU_FLASH_WITH_LSE is not None, "_split_attention without the CPU flash kernel"
        # Query heads that share a KV head are just more rows against the same keys: folded into
        # the query length, K and V are read as they lie instead of repeated per query head.
        folded = q.view(n, hk, group, d).permute(1, 0, 2, 3).reshape(hk, n * group, d)
        # The cached half unmasked, the new half causal, merged exactly by their log-sum-exps,
        # so no [n, context] mask is built and the new K/V are used as computed (half the time
        # of the matmuls, mask and softmax this replaced on a long cached context; one masked
        # flash call over the whole context measured the same as these two).
        k_old, v_old = gather_layer_kv(kv_cache, layer, s.block_table, cached)
        out_old, lse_old = attend_unmasked(folded, k_old, v_old, self.scale)
        out_old = out_old.view(hk, n, group, d).permute(1, 0, 2, 3).reshape(n, hq, d)
        lse_old = lse_old.view(hk, n, group).permute(1, 0, 2).reshape(n, hq)
        # Causal with the new keys: a square block, GQA by repeat (n x n is the small part; for
        # a short chunk this one call beat the grouped einsums it replaced in a profile, and
        # measured the same end to end).
        out_new, lse_new = CPU_FLASH_WITH_LSE(
            q.transpose(0, 1).unsqueeze(0),
            k_new.transpose(0, 1).unsqueeze(0).repeat_interleave(group, dim=1),
            v_new.transpose(0, 1).unsqueeze(0).repeat_interleave(group, dim=1),
            0.0,
            True,
            scale=self.scale,
        )[:2]
        out_new, lse_new = out_new[0].transpose(0, 1), lse_new[0].transpose(0, 1)
        out = merge_attention(out_old, lse_old, out_new.float(), lse_new)
        return out.to(q.dtype)

    def _grouped_attention(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None
    ) -> torch.Tensor:
        # A few queries against a long context (a short chunk after a restored prefix): plain
        # grouped einsums beat SDPA's GQA path by ~6x here, and the [n, ctx] scores are small.
        n, hq, d = q.shape
        hk = k.shape[1]
        qg = q.view(n, hk, hq // hk, d)
        scores = torch.einsum("nhgd,thd->hgnt", qg, k) * self.scale  # [hk, group, n, ctx]
        if mask is None:
            mask = torch.ones(n, k.shape[0], dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~mask, float("-inf"))
        out = torch.einsum("hgnt,thd->nhgd", scores.softmax(-1), v)  # [n, hk, group, d]
        return out.reshape(n, hq, d)
