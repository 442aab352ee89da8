"""Which KV cache configs the vLLM connector stores (``connectors.vllm.kv_groups``), built from
vLLM's own spec classes: one group that keeps every token's KV passes, anything else is refused
with a message that names it."""

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

from cachetier.connectors.vllm.kv_groups import storable_spec  # noqa: E402

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
    assert storable_spec(_config(spec), MODEL) is spec


@pytest.mark.parametrize(
    ("specs", "words"),
    [
        ((_mamba(),), ["MambaSpec layers (recurrent state", "does not store recurrent state"]),
        # A hybrid model as the hybrid KV cache manager would group it: the recurrent group
        # is named, not only the count.
        ((_mamba(), FullAttentionSpec(**SHAPE)), ["MambaSpec layers (recurrent state"]),
        ((FullAttentionSpec(**SHAPE), _mamba()), ["MambaSpec layers (recurrent state"]),
        (
            (SlidingWindowSpec(**SHAPE, sliding_window=48),),
            ["SlidingWindowSpec layers", "frees their blocks outside the window"],
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
            (FullAttentionSpec(**SHAPE), FullAttentionSpec(**SHAPE, sliding_window=48)),
            ["2 KV cache groups (FullAttentionSpec, FullAttentionSpec)", "one group"],
        ),
        ((), ["no KV cache (attention-free)"]),
    ],
    ids=[
        "mamba",
        "mamba-then-full",
        "full-then-mamba",
        "sliding-only",
        "chunked-only",
        "cross",
        "sink",
        "non-causal",
        "value-size",
        "mixed-shapes",
        "two-groups",
        "attention-free",
    ],
)
def test_anything_else_is_refused_by_name(specs: tuple[KVCacheSpec, ...], words: list[str]) -> None:
    with pytest.raises(ValueError) as caught:
        storable_spec(_config(*specs), MODEL)
    message = str(caught.value)
    for word in [*words, MODEL, "serve this model without the cachetier connector"]:
        assert word in message, message
