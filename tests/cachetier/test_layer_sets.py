"""``layer_sets``: a model's layers as vLLM's hybrid KV cache manager groups them, and the
blocks of a window a hit needs and a prompt stores."""

from __future__ import annotations

import dataclasses

import pytest

from cachetier.primitives.keys import KVLayout, Namespace
from cachetier.primitives.layer_sets import LayerSet, layer_sets

BLOCK = 16


def _namespace(num_layers: int) -> Namespace:
    return Namespace("model", KVLayout("float32", BLOCK, num_layers, 2, 16), "t")


def test_layer_sets_name_their_layers_as_vllms_groups() -> None:
    base = _namespace(4)
    full, sliding = layer_sets([None, 24, None, 24], base)
    assert (full.layers, full.window, sliding.layers, sliding.window) == ((0, 2), None, (1, 3), 24)
    assert (full.namespace.layers, sliding.namespace.layers) == ("0,2", "1,3")
    assert full.namespace.layout == dataclasses.replace(base.layout, num_layers=2)
    assert full.namespace.tenant == "t" and full.namespace.id != base.id
    # One set of every layer keeps the namespace, and so the keys, of whole-block records.
    assert layer_sets([24] * 4, base) == [LayerSet((0, 1, 2, 3), 24, base)]
    assert layer_sets([None] * 4, base) == [LayerSet((0, 1, 2, 3), None, base)]
    with pytest.raises(ValueError, match="one window size"):
        layer_sets([24, 32, None, None], base)
    with pytest.raises(ValueError, match="3 layer windows"):
        layer_sets([24, None, None], base)


def test_a_window_needs_the_blocks_its_next_token_sees() -> None:
    (window,) = layer_sets([24] * 2, _namespace(2))
    assert window.first_needed_block(144, BLOCK) == 7  # tokens 121..144
    assert window.first_needed_block(16, BLOCK) == 0
    assert window.first_saved_block(150, BLOCK) == 7  # its hit ends at 144
    assert window.first_saved_block(145, BLOCK) == 7  # 144 tokens: the hit ends at 144
    assert window.first_saved_block(144, BLOCK) == 6  # the last block is recomputed: 128
    # Read by an engine of 32-token blocks too: its hit ends at 128, needing tokens 105..128.
    assert window.first_saved_block(150, BLOCK, align=32) == 6
    assert window.first_saved_block(150, BLOCK, align=BLOCK) == 7
    (full,) = layer_sets([None] * 2, _namespace(2))
    assert full.first_needed_block(144, BLOCK) == full.first_saved_block(150, BLOCK) == 0
