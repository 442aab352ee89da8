"""A restored block against the same block computed again: does the record hold this model's KV
for these tokens?

A checksum proves that a record holds the bytes its writer wrote, not that those bytes are what
this model computes for these tokens: another model's blocks under a shared fingerprint, K and V
swapped, the right model's KV of other tokens, or another arrangement labelled canonical all pass
it. A recomputation catches each of them, because each moves a layer's K or V by about its own
size, while an honest record differs from a recomputation only by the order of its sums.

The measure is per layer and per plane (K, V, or an MLA latent): the relative error
``||restored - computed|| / ||computed||`` in float64. An honest record stays far below the
tolerance of its dtype (``REL_TOLERANCE``); the forgeries above come out near 1.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from cachetier.primitives.kv_format import SCALE_DTYPE
from cachetier.record import KVBlock

# The largest relative error, per layer and plane, that a recomputation of the same tokens may
# show. An honest difference is the rounding of a different order of sums (another batch, chunk
# or kernel), which grows with the dtype's precision and through the layers; a wrong record is
# off by about its own size (relative error near 1), so these leave a wide margin both ways.
REL_TOLERANCE: dict[str, float] = {
    "float32": 0.01,
    "float16": 0.05,
    "bfloat16": 0.1,
    "float8_e4m3fn": 0.25,
    "float8_e5m2": 0.3,
}
PLANE_NAMES = ("K", "V")
TINY_NORM = 1e-12  # below this norm a plane is zeros: compare absolutely


@dataclass(frozen=True, slots=True)
class BlockMismatch:
    """What differed between a restored block and its recomputation.

    Args:
        key_hex: the block's key.
        dtype: the block's dtype, whose tolerance was applied.
        tolerance: that tolerance.
        worst: ``(layer, plane name, relative error)`` of every layer and plane past it, worst
            first (at most eight).
        max_rel_error: the largest relative error of any layer and plane.
        reason: ``"values"``, or ``"shape"`` / ``"dtype"`` when the two cannot be compared.
        format_version: the record format version the restored block was read from (0: not
            read from a record).
    """

    key_hex: str
    dtype: str
    tolerance: float
    worst: tuple[tuple[int, str, float], ...]
    max_rel_error: float
    reason: str = "values"
    format_version: int = 0

    def describe(self) -> str:
        """One line for the log: which layers, K or V, and how far off."""
        record = f"record format v{self.format_version}" if self.format_version else "record"
        if self.reason != "values":
            return f"block {self.key_hex[:16]} ({record}): {self.reason} differs"
        parts = ", ".join(f"layer {layer} {plane} {err:.3g}" for layer, plane, err in self.worst)
        return (
            f"block {self.key_hex[:16]} ({self.dtype}, {record}): max relative error "
            f"{self.max_rel_error:.3g} > {self.tolerance:g} at {parts}"
        )


def compare_blocks(restored: KVBlock, computed: KVBlock) -> BlockMismatch | None:
    """Compare a restored block with the same tokens' block computed by this model.

    Args:
        restored: the block a tier returned (its record's checks already passed).
        computed: the block the engine computed for the same key, in the canonical format.

    Returns:
        ``None`` when every layer and plane is within the dtype's tolerance, else what differed.

    Raises:
        ValueError: the dtype has no tolerance (not a float KV dtype).
    """
    key_hex = restored.key.hex()
    tolerance = _tolerance(computed.dtype)
    version = restored.format_version
    if restored.dtype != computed.dtype:
        return BlockMismatch(key_hex, computed.dtype, tolerance, (), float("inf"), "dtype", version)
    if restored.shape != computed.shape or restored.num_tokens != computed.num_tokens:
        return BlockMismatch(key_hex, computed.dtype, tolerance, (), float("inf"), "shape", version)
    errors = relative_errors(restored, computed)  # [layers, planes]
    worst = float(errors.max()) if errors.size else 0.0
    if worst <= tolerance:
        return None
    past = np.argwhere(errors > tolerance)
    ranked = sorted(past.tolist(), key=lambda lp: -errors[lp[0], lp[1]])[:8]
    names = PLANE_NAMES if errors.shape[1] == 2 else ("latent",)
    details = tuple((int(l), names[p], float(errors[l, p])) for l, p in ranked)  # noqa: E741
    return BlockMismatch(key_hex, computed.dtype, tolerance, details, worst, "values", version)


def relative_errors(restored: KVBlock, computed: KVBlock) -> np.ndarray:
    """``||restored - computed|| / ||computed||`` per layer and plane, as ``[layers, planes]``."""
    a = _as_float64(restored)
    b = _as_float64(computed)
    layers, planes = b.shape[0], b.shape[1]
    diff = np.linalg.norm((a - b).reshape(layers, planes, -1), axis=2)
    norm = np.linalg.norm(b.reshape(layers, planes, -1), axis=2)
    errors = np.where(norm > TINY_NORM, diff / np.maximum(norm, TINY_NORM), diff)
    return np.nan_to_num(errors, nan=np.inf)  # a NaN in either is as wrong as can be


def _tolerance(dtype: str) -> float:
    tolerance = REL_TOLERANCE.get(dtype)
    if tolerance is None:
        raise ValueError(f"no tolerance for dtype {dtype!r}: one of {sorted(REL_TOLERANCE)}")
    return tolerance


def _as_float64(block: KVBlock) -> np.ndarray:
    """The block's values as float64 in its shape, fp8 scaled by its per-layer scales."""
    raw = np.frombuffer(block.data, dtype=np.uint8)
    if block.dtype == "float32":
        values = raw.view("<f4").astype(np.float64)
    elif block.dtype == "float16":
        values = raw.view("<f2").astype(np.float64)
    elif block.dtype == "bfloat16":
        # bfloat16 is the high half of a float32: widen by shifting into place.
        values = (raw.view("<u2").astype(np.uint32) << 16).view("<f4").astype(np.float64)
    else:
        values = fp8_values(block.dtype, raw)
    values = values.reshape(block.shape)
    if block.dtype.startswith("float8") and block.aux:
        values = _scaled(values, block.aux)
    return values


def _scaled(values: np.ndarray, aux: bytes | bytearray | memoryview) -> np.ndarray:
    # fp8 records carry one scale per layer and plane ([layers, 2] float32, kv_format).
    scales = np.frombuffer(aux, dtype=SCALE_DTYPE).astype(np.float64)
    layers, planes = values.shape[0], values.shape[1]
    if scales.size != layers * planes:
        return values
    return values * scales.reshape(layers, planes, *([1] * (values.ndim - 2)))


_FP8_TABLES: dict[str, np.ndarray] = {}


def fp8_values(dtype: str, raw: np.ndarray) -> np.ndarray:
    """fp8 bit patterns ``raw`` (uint8) as float64 values of format ``dtype``."""
    return _fp8_table(dtype)[raw]


def _fp8_table(dtype: str) -> np.ndarray:
    """The 256 values of an fp8 format, by bit pattern (NaN patterns as NaN)."""
    table = _FP8_TABLES.get(dtype)
    if table is None:
        exponent_bits, bias = {"float8_e4m3fn": (4, 7), "float8_e5m2": (5, 15)}[dtype]
        mantissa_bits = 7 - exponent_bits
        codes = np.arange(256)
        sign = np.where(codes & 0x80, -1.0, 1.0)
        exp = (codes >> mantissa_bits) & ((1 << exponent_bits) - 1)
        man = codes & ((1 << mantissa_bits) - 1)
        frac = man / (1 << mantissa_bits)
        normal = (1 + frac) * np.exp2(exp.astype(np.float64) - bias)
        subnormal = frac * np.exp2(1.0 - bias)
        table = sign * np.where(exp == 0, subnormal, normal)
        if dtype == "float8_e4m3fn":
            table[(codes & 0x7F) == 0x7F] = np.nan
        else:
            top = exp == 0x1F
            table[top] = np.where(man[top] == 0, sign[top] * np.inf, np.nan)
        _FP8_TABLES[dtype] = table
    return table
