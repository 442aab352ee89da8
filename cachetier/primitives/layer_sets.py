"""The sets of layers a model's KV is stored in, where some layers attend to a window only.

A layer with a sliding window of ``W`` tokens needs, for a hit ending at token ``P``, only the
blocks holding tokens ``[P - W + 1, P)``; a full-attention layer needs every block. So a model
with both is stored as vLLM's hybrid KV cache manager stores it: the full-attention layers'
records and the sliding layers' records, each under a namespace naming its layers
(``Namespace.layers``, the same names as ``connectors/vllm/kv_groups``), and the sliding
layers' records only from the window before the prompt's last whole block on. A model whose
every layer has the window is one set, named ``""`` as a model without windows is; a model
without windows keeps its one set of whole-block records.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from cachetier.primitives.keys import KVLayout, Namespace


@dataclass(frozen=True, slots=True)
class LayerSet:
    """Layers stored in records of their own.

    Args:
        layers: the model's layer indices, ascending.
        window: their attention window in tokens (a query sees ``window`` keys, itself
            included); ``None`` for full attention.
        namespace: their records' namespace (``layers`` names them, ``""`` for every layer).
    """

    layers: tuple[int, ...]
    window: int | None
    namespace: Namespace

    def first_needed_block(self, num_tokens: int, block_size: int) -> int:
        """The first block a hit of ``num_tokens`` tokens needs of these layers: 0 for full
        attention; for a window, the block of token ``num_tokens - window + 1``, the first the
        next token attends to."""
        if self.window is None:
            return 0
        return max(0, num_tokens - self.window + 1) // block_size

    def first_saved_block(
        self, num_prompt_tokens: int, block_size: int, align: int | None = None
    ) -> int:
        """The first block of a prompt these layers store: the first one a hit ending at the
        prompt's last whole block before its last token needs (that hit is the one the same
        prompt gets again; every longer prompt that extends it hits at or past it).

        Args:
            num_prompt_tokens: the prompt's length.
            block_size: this engine's block size; the answer is in its blocks.
            align: the largest block size of the engines that read these records (a multiple
                of ``block_size``): the hit and the window are taken in its blocks, which an
                engine of smaller blocks needs no more than.
        """
        step = max(block_size, align or block_size)
        hit_end = (num_prompt_tokens - 1) // step * step
        return self.first_needed_block(hit_end, step) * step // block_size


def layer_sets(windows: Sequence[int | None], namespace: Namespace) -> list[LayerSet]:
    """The layer sets of a model (module docstring), full attention first.

    Args:
        windows: each layer's window, ``None`` for full attention (``ModelSpec.window_of``).
        namespace: the namespace of a record of every layer (``layers`` ``""``).
    """
    if namespace.layers:
        raise ValueError(f"namespace {namespace.describe()} already names a layer set")
    if len(windows) != namespace.layout.num_layers:
        raise ValueError(
            f"{len(windows)} layer windows for a layout of {namespace.layout.num_layers} layers"
        )
    kinds = sorted({w for w in windows if w is not None})
    if len(kinds) > 1:
        raise ValueError(f"layer windows {kinds}: one window size is supported")
    full = tuple(i for i, w in enumerate(windows) if w is None)
    sliding = tuple(i for i, w in enumerate(windows) if w is not None)
    if not sliding or not full:
        return [LayerSet(tuple(range(len(windows))), kinds[0] if kinds else None, namespace)]
    return [
        LayerSet(layers, window, _named(namespace, layers))
        for layers, window in ((full, None), (sliding, kinds[0]))
    ]


def _named(namespace: Namespace, layers: tuple[int, ...]) -> Namespace:
    layout: KVLayout = dataclasses.replace(namespace.layout, num_layers=len(layers))
    return Namespace(
        namespace.model_fingerprint, layout, namespace.tenant, ",".join(map(str, layers))
    )
