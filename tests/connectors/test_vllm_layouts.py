"""vLLM's KV layouts, taken from the installed vLLM: pages built by vLLM's own allocator for
every ``KVCacheLayout``, read through ``cachetier.connectors.vllm.layouts`` into canonical blocks.

What a page's cells hold is each backend's reading of them; the tests below check that reading
against vLLM's backend source, so a vLLM release that changes a layout or a reading fails here
instead of serving wrong KV.
"""

from __future__ import annotations

import importlib.util
import inspect
import re
from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm")

from vllm.v1.kv_cache_interface import (  # noqa: E402
    FullAttentionSpec,
    KVCacheTensor,
    MLAAttentionSpec,
    compute_layout_strides,
    create_kv_cache_views,
)
from vllm.v1.kv_cache_layout import KVCacheLayout  # noqa: E402

from cachetier.connectors.vllm.layouts import CPU_VEC, CUDA_KV, MLA, resolve  # noqa: E402
from cachetier.connectors.vllm.paged import PagedKV  # noqa: E402
from cachetier.primitives.kv_format import CANONICAL_ARRANGEMENT, MLA_ARRANGEMENT  # noqa: E402

pytestmark = pytest.mark.vllm

L, NB, BS, H, D, LATENT = 3, 5, 16, 2, 8, 24


def _pages(spec, layout: KVCacheLayout) -> dict[str, torch.Tensor]:
    """Per-layer views over one allocation, exactly as vLLM's worker builds them."""
    names = [f"model.layers.{i}.self_attn.attn" for i in range(L)]
    layer_stride, block_stride, *_ = compute_layout_strides(spec, NB, L, layout)
    size = NB * L * spec.page_size_bytes
    raw = torch.zeros(size, dtype=torch.int8)
    tensor = KVCacheTensor(
        size=size, layers=names, layer_stride=layer_stride, block_stride=block_stride
    )
    views = create_kv_cache_views(raw, spec, NB, layout, tensor)
    return dict(zip(names, views))


def _source(module: str) -> str:
    found = importlib.util.find_spec(module)
    assert found is not None and found.origin, module
    return re.sub(r"\s+", "", Path(found.origin).read_text())


@pytest.mark.parametrize("layout", list(KVCacheLayout), ids=lambda x: x.name)
def test_cuda_attention_pages_read_as_canonical_blocks(layout: KVCacheLayout) -> None:
    spec = FullAttentionSpec(block_size=BS, num_kv_heads=H, head_size=D, dtype=torch.float32)
    pages = _pages(spec, layout)
    gen = torch.Generator().manual_seed(1)
    blocks = torch.randn(NB, L, 2, BS, H, D, generator=gen)
    for layer, page in enumerate(pages.values()):
        assert tuple(page.shape) == (NB, H, BS, 2 * D)
        # The backends' own reading: kv_cache.transpose(1, 2).split(head_size, dim=-1).
        key, value = page.transpose(1, 2).split(D, dim=-1)
        key.copy_(blocks[:, layer, 0])
        value.copy_(blocks[:, layer, 1])
    arrangement = resolve(
        device_type="cuda",
        is_mla=False,
        dtype=torch.float32,
        block_size=BS,
        num_layers=L,
        num_kv_heads=H,
        head_size=D,
    )
    assert arrangement.kind == CUDA_KV
    assert arrangement.layout.arrangement == CANONICAL_ARRANGEMENT
    paged = PagedKV(pages, list(pages), arrangement)
    got = paged.gather([3, 0, 4])
    for payload, block in zip(got, (3, 0, 4)):
        assert torch.equal(payload, blocks[block])
    # And back: a payload written into block 1 reads as itself.
    paged.write([1], [got[0].numpy().tobytes()])
    assert torch.equal(paged.gather([1])[0], blocks[3])


@pytest.mark.parametrize("layout", list(KVCacheLayout), ids=lambda x: x.name)
def test_mla_pages_read_as_one_latent_plane(layout: KVCacheLayout) -> None:
    spec = MLAAttentionSpec(block_size=BS, num_kv_heads=1, head_size=LATENT, dtype=torch.float32)
    pages = _pages(spec, layout)
    gen = torch.Generator().manual_seed(2)
    latents = torch.randn(NB, L, BS, LATENT, generator=gen)
    for layer, page in enumerate(pages.values()):
        assert tuple(page.shape) == (NB, 1, BS, LATENT)
        page[:, 0].copy_(latents[:, layer])
    arrangement = resolve(
        device_type="cuda",
        is_mla=True,
        dtype=torch.float32,
        block_size=BS,
        num_layers=L,
        num_kv_heads=1,
        head_size=LATENT,
    )
    assert arrangement.kind == MLA and arrangement.layout.arrangement == MLA_ARRANGEMENT
    (payload,) = PagedKV(pages, list(pages), arrangement).gather([2])
    assert tuple(payload.shape) == (L, 1, BS, 1, LATENT)
    assert torch.equal(payload[:, 0, :, 0], latents[2])


def test_backends_read_pages_the_way_the_adapters_do() -> None:
    """A vLLM release that reads its pages differently fails here (source of the backends)."""
    kv_split = "kv_cache.transpose(1,2).split(self.head_size,dim=-1)"
    for module in (
        "vllm.v1.attention.backends.flash_attn",
        "vllm.v1.attention.backends.triton_attn",
        "vllm.v1.attention.backends.flashinfer",
    ):
        assert kv_split in _source(module), module
    cpu = _source("vllm.v1.attention.backends.cpu_attn")
    assert "kv_cache.view((num_blocks,num_kv_heads,block_size*2,-1))" in cpu
    assert "key_cache,value_cache=kv_cache.chunk(2,dim=2)" in cpu
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    assert CPUAttentionBackend.supported_kv_cache_layouts() == (KVCacheLayout.LBHNC,)
    # The logical page every backend gets: [blocks, heads, tokens, K then V content].
    from vllm.v1.kv_cache_interface import compute_layer_kv_cache_shape_bytes

    spec = FullAttentionSpec(block_size=BS, num_kv_heads=H, head_size=D, dtype=torch.float16)
    assert compute_layer_kv_cache_shape_bytes(spec, NB) == (NB, H, BS, 2 * D * 2)
    assert "(self.head_size+self.head_size_v)*get_dtype_size(self.dtype)" in "".join(
        inspect.getsource(type(spec).state_content_size_bytes.fget).split()
    )


def test_cpu_isa_picks_the_arrangement() -> None:
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    args = dict(is_mla=False, block_size=32, num_layers=L, num_kv_heads=H, head_size=64)
    arrangement = resolve(device_type="cpu", dtype=torch.float32, **args)
    isa = _get_attn_isa(torch.float32, 32, 64, "auto")
    if isa == "vec":
        assert arrangement.kind == CPU_VEC
        assert arrangement.layout.arrangement == CANONICAL_ARRANGEMENT
    else:  # an ISA whose packing is not known here: stored whole, never as canonical
        assert arrangement.layout.arrangement == f"native:vllm-cpu-{isa}"
    # head_size 48 runs the "vec16" kernels, whose K packing is not known: native blocks.
    native = resolve(device_type="cpu", dtype=torch.float32, **{**args, "head_size": 48})
    assert native.layout.arrangement == "native:vllm-cpu-vec16"
    assert native.layout.payload_shape == (L, 1, 32, H, 96)
    with pytest.raises(ValueError, match="MLA KV on cpu"):
        resolve(device_type="cpu", dtype=torch.float32, **{**args, "is_mla": True})
    with pytest.raises(ValueError, match="tpu"):
        resolve(device_type="tpu", dtype=torch.float32, **args)


def test_native_pages_round_trip_whole() -> None:
    native = resolve(
        device_type="cpu",
        is_mla=False,
        dtype=torch.float32,
        block_size=32,
        num_layers=L,
        num_kv_heads=H,
        head_size=48,
    )
    gen = torch.Generator().manual_seed(3)
    pages = {f"l{i}": torch.randn(NB, H, 32, 96, generator=gen) for i in range(L)}
    paged = PagedKV(pages, list(pages), native)
    (payload,) = paged.gather([4])
    paged.write([0], [payload.numpy().tobytes()])
    for page in pages.values():
        assert torch.equal(page[0], page[4])


def test_fp8_records_carry_the_layers_scales() -> None:
    """vLLM keeps one K and one V scale per attention layer; every record carries them."""
    from types import SimpleNamespace

    import numpy as np

    from cachetier.connectors.vllm.layouts import fp8_scales
    from cachetier.primitives.keys import KVLayout

    names = ["a", "b"]
    layers = {
        "a": SimpleNamespace(_k_scale_float=0.5, _v_scale_float=2.0),
        "b": SimpleNamespace(_k_scale_float=1.0, _v_scale_float=0.25),
    }
    config = SimpleNamespace(compilation_config=SimpleNamespace(static_forward_context=layers))
    fp8 = KVLayout("float8_e4m3fn", 32, 2, 1, 64)
    scales = np.frombuffer(fp8_scales(config, names, fp8), "<f4").reshape(2, 2)
    assert scales.tolist() == [[0.5, 2.0], [1.0, 0.25]]
    mla = KVLayout("float8_e4m3fn", 32, 2, 1, 64, arrangement=MLA_ARRANGEMENT)
    assert np.frombuffer(fp8_scales(config, names, mla), "<f4").tolist() == [0.5, 1.0]
    assert fp8_scales(config, names, KVLayout("float32", 32, 2, 1, 64)) == b""
