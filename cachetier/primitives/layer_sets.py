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
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from cachetier.primitives.keys import KVLayout, Namespace

# Ends tried below the full-attention layers' hit before giving up: each costs one lookup of a
# window's keys per set. A window's records are written whole from its start on, so the first
# end tried is the one that holds, short of an eviction inside the window.
MAX_ENDS_TRIED = 16


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
        """``first_needed_block`` of these layers' window."""
        return first_needed_block(self.window, num_tokens, block_size)

    def first_saved_block(
        self, num_prompt_tokens: int, block_size: int, align: int | None = None
    ) -> int:
        """``first_saved_block`` of these layers' window."""
        return first_saved_block(self.window, num_prompt_tokens, block_size, align)


def first_needed_block(window: int | None, num_tokens: int, block_size: int) -> int:
    """The first block a hit of ``num_tokens`` tokens needs of layers with ``window``: 0 for
    full attention (``None``); for a window, the block of token ``num_tokens - window + 1``,
    the first the next token attends to (vLLM's ``SlidingWindowManager`` pads the blocks
    before it with its null block)."""
    if window is None:
        return 0
    return max(0, num_tokens - window + 1) // block_size


def first_saved_block(
    window: int | None, num_prompt_tokens: int, block_size: int, align: int | None = None
) -> int:
    """The first block of a prompt that layers with ``window`` store: the first one a hit
    ending at the prompt's last whole block before its last token needs (that hit is the one
    the same prompt gets again; every longer prompt that extends it hits at or past it).

    Args:
        window: the layers' window, ``None`` for full attention (every block is stored).
        num_prompt_tokens: the prompt's length.
        block_size: this engine's block size; the answer is in its blocks.
        align: the largest block size of the engines that read these records (a multiple of
            ``block_size``): the hit and the window are taken in its blocks, which an engine
            of smaller blocks needs no more than.
    """
    step = max(block_size, align or block_size)
    hit_end = (num_prompt_tokens - 1) // step * step
    return first_needed_block(window, hit_end, step) * step // block_size


def window_needs(
    sets: Sequence[LayerSet], block_size: int
) -> list[tuple[int, Callable[[int], int]]]:
    """``restorable_end``'s ``needs`` of ``sets``: per window's set, its index and the first
    block a hit ending at a block needs of it."""
    return [
        (index, lambda end, s=layer_set: s.first_needed_block(end * block_size, block_size))
        for index, layer_set in enumerate(sets)
        if layer_set.window is not None
    ]


def restorable_end(
    needs: Sequence[tuple[int, Callable[[int], int]]],
    first: int,
    full_end: int,
    holds: Callable[[int, int, int], bool],
) -> int:
    """The last block (exclusive) a hit can end at, at most ``full_end``, where every window's
    layers hold what it needs; ``first`` where none can. Tries ``MAX_ENDS_TRIED`` ends.

    Args:
        needs: per window's layer set, its index and ``need(end)``: the first block a hit
            ending at block ``end`` needs of it.
        first: blocks already in place; a hit starts there.
        full_end: where the full-attention layers' stored prefix ends.
        holds: ``holds(index, start, end)``: whether that set's tier holds every block in
            ``[start, end)``.
    """
    for end in range(full_end, max(first, full_end - MAX_ENDS_TRIED), -1):
        if all(holds(index, max(first, need(end)), end) for index, need in needs):
            return end
    return first


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
