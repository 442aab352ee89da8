"""The small per-layer ops of a Llama decoder, fused on CPU: residual add + RMSNorm, SiLU-and-
multiply, and rotary embedding + the K/V store.

Each has a plain-torch ``*_ref`` (what runs off the CPU, under ``backend="torch"``, or where
the extension cannot be built, and the tests' oracle); on CPU, ``backend="auto"`` runs
``csrc/fused_ops_cpu.cpp`` (built by ``cachetier.kernels.native_build``), one pass over the rows in
float32 where torch makes several, which is faster on SmolLM2's shapes. vLLM-CPU fuses the same
three for the same reason.

Numerics follow transformers' Llama step for step (RMSNorm and RoPE in float32, one rounding to
the storage dtype where it rounds); the fused float32 path differs from the reference only in
the order of RMSNorm's sum and the last bit of SiLU's exponential.
"""

from __future__ import annotations

from types import ModuleType

import torch
import torch.nn.functional as F

from cachetier.kernels.cache_ops import store_kvcache
from cachetier.kernels.native_build import load_cpu_extension


def native_fused_ops() -> ModuleType | None:
    """The compiled extension, or ``None`` where it is off or cannot be built."""
    return load_cpu_extension("cachetier_fused_ops_cpu", "fused_ops_cpu.cpp")


def _native(backend: str, *tensors: torch.Tensor) -> ModuleType | None:
    if backend != "auto" or any(t.device.type != "cpu" or not t.is_contiguous() for t in tensors):
        return None
    return native_fused_ops()


def rms_norm_ref(
    x: torch.Tensor, weight: torch.Tensor, eps: float, delta: torch.Tensor | None = None
) -> torch.Tensor:
    """Plain-torch ``rms_norm``."""
    if delta is not None:
        x.add_(delta)
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    delta: torch.Tensor | None = None,
    *,
    backend: str = "auto",
) -> torch.Tensor:
    """``weight * x / sqrt(mean(x^2) + eps)`` per row, after ``x += delta`` in place.

    Args:
        x: ``[rows, hidden]``, the residual stream; updated in place when ``delta`` is given.
        weight: ``[hidden]``, ``x``'s dtype.
        eps: added to the mean square.
        delta: ``[rows, hidden]`` to add into ``x`` first (the last sublayer's output), or
            ``None``.
        backend: ``"auto"`` (the fused kernel on CPU) or ``"torch"``/``"triton"`` (the
            reference).

    Returns:
        The normalised rows, a new ``[rows, hidden]`` tensor.

    Raises:
        ValueError: shapes or dtypes that do not match.
    """
    if x.dim() != 2 or weight.shape != (x.shape[1],) or weight.dtype != x.dtype:
        raise ValueError(
            f"rms_norm wants x [rows, hidden] and weight [hidden] of one dtype, got "
            f"{tuple(x.shape)} {x.dtype} and {tuple(weight.shape)} {weight.dtype}"
        )
    if delta is not None and (delta.shape != x.shape or delta.dtype != x.dtype):
        raise ValueError(f"delta {tuple(delta.shape)} {delta.dtype} does not match x")
    tensors = (x, weight) if delta is None else (x, weight, delta)
    native = _native(backend, *tensors)
    if native is None:
        return rms_norm_ref(x, weight, eps, delta)
    return native.add_rms_norm(x, delta, weight, float(eps))


def silu_mul_ref(gate_up: torch.Tensor) -> torch.Tensor:
    """Plain-torch ``silu_mul``."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def silu_mul(gate_up: torch.Tensor, *, backend: str = "auto") -> torch.Tensor:
    """``silu(gate) * up`` of a fused gate/up projection's output.

    Args:
        gate_up: ``[rows, 2 * intermediate]``, the gate's columns then the up's.
        backend: as for ``rms_norm``.

    Returns:
        ``[rows, intermediate]``.

    Raises:
        ValueError: not two-dimensional with an even width.
    """
    if gate_up.dim() != 2 or gate_up.shape[1] % 2:
        raise ValueError(f"silu_mul wants [rows, 2 * intermediate], got {tuple(gate_up.shape)}")
    native = _native(backend, gate_up)
    return silu_mul_ref(gate_up) if native is None else native.silu_mul(gate_up)


def rope_angles(positions: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Each position's rotary ``cos`` and ``sin``, float32 ``[rows, head_dim / 2]`` each (the
    second half of a head uses the same angles as the first)."""
    freqs = positions.float()[:, None] * inv_freq[None, :].to(positions.device)
    return freqs.cos().contiguous(), freqs.sin().contiguous()


def rope_store_ref(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    kv_cache: torch.Tensor | None = None,
    layer: int = 0,
    slot_mapping: torch.Tensor | None = None,
    *,
    backend: str = "torch",
) -> None:
    """Plain-torch ``rope_store`` (the store through ``kernels.store_kvcache``)."""
    rows, width = qkv.shape
    head_dim = width // (num_heads + 2 * num_kv_heads)
    half = head_dim // 2
    heads = num_heads + num_kv_heads
    qk = qkv[:, : heads * head_dim].view(rows, heads, head_dim)
    c = cos[:, None, :].to(qkv.dtype)
    s = sin[:, None, :].to(qkv.dtype)
    # transformers' q * cos + rotate_half(q) * sin, on the two halves.
    x1, x2 = qk[..., :half].clone(), qk[..., half:].clone()
    qk[..., :half] = x1 * c - x2 * s
    qk[..., half:] = x2 * c + x1 * s
    if kv_cache is not None:
        k = qkv[:, num_heads * head_dim : heads * head_dim].view(rows, num_kv_heads, head_dim)
        v = qkv[:, heads * head_dim :].view(rows, num_kv_heads, head_dim)
        assert slot_mapping is not None
        store_kvcache(k, v, kv_cache, layer, slot_mapping, backend=backend)


def rope_store(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    kv_cache: torch.Tensor | None = None,
    layer: int = 0,
    slot_mapping: torch.Tensor | None = None,
    *,
    backend: str = "auto",
) -> None:
    """Rotates the query and key heads of a fused q/k/v projection in place (rotate-half RoPE)
    and, where a pool is given, writes each token's rotated K and its V into its slot.

    Args:
        qkv: ``[rows, (num_heads + 2 * num_kv_heads) * head_dim]``: each row's query heads,
            key heads, value heads.
        cos, sin: ``rope_angles`` of the rows' positions.
        num_heads, num_kv_heads: query and KV heads.
        kv_cache: the pool (``cachetier.kernels.pool_shape``) in ``qkv``'s dtype, or ``None`` to
        rotate
            only.
        layer: the pool layer written.
        slot_mapping: ``[rows]`` int64 or int32 slots (``-1`` skips a row), with ``kv_cache``.
        backend: ``"auto"`` (fused on CPU), ``"torch"`` or ``"triton"`` (the reference, whose
            store takes that backend).

    Raises:
        ValueError: shapes that do not match, or a slot out of the pool's range (nothing is
            written then).
    """
    if num_kv_heads < 1 or num_heads < 1 or num_heads % num_kv_heads:
        raise ValueError(f"heads must be positive, {num_heads} a multiple of {num_kv_heads}")
    rows = qkv.shape[0]
    heads = num_heads + 2 * num_kv_heads
    if qkv.dim() != 2 or qkv.shape[1] % heads or (qkv.shape[1] // heads) % 2:
        raise ValueError(f"qkv {tuple(qkv.shape)} is not [rows, {heads} heads of an even size]")
    half = qkv.shape[1] // heads // 2
    for name, t in (("cos", cos), ("sin", sin)):
        if t.shape != (rows, half) or t.dtype != torch.float32:
            raise ValueError(f"{name} must be float32 [{rows}, {half}], got {tuple(t.shape)}")
    if (kv_cache is None) != (slot_mapping is None):
        raise ValueError("kv_cache and slot_mapping go together")
    tensors = [qkv, cos, sin]
    if kv_cache is not None and slot_mapping is not None:
        slot_mapping = slot_mapping.long()  # the kernel reads int64; int32 slots are widened
        tensors += [kv_cache, slot_mapping]
    native = _native(backend, *tensors)
    if native is None:
        rope_store_ref(
            qkv,
            cos,
            sin,
            num_heads,
            num_kv_heads,
            kv_cache,
            layer,
            slot_mapping,
            backend=backend,
        )
        return
    try:
        native.rope_store(qkv, cos, sin, num_heads, num_kv_heads, kv_cache, layer, slot_mapping)
    except RuntimeError as exc:  # the kernel's own checks, before it writes anything
        raise ValueError(str(exc).splitlines()[0]) from None
