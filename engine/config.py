"""The engine's configuration (vLLM's names where they exist)."""

from __future__ import annotations

import re
from dataclasses import dataclass

from cachetier.guard import GuardConfig
from cachetier.store.engine_settings import KV_LOAD_POLICIES as KV_LOAD_POLICIES
from cachetier.store.engine_settings import (
    check_kv_load_policy,
    guard_first_hits_setting,
    guard_fraction_setting,
    guard_setting,
    kv_load_policy_setting,
    record_check_setting,
    record_check_tokens_setting,
    record_tokens_setting,
    tenant_setting,
)
from cachetier.util.checks import positive_int

GiB = 1 << 30

# Dtypes the engine computes in, by their ``cachetier.primitives.keys.DTYPE_BYTES`` names.
MODEL_DTYPES = ("float32", "bfloat16", "float16")
# vLLM's fp8 ``kv_cache_dtype`` names -> the pool's element type.
FP8_KV_DTYPES = {"fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2"}
# Element types a KV pool may have: a float pool holds K/V as computed, an fp8 pool quantises.
POOL_DTYPES = (*MODEL_DTYPES, *FP8_KV_DTYPES.values())
# Devices the engine runs on: the CPU, or one CUDA device.
DEVICE_PATTERN = re.compile(r"cpu|cuda(:[0-9]+)?")


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """What the engine runs and how: the model, its dtypes, the KV pool and the batch limits.

    ``tenant``, ``kv_load_policy`` and ``record_tokens`` are declared with the plugins' own
    (``cachetier.store.engine_settings``).

    Args:
        model: a local Hugging Face model folder (config.json + safetensors).
        dtype: compute dtype: ``float32``, ``bfloat16`` or ``float16``.
        block_size: tokens per KV block.
        kv_cache_bytes: memory for the KV pool (like ``VLLM_CPU_KVCACHE_SPACE``).
        kv_cache_dtype: ``auto`` (the compute dtype), another float pool dtype, or ``fp8_e4m3`` /
            ``fp8_e5m2``: KV stored in fp8 with one float32 scale per block, layer and K/V.
        max_num_seqs: most sequences running at once.
        max_num_batched_tokens: most tokens computed in one step (chunked prefill budget).
        max_model_len: longest sequence (prompt + output); ``None`` takes the model's limit.
        enable_prefix_caching: reuse pool blocks and tier blocks on prefix hits.
        kernel_backend: ``auto``, ``torch`` or ``triton`` (see ``cachetier.kernels.backend``).
        num_threads: torch intra-op threads; ``None`` leaves torch's default.
        event_log: a JSON-lines file that gets one ``cachetier.report.events.LookupEvent``
            per admitted request (for ``cachetier report``); ``None`` for none.
        device: where the weights, the KV pool and the forward live: ``cpu`` or ``cuda`` /
            ``cuda:N`` (the same code either way; off the CPU the kernels take their Triton or
            torch paths, and blocks reach the tiers through one host copy per batch).
        window_block_tokens: the largest block size of the engines that read this engine's
            tiers (vLLM-CPU: 32): a sliding-window layer set's records are saved from a block
            boundary of that size, so that such an engine, which loads whole blocks of its
            own, finds every record of a window; ``None``: this engine's ``block_size``.
    """

    model: str
    dtype: str = "float32"
    block_size: int = 16
    kv_cache_bytes: int = 1 * GiB
    kv_cache_dtype: str = "auto"
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    tenant: str = tenant_setting()
    kernel_backend: str = "auto"
    num_threads: int | None = None
    event_log: str | None = None
    kv_load_policy: str = kv_load_policy_setting()
    device: str = "cpu"
    record_tokens: int = record_tokens_setting()
    guard: bool = guard_setting()
    guard_first_hits: int = guard_first_hits_setting()
    guard_fraction: float = guard_fraction_setting()
    record_check: bool = record_check_setting()
    record_check_tokens: int = record_check_tokens_setting()
    window_block_tokens: int | None = None

    def __post_init__(self) -> None:
        if self.dtype not in MODEL_DTYPES:
            raise ValueError(f"dtype must be float32, bfloat16 or float16, got {self.dtype!r}")
        if self.kv_cache_dtype not in ("auto", *MODEL_DTYPES, *FP8_KV_DTYPES):
            raise ValueError(
                f"kv_cache_dtype {self.kv_cache_dtype!r} is not supported: use auto, float32, "
                f"bfloat16, float16, {' or '.join(FP8_KV_DTYPES)}"
            )
        if self.kv_cache_dtype in MODEL_DTYPES and self.kv_cache_dtype != self.dtype:
            # A float pool holds K/V exactly as computed; only fp8 pools convert.
            raise ValueError(
                f"kv_cache_dtype {self.kv_cache_dtype!r} must match dtype {self.dtype!r} "
                "(or be auto, fp8_e4m3 or fp8_e5m2)"
            )
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        for name in ("kv_cache_bytes", "max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.max_model_len is not None and self.max_model_len <= 0:
            raise ValueError(f"max_model_len must be positive, got {self.max_model_len}")
        if self.num_threads is not None and self.num_threads <= 0:
            raise ValueError(f"num_threads must be positive, got {self.num_threads}")
        check_kv_load_policy(self.kv_load_policy)
        if self.event_log is not None and not self.event_log.strip():
            raise ValueError("event_log must be a file path, or None for no log")
        positive_int("record_tokens", self.record_tokens)
        positive_int("record_check_tokens", self.record_check_tokens)
        if self.window_block_tokens is not None and (
            self.window_block_tokens <= 0 or self.window_block_tokens % self.block_size
        ):
            raise ValueError(
                f"window_block_tokens must be a multiple of block_size ({self.block_size}), "
                f"got {self.window_block_tokens}"
            )
        if not DEVICE_PATTERN.fullmatch(self.device):
            raise ValueError(f"device must be cpu, cuda or cuda:N, got {self.device!r}")
        self.guard_config()  # checks the guard's settings

    def guard_config(self) -> GuardConfig:
        """The restore guard's sampling, from ``guard*``."""
        return GuardConfig(self.guard, self.guard_first_hits, self.guard_fraction)

    @property
    def pool_dtype(self) -> str:
        """Element type name of the KV pool (and of the blocks it saves to the tiers)."""
        if self.kv_cache_dtype == "auto":
            return self.dtype
        return FP8_KV_DTYPES.get(self.kv_cache_dtype, self.kv_cache_dtype)
