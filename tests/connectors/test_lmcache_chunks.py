"""LMCache's chunk tensors to and from canonical payloads (no LMCache needed: the conversion is
plain torch; ``test_lmcache_plugin`` runs it inside LMCache's own ``StorageManager``)."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from cachetier.connectors.lmcache.chunks import ChunkFormat
from cachetier.primitives.keys import KVLayout
from cachetier.primitives.kv_format import MLA_ARRANGEMENT
from cachetier.util.landing import copy_pairs

KV_2LTD, KV_MLA = "KV_2LTD", "KV_MLA_FMT"  # stand-ins for LMCache's MemoryFormat members
LAYERS, TOKENS, HEADS, DIM = 3, 8, 2, 4


def mha_format() -> ChunkFormat:
    layout = KVLayout("float16", TOKENS, LAYERS, HEADS, DIM)
    shape = torch.Size([2, LAYERS, TOKENS, HEADS * DIM])
    return ChunkFormat(layout, KV_2LTD, shape, torch.float16)


def chunk(tensor: torch.Tensor, fmt: str = KV_2LTD) -> SimpleNamespace:
    return SimpleNamespace(tensor=tensor, metadata=SimpleNamespace(fmt=fmt))


def test_kv_2ltd_becomes_layer_major_k_then_v() -> None:
    fmt = mha_format()
    kv = torch.randn(fmt.obj_shape).to(torch.float16)
    payload = fmt.to_canonical(chunk(kv))
    assert payload is not None and payload.shape == fmt.layout.payload_shape
    for layer in range(LAYERS):
        for plane in range(2):
            want = kv[plane, layer].view(TOKENS, HEADS, DIM)
            assert torch.equal(payload[layer, plane], want)


def test_runs_land_a_canonical_payload_back_in_lmcache_order() -> None:
    fmt = mha_format()
    kv = torch.randn(fmt.obj_shape).to(torch.float16)
    payload = fmt.to_canonical(chunk(kv))
    assert payload is not None
    kv_before = kv.clone()
    kv.zero_()  # the payload is a copy: LMCache reuses its object after a put
    back = chunk(torch.empty(fmt.obj_shape, dtype=torch.float16))
    flat_payload = memoryview(payload.view(torch.uint8).reshape(-1).numpy())
    for to, src in copy_pairs(fmt.runs(back), flat_payload):  # as a tier lands a record
        to[:] = src
    assert torch.equal(back.tensor, kv_before)


def test_a_partial_chunk_or_another_format_is_not_converted() -> None:
    fmt = mha_format()
    short = torch.zeros(2, LAYERS, TOKENS - 1, HEADS * DIM, dtype=torch.float16)
    assert fmt.to_canonical(chunk(short)) is None
    full = torch.zeros(fmt.obj_shape, dtype=torch.float16)
    assert fmt.to_canonical(chunk(full, KV_MLA)) is None
    assert fmt.to_canonical(chunk(full.float())) is None
    assert fmt.to_canonical(SimpleNamespace(metadata=SimpleNamespace(fmt=KV_2LTD))) is None


def test_mla_latent_is_one_plane_of_one_head() -> None:
    latent = HEADS * DIM
    layout = KVLayout("bfloat16", TOKENS, LAYERS, 1, latent, MLA_ARRANGEMENT)
    fmt = ChunkFormat(layout, KV_MLA, torch.Size([1, LAYERS, TOKENS, latent]), torch.bfloat16)
    kv = torch.randn(fmt.obj_shape).to(torch.bfloat16)
    payload = fmt.to_canonical(chunk(kv, KV_MLA))
    assert payload is not None and payload.shape == (LAYERS, 1, TOKENS, 1, latent)
    assert torch.equal(payload[:, 0, :, 0], kv[0])
    runs = fmt.runs(chunk(kv, KV_MLA))  # one plane: LMCache's order is the canonical one
    assert list(runs.offsets) == list(range(0, runs.nbytes, runs.run_bytes))
