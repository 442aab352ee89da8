"""Records of a real (tiny, random) Llama's KV for the record-check tests: computed by
transformers, in the canonical block format, and the forgeries the guard must catch."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from cachetier.primitives.keys import KVLayout, Namespace, block_keys
from cachetier.record import KVBlock

BLOCK = 8  # tokens per record


def model_kv(model_dir: Path, token_ids: list[int]) -> np.ndarray:
    """transformers' KV of ``token_ids`` as ``[layers, 2, tokens, kv_heads, head_dim]``."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        cache = model(torch.tensor([token_ids]), use_cache=True).past_key_values
    layers = [
        torch.stack([layer.keys[0], layer.values[0]]).transpose(1, 2) for layer in cache.layers
    ]
    return torch.stack(layers).numpy()


def namespace_of(kv: np.ndarray) -> Namespace:
    layers, _, _, heads, dim = kv.shape
    return Namespace("tiny-llama", KVLayout("float32", BLOCK, layers, heads, dim))


def records_of(kv: np.ndarray, token_ids: list[int], writer: bytes | None = None) -> list[KVBlock]:
    """One record per ``BLOCK`` tokens of ``kv`` (a whole number of them), keyed by their
    tokens, written by ``writer`` (``None``: this process)."""
    namespace = namespace_of(kv)
    keys = block_keys(namespace, token_ids)
    return [
        KVBlock(
            key,
            namespace.fingerprint,
            "float32",
            (kv.shape[0], 2, BLOCK, kv.shape[3], kv.shape[4]),
            BLOCK,
            np.ascontiguousarray(kv[:, :, i * BLOCK : (i + 1) * BLOCK]).tobytes(),
            writer=writer,
        )
        for i, key in enumerate(keys)
    ]


def forged(record: KVBlock, change: Callable[[np.ndarray], np.ndarray]) -> KVBlock:
    """``record`` with its payload changed by ``change`` (its checks all still pass)."""
    values = np.frombuffer(record.data, dtype=np.float32).reshape(record.shape)
    data = np.ascontiguousarray(change(values.copy()), dtype=np.float32).tobytes()
    return KVBlock(
        record.key,
        record.fingerprint,
        record.dtype,
        record.shape,
        record.num_tokens,
        data,
        writer=record.writer,
    )


def _zero_layer(layer: int) -> Callable[[np.ndarray], np.ndarray]:
    def change(v: np.ndarray) -> np.ndarray:
        v[layer] = 0
        return v

    return change


FIRST_LAYER_FORGERIES: dict[str, Callable[[np.ndarray], np.ndarray]] = {
    "k_and_v_swapped": lambda v: v[:, ::-1],
    "heads_permuted": lambda v: v[:, :, :, ::-1],
    "first_layer_zeroed": _zero_layer(0),
    "tokens_shifted": lambda v: np.roll(v, 1, axis=2),
}
DEEP_LAYER_FORGERY = _zero_layer(-1)
