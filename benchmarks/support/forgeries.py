"""Forged records that pass every checksum, for the restore guard's benchmark and tests.

Each forgery rewrites the records a real engine stored on a real disk tier: the same keys,
fingerprint, dtype and shape, freshly checksummed, holding KV that is wrong for its tokens:

- ``k_and_v_swapped``: a writer that stores K where V belongs;
- ``another_arrangement``: ``[layers, tokens, K/V, heads, dim]`` bytes labelled canonical (a
  layout converter's bug);
- ``other_tokens``: the right model's KV of another prompt under this prompt's keys;
- ``noise_in_every_layer``: every layer moved by half a full verification's fp32 tolerance,
  which only the per-record check's tighter first-layer tolerance refuses;
- ``noise_below_tolerance``: every layer moved by a quarter of the per-record check's fp32
  tolerance (a token's own share of it, drawn, stays below the whole), which no check can tell
  from an honest record's rounding: what it costs in answers is measured;
- another model's KV under this model's fingerprint (a fingerprint set by hand): made by the
  caller, who stores the same prompt with the other model and passes its records' values.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from cachetier.guard.compare import REL_TOLERANCE
from cachetier.guard.record_check import FIRST_LAYER_TOLERANCE
from cachetier.primitives.keys import Namespace, block_keys
from cachetier.record import KVBlock
from cachetier.tiers.disk.tier import DiskTier, DiskTierConfig


class Stored:
    """What a disk-only store in ``folder`` holds for one engine's namespace.

    Args:
        folder: the disk tier's folder.
        namespace: the engine's namespace.
    """

    def __init__(self, folder: Path, namespace: Namespace) -> None:
        self.namespace = namespace
        self.disk = DiskTier(DiskTierConfig(str(folder), 1 << 30, fsync=False))

    def records(self, tokens: list[int]) -> list[KVBlock]:
        """The records of every full block of ``tokens`` (all must be stored)."""
        got = self.disk.get_many(self.namespace.id, block_keys(self.namespace, tokens))
        if any(r is None for r in got):
            raise AssertionError("the engine stored every full block")
        return [r for r in got if r is not None]

    def replace(
        self, records: list[KVBlock], payloads: list[np.ndarray], writer: bytes | None = None
    ) -> None:
        """Rewrite ``records`` with ``payloads``: same keys, fingerprint, dtype and shape,
        named as ``writer``'s (``None``: this process's)."""
        forged = [
            KVBlock(
                r.key, r.fingerprint, r.dtype, r.shape, r.num_tokens, p.tobytes(), writer=writer
            )
            for r, p in zip(records, payloads, strict=True)
        ]
        self.disk.delete(self.namespace.id, [r.key for r in records])
        if self.disk.put_many(self.namespace.id, forged) != len(forged):
            raise AssertionError("the forged records were not stored")

    def close(self) -> None:
        self.disk.close()

    def __enter__(self) -> Stored:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def vllm_namespace(model_dir: Path, cache_salt: str, record_tokens: int = 16) -> Namespace:
    """The namespace the vLLM connector stores an fp32 request of ``cache_salt`` under, for
    the model in ``model_dir`` (its fingerprint, records of ``record_tokens`` tokens, no
    tenant)."""
    from cachetier.engine.model_spec import ModelSpec
    from cachetier.primitives.fingerprint import model_fingerprint
    from cachetier.primitives.keys import KVLayout

    spec = ModelSpec.from_folder(model_dir)
    layout = KVLayout("float32", record_tokens, spec.num_layers, spec.num_kv_heads, spec.head_dim)
    return Namespace(model_fingerprint(model_dir), layout, f"\0{cache_salt}")


def values(record: KVBlock) -> np.ndarray:
    """A record's payload as an array of its dtype and shape."""
    return np.frombuffer(record.data, dtype=record.dtype).reshape(record.shape)


def k_and_v_swapped(records: list[KVBlock]) -> list[np.ndarray]:
    """K where V belongs and V where K does."""
    return [np.ascontiguousarray(values(r)[:, ::-1]) for r in records]


def another_arrangement(records: list[KVBlock]) -> list[np.ndarray]:
    """``[layers, tokens, K/V, heads, dim]`` bytes labelled canonical."""
    return [np.ascontiguousarray(values(r).transpose(0, 2, 1, 3, 4)) for r in records]


def values_of(records: list[KVBlock]) -> Callable[[list[KVBlock]], list[np.ndarray]]:
    """A forgery that puts ``records``' values (another prompt's, another model's) in place."""

    def forge(forged: list[KVBlock]) -> list[np.ndarray]:
        return [values(r) for r in records[: len(forged)]]

    return forge


FORGED_KINDS = (
    "other_tokens",
    "k_and_v_swapped",
    "first_layer_zeroed",
    "heads_permuted",
    "deep_layer",
    "noise_in_every_layer",
    "noise_below_tolerance",
)

# The noise forgeries' sizes, per layer and plane: half a full verification's fp32 tolerance,
# which a first-layer tolerance as loose as that let through; and a quarter of the per-record
# check's, below what any check can tell from an honest record's rounding (each token's share
# of a record's noise is drawn: at half, one token in a thousand passes the tolerance).
NOISE_IN_EVERY_LAYER_SHARE = REL_TOLERANCE["float32"] / 2
NOISE_SHARE = FIRST_LAYER_TOLERANCE["float32"] / 4


def noise(v: np.ndarray, share: float, seed: int = 0) -> np.ndarray:
    """``v`` (``[layers, 2, tokens, heads, dim]``) plus Gaussian noise of ``share`` of each
    layer's K and V plane's norm."""
    rng = np.random.default_rng(seed)
    out = v.astype(np.float32, copy=True)
    for layer in range(out.shape[0]):
        for plane in range(out.shape[1]):
            drawn = rng.standard_normal(out[layer, plane].shape).astype(np.float32)
            size = float(np.linalg.norm(out[layer, plane])) * share
            out[layer, plane] += drawn * (size / max(float(np.linalg.norm(drawn)), 1e-30))
    return out.astype(v.dtype)


def noise_below_tolerance(v: np.ndarray, seed: int = 0) -> np.ndarray:
    """``v`` moved by ``NOISE_SHARE`` in every layer: passes every check by design."""
    return noise(v, NOISE_SHARE, seed)


def noise_in_every_layer(v: np.ndarray, seed: int = 0) -> np.ndarray:
    """``v`` moved by ``NOISE_IN_EVERY_LAYER_SHARE`` in every layer: the first layer's share
    is past the per-record check's tolerance."""
    return noise(v, NOISE_IN_EVERY_LAYER_SHARE, seed)


def _changed(kind: str, v: np.ndarray) -> np.ndarray:
    if kind == "noise_below_tolerance":
        return noise_below_tolerance(v)
    if kind == "noise_in_every_layer":
        return noise_in_every_layer(v)
    if kind == "k_and_v_swapped":
        return v[:, ::-1]
    if kind == "heads_permuted":
        return v[:, :, :, ::-1]
    v = v.copy()
    v[0 if kind == "first_layer_zeroed" else -1] = 0  # else: deep_layer
    return v


def forge_records(spec: dict[str, Any]) -> None:
    """Rewrite the records of ``spec["targets"]`` (``[kind, tokens, other tokens]`` each,
    kind one of ``FORGED_KINDS``) in the vLLM namespace of ``spec["salt"]``, under the writer
    ``spec["writer"]`` (hex): run by the benchmark, or by a vLLM child between two of its
    requests, through a disk tier of its own."""
    namespace = vllm_namespace(Path(spec["model"]), spec["salt"])
    writer = bytes.fromhex(spec["writer"])
    with Stored(Path(spec["disk"]), namespace) as stored:
        for kind, tokens, other in spec["targets"]:
            records = stored.records(tokens)
            if kind == "other_tokens":
                payloads = [values(r) for r in stored.records(other)[: len(records)]]
            else:
                payloads = [np.ascontiguousarray(_changed(kind, values(r))) for r in records]
            stored.replace(records, payloads, writer=writer)
