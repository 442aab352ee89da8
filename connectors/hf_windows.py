"""The HF connector's records of a model with sliding-window layers, in the format our engine
and vLLM's hybrid KV cache manager use (``cachetier.primitives.layer_sets``): each layer set
in records of its own namespace, a window's set from the window before the prompt's last whole
block on, and a hit only where every set holds what it needs. A window's layers before its
window are restored as zeros: transformers' sliding cache layer keeps only its last
``window - 1`` tokens of them, and attention reads no other.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from cachetier.connectors.hf_layers import held_from
from cachetier.kernels.staging import payload_tensor, payload_view
from cachetier.primitives.keys import BlockHash, block_keys, torch_dtype
from cachetier.primitives.layer_sets import LayerSet, restorable_end, window_needs
from cachetier.record import KVBlock
from cachetier.store.record_guard import RecordGuard
from cachetier.store.tiered import TieredStore


@dataclass(frozen=True, slots=True)
class WindowedHit:
    """What a windowed restore read: per layer its K and V ``[1, heads, tokens, dim]`` of the
    hit's tokens, and the tier of each block (a window's tier before its window)."""

    layers: list[tuple[torch.Tensor, torch.Tensor]]
    sources: tuple[str, ...]


class WindowedRecords:
    """Restore and save one model's layer sets (module docstring).

    Args:
        store: the tiers.
        sets: the model's layer sets, one at least with a window.
        record_guard: the check of every restored record; the set holding layer 0 is also
            checked against its tokens.
        device: where the restored K and V go.
    """

    def __init__(
        self,
        store: TieredStore,
        sets: Sequence[LayerSet],
        record_guard: RecordGuard,
        device: torch.device,
    ) -> None:
        self.store = store
        self.sets = tuple(sets)
        self.record_guard = record_guard
        self.device = device
        self.rejected = 0
        layout = self.sets[0].namespace.layout
        self.block_size = layout.block_size
        self.num_layers = sum(len(s.layers) for s in self.sets)

    def _keys(self, tokens: Sequence[int], num_blocks: int) -> list[list[BlockHash]]:
        prefix = list(tokens[: num_blocks * self.block_size])
        return [block_keys(s.namespace, prefix) for s in self.sets]

    def _start(self, layer_set: LayerSet, end: int) -> int:
        return layer_set.first_needed_block(end * self.block_size, self.block_size)

    def _end(self, keys: list[list[BlockHash]], last: int) -> int:
        """The last block (exclusive) a hit can end at where every set holds what it needs."""
        full_end = last
        for s_index, layer_set in enumerate(self.sets):
            if layer_set.window is None:
                found = self.store.lookup(layer_set.namespace.id, keys[s_index][:last])
                full_end = min(full_end, found.num_blocks)

        def holds(index: int, start: int, end: int) -> bool:
            found = self.store.lookup(self.sets[index].namespace.id, keys[index][start:end])
            return found.num_blocks >= end - start

        return restorable_end(window_needs(self.sets, self.block_size), 0, full_end, holds)

    def restore(self, tokens: list[int]) -> WindowedHit | None:
        """The longest hit of ``tokens`` short of their last one, read and checked; ``None``
        for none."""
        last = (len(tokens) - 1) // self.block_size
        if last <= 0:
            return None
        keys = self._keys(tokens, last)
        end = self._end(keys, last)
        if end == 0:
            return None
        layers: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * self.num_layers
        sources: list[str] = [""] * end
        for s_index, layer_set in enumerate(self.sets):
            start = self._start(layer_set, end)
            records, tiers = self._read(layer_set, keys[s_index][start:end], tokens, start)
            if len(records) < end - start:
                return None  # a record failed: the hit's end needs every one
            self._place(layer_set, records, start, end, layers)
            for b, source in enumerate(tiers, start=start):
                sources[b] = sources[b] or source
        window = next((s for s in sources if s), "")
        placed = [pair for pair in layers if pair is not None]
        assert len(placed) == self.num_layers, "every layer is in a set"
        return WindowedHit(placed, tuple(s or window for s in sources))

    def _read(
        self, layer_set: LayerSet, keys: list[BlockHash], tokens: list[int], start: int
    ) -> tuple[list[KVBlock], list[str]]:
        """The leading records of ``keys`` that are of the set's layout and pass the guard."""
        ns = layer_set.namespace
        found = self.store.restore_prefix(ns.id, keys, fingerprint=ns.fingerprint)
        layout = ns.layout
        good: list[KVBlock] = []
        for record in found.blocks:
            if (
                record.dtype != layout.dtype
                or tuple(record.shape) != layout.payload_shape
                or record.num_tokens != layout.block_size
                or memoryview(record.data).nbytes != layout.block_bytes
            ):
                self.rejected += 1
                break
            good.append(record)
        if not good:
            return [], []
        bs = self.block_size
        # The per-record check recomputes the model's first layer: the set that holds it.
        checked = None
        if layer_set.layers[0] == 0:
            checked = tokens[start * bs : (start + len(good)) * bs]
        admitted = self.record_guard.admit(
            ns.id, good, found.sources[: len(good)], checked, start * bs
        )
        return good[: admitted.count], list(found.sources[: admitted.count])

    def _place(
        self,
        layer_set: LayerSet,
        records: list[KVBlock],
        start: int,
        end: int,
        layers: list[tuple[torch.Tensor, torch.Tensor] | None],
    ) -> None:
        """Each of the set's layers' K and V over the hit's tokens, from its records; zeros
        before ``start``."""
        layout = layer_set.namespace.layout
        bs = self.block_size
        dtype = torch_dtype(layout.dtype)
        shape = (1, layout.num_kv_heads, end * bs, layout.head_dim)
        kv = torch.zeros((len(layer_set.layers), 2, *shape), dtype=dtype)
        for b, record in enumerate(records, start=start):
            payload = payload_tensor(record.data, dtype, layout.payload_shape)  # [L, 2, T, H, D]
            kv[:, :, 0, :, b * bs : (b + 1) * bs, :] = payload.transpose(2, 3)
        for j, layer in enumerate(layer_set.layers):
            layers[layer] = (kv[j, 0].to(self.device), kv[j, 1].to(self.device))

    def save(self, tokens: list[int], cache: object) -> int:
        """Store what ``cache`` holds of ``tokens``' full blocks that each set stores and the
        store lacks; the blocks stored (of the set stored furthest)."""
        bs = self.block_size
        num_blocks = len(tokens) // bs
        if num_blocks == 0:
            return 0
        keys = self._keys(tokens, num_blocks)
        layers = cache.layers  # type: ignore[attr-defined]
        saved = 0
        for s_index, layer_set in enumerate(self.sets):
            first = layer_set.first_saved_block(len(tokens), bs) if layer_set.window else 0
            ns = layer_set.namespace
            start = first + self.store.lookup(ns.id, keys[s_index][first:num_blocks]).num_blocks
            held = max(held_from(layers[i]) for i in layer_set.layers)
            if start >= num_blocks or held > start * bs:
                continue  # stored, or a layer dropped tokens of the first block it lacks
            records = [
                self._record(layer_set, keys[s_index][b], layers, b)
                for b in range(start, num_blocks)
            ]
            self.store.put_many(ns.id, records)
            saved = max(saved, len(records))
        return saved

    def _record(self, layer_set: LayerSet, key: BlockHash, layers: object, b: int) -> KVBlock:
        layout = layer_set.namespace.layout
        bs = self.block_size
        parts = []
        for i in layer_set.layers:
            layer = layers[i]  # type: ignore[index]
            at = b * bs - held_from(layer)
            k = layer.keys[0, :, at : at + bs, :].transpose(0, 1)  # [T, H, D]
            v = layer.values[0, :, at : at + bs, :].transpose(0, 1)
            parts.append(torch.stack([k, v]))
        payload = torch.stack(parts).to("cpu").contiguous()
        shape = tuple(payload.shape)
        if payload.dtype != torch_dtype(layout.dtype) or shape != layout.payload_shape:
            raise ValueError(
                f"cache layers {layer_set.layers} hold {payload.dtype} {tuple(payload.shape)}, "
                f"the layout needs {layout.dtype} {layout.payload_shape}"
            )
        return KVBlock(
            key,
            layer_set.namespace.fingerprint,
            layout.dtype,
            layout.payload_shape,
            bs,
            payload_view(payload),
        )
