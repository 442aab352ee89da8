"""Which KV cache configs the vLLM connector stores (``connectors.vllm.kv_groups``), built from
vLLM's own spec classes: groups of full or sliding-window attention pass, each with its layers
and window, anything else is refused with a message that names it."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

import torch  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    ChunkedLocalAttentionSpec,
    CrossAttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheSpec,
    MambaSpec,
    MLAAttentionSpec,
    SinkFullAttentionSpec,
    SlidingWindowSpec,
    UniformTypeKVCacheSpecs,
)

from cachetier.connectors.vllm.kv_groups import storable_groups  # noqa: E402
from cachetier.connectors.vllm.windows import first_saved_block, restorable_end  # noqa: E402

MODEL = "/models/tiny"
SHAPE = {"block_size": 32, "num_kv_heads": 2, "head_size": 64, "dtype": torch.float32}


def _config(*specs: KVCacheSpec) -> KVCacheConfig:
    groups = [
        KVCacheGroupSpec([f"model.layers.{i}.attn", f"model.layers.{i + 10}.attn"], spec)
        for i, spec in enumerate(specs)
    ]
    return KVCacheConfig(num_blocks=16, kv_cache_tensors=[], kv_cache_groups=groups)


def _mamba() -> MambaSpec:
    return MambaSpec(block_size=32, shapes=((3, 160), (4, 32, 16)), dtypes=(torch.float32,) * 2)


@pytest.mark.parametrize(
    "spec",
    [
        FullAttentionSpec(**SHAPE),
        # What vLLM makes of sliding-window layers next to full-attention ones with the hybrid
        # KV cache manager off: blocks for every token, the window applied by the attention.
        FullAttentionSpec(**SHAPE, sliding_window=48),
        FullAttentionSpec(**SHAPE, attention_chunk_size=64),
        MLAAttentionSpec(block_size=32, num_kv_heads=1, head_size=576, dtype=torch.bfloat16),
    ],
    ids=["full", "full-with-window", "full-with-chunks", "mla"],
)
def test_one_group_that_keeps_every_token_is_stored(spec: FullAttentionSpec) -> None:
    (group,) = storable_groups(_config(spec), MODEL)
    assert group.spec is spec and group.window is None and group.layers == ""
    assert group.first_needed_block(10_000) == 0


def test_hybrid_groups_name_their_layers_and_windows() -> None:
    full, sliding = FullAttentionSpec(**SHAPE), SlidingWindowSpec(**SHAPE, sliding_window=48)
    groups = storable_groups(_config(full, sliding), MODEL)
    assert [(g.index, g.window, g.layers) for g in groups] == [(0, None, "0,10"), (1, 48, "1,11")]
    # A hit of 192 tokens: the next token sees 145..192, in blocks 4 and 5 of 32 tokens.
    assert groups[1].first_needed_block(192) == (192 - 48 + 1) // 32 == 4
    assert groups[1].first_needed_block(40) == 0
    # A prompt of 197 tokens: its hit ends at 192 (one token short), so blocks 4 on are kept.
    assert first_saved_block(groups[1], 197) == 4
    # 193 tokens: the same prompt's hit ends at 192 too; 192 tokens: at 160, blocks 3 on.
    assert first_saved_block(groups[1], 193) == 4
    assert first_saved_block(groups[1], 192) == 3
    assert first_saved_block(groups[0], 197) == 0
    (single,) = storable_groups(_config(sliding), MODEL)
    assert single.window == 48 and single.layers == ""


def test_a_hit_ends_only_where_every_window_is_held() -> None:
    groups = storable_groups(
        _config(FullAttentionSpec(**SHAPE), SlidingWindowSpec(**SHAPE, sliding_window=48)), MODEL
    )
    held = {4, 5}  # the sliding group's blocks on the tier, as a prompt of 197 tokens leaves
    asked: list[tuple[int, int, int]] = []

    def holds(group: int, start: int, end: int) -> bool:
        asked.append((group, start, end))
        return all(b in held for b in range(start, end))

    assert restorable_end(groups, 0, 6, holds) == 6  # blocks 4 and 5 hold the window of 192
    assert asked == [(1, 4, 6)]  # the full group is not asked: full_end is its hit
    # Ending at block 5 needs block 3, which no hit of that prompt needed, so it is not held.
    assert restorable_end(groups, 0, 5, holds) == 0
    held.add(3)
    assert restorable_end(groups, 0, 5, holds) == 5
    # vLLM's own hit of 5 blocks leaves only block 5 to the tier.
    assert restorable_end(groups, 5, 6, holds) == 6


@pytest.mark.parametrize(
    ("specs", "words"),
    [
        ((_mamba(),), ["MambaSpec layers (recurrent state", "does not store recurrent state"]),
        # A hybrid model as the hybrid KV cache manager would group it: the recurrent group
        # is named, not only the count.
        ((_mamba(), FullAttentionSpec(**SHAPE)), ["MambaSpec layers (recurrent state"]),
        ((FullAttentionSpec(**SHAPE), _mamba()), ["MambaSpec layers (recurrent state"]),
        (
            (SlidingWindowSpec(**SHAPE, sliding_window=48, extra_retained_tokens=8),),
            ["SlidingWindowSpec layers retaining 8 tokens past the window"],
        ),
        (
            (ChunkedLocalAttentionSpec(**SHAPE, attention_chunk_size=64),),
            ["ChunkedLocalAttentionSpec layers"],
        ),
        ((CrossAttentionSpec(**SHAPE),), ["CrossAttentionSpec layers", "encoder"]),
        ((SinkFullAttentionSpec(**SHAPE, sink_len=4),), ["SinkFullAttentionSpec layers"]),
        ((FullAttentionSpec(**SHAPE, non_causal=True),), ["non-causal FullAttentionSpec"]),
        ((FullAttentionSpec(**SHAPE, head_size_v=32),), ["value size 32 != key size 64"]),
        (
            (
                UniformTypeKVCacheSpecs(
                    block_size=32,
                    kv_cache_specs={
                        "a": FullAttentionSpec(**SHAPE),
                        "b": FullAttentionSpec(**{**SHAPE, "head_size": 128}),
                    },
                ),
            ),
            ["UniformTypeKVCacheSpecs layers", "different KV shapes"],
        ),
        (
            (FullAttentionSpec(**SHAPE), FullAttentionSpec(**{**SHAPE, "block_size": 16})),
            ["block sizes [16, 32]"],
        ),
        ((), ["no KV cache (attention-free)"]),
    ],
    ids=[
        "mamba",
        "mamba-then-full",
        "full-then-mamba",
        "sliding-retaining",
        "chunked-only",
        "cross",
        "sink",
        "non-causal",
        "value-size",
        "mixed-shapes",
        "two-block-sizes",
        "attention-free",
    ],
)
def test_anything_else_is_refused_by_name(specs: tuple[KVCacheSpec, ...], words: list[str]) -> None:
    with pytest.raises(ValueError) as caught:
        storable_groups(_config(*specs), MODEL)
    message = str(caught.value)
    for word in [*words, MODEL, "serve this model without the cachetier connector"]:
        assert word in message, message
