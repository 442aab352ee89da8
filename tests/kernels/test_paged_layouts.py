"""PagedBlocks over every engine arrangement: gathers give canonical payloads, scatters put them
back, and the Triton kernel (interpreted here) copies exactly what the torch loop copies.

The oracle is independent of ``axes_view``: each case writes its engine memory element by
element from known canonical blocks, with the engine's own indexing written out by hand.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch

from cachetier.kernels.paged_layouts import PagedBlocks, axes_view

L, BS, H, D, NB = 3, 4, 2, 8, 6


@dataclass(frozen=True)
class Case:
    name: str
    planes: int
    heads: int
    # Makes the engine's tensors (one, or one per layer), their axes, and a function that
    # stores canonical block ``b`` (``[L, planes, BS, heads, D]``) into them the engine's way.
    make: Callable[[], tuple[list[torch.Tensor], tuple[str, ...], Callable]]


def _engine_pool():
    pool = torch.zeros(NB, L, 2, BS, H, D)

    def put(b, block):
        pool[b] = block

    return [pool], ("block", "layer", "kv", "token", "head", "dim"), put


def _k_transposed():
    # K and V laid out differently (as vLLM-CPU's "vec" kernels do): per block and head,
    # K as [D, BS] (token innermost), then V as [BS, D].
    layers = [torch.zeros(NB, H, 2, BS * D) for _ in range(L)]

    def put(b, block):
        for layer in range(L):
            for t in range(BS):
                for h in range(H):
                    for d in range(D):
                        layers[layer][b, h, 0, d * BS + t] = block[layer, 0, t, h, d]
                    layers[layer][b, h, 1, t * D : (t + 1) * D] = block[layer, 1, t, h]

    return layers, None, put


def _flash(hnd: bool):
    # (2, num_blocks, block_size, heads, D); HND allocates heads before tokens physically.
    if hnd:
        layers = [torch.zeros(2, NB, H, BS, D).permute(0, 1, 3, 2, 4) for _ in range(L)]
    else:
        layers = [torch.zeros(2, NB, BS, H, D) for _ in range(L)]

    def put(b, block):
        for layer in range(L):
            for kv in range(2):
                for t in range(BS):
                    layers[layer][kv, b, t] = block[layer, kv, t]

    return layers, ("kv", "block", "token", "head", "dim"), put


def _flashinfer():
    layers = [torch.zeros(NB, 2, BS, H, D) for _ in range(L)]

    def put(b, block):
        for layer in range(L):
            layers[layer][b] = block[layer]

    return layers, ("block", "kv", "token", "head", "dim"), put


def _mla():
    layers = [torch.zeros(NB, BS, D) for _ in range(L)]

    def put(b, block):
        for layer in range(L):
            for t in range(BS):
                layers[layer][b, t] = block[layer, 0, t, 0]

    return layers, ("block", "token", "dim"), put


def _token_slots():
    # A pool indexed by token slot (block * BS + token), layers inside: [2, slots, L, H, D].
    buf = torch.zeros(2, NB * BS, L, H, D)

    def put(b, block):
        for layer in range(L):
            for kv in range(2):
                buf[kv, b * BS : (b + 1) * BS, layer] = block[layer, kv]

    return [buf], ("kv", "slot", "layer", "head", "dim"), put


CASES = [
    Case("engine-pool", 2, H, _engine_pool),
    Case("k-transposed", 2, H, _k_transposed),
    Case("flash-nhd", 2, H, lambda: _flash(False)),
    Case("flash-hnd", 2, H, lambda: _flash(True)),
    Case("flashinfer", 2, H, _flashinfer),
    Case("mla", 1, 1, _mla),
    Case("token-slots", 2, H, _token_slots),
]


def _paged(case: Case) -> tuple[PagedBlocks, Callable, list[torch.Tensor]]:
    tensors, axes, put = case.make()
    if axes is None:  # K [D, BS] and V [BS, D] per head: one part per plane
        views = [
            [
                axes_view(
                    t[:, :, 0].unflatten(2, (D, BS)),
                    ("block", "head", "dim", "token"),
                    block_size=BS,
                ),
                axes_view(
                    t[:, :, 1].unflatten(2, (BS, D)),
                    ("block", "head", "token", "dim"),
                    block_size=BS,
                ),
            ]
            for t in tensors
        ]
    elif "layer" in axes:
        views = [[axes_view(tensors[0], axes, block_size=BS, layer=layer)] for layer in range(L)]
    else:
        views = [[axes_view(t, axes, block_size=BS)] for t in tensors]
    return PagedBlocks(views), put, tensors


def _blocks(case: Case, n: int, gen: torch.Generator) -> torch.Tensor:
    return torch.randn(n, L, case.planes, BS, case.heads, D, generator=gen)


def _filled(
    case: Case, gen: torch.Generator
) -> tuple[PagedBlocks, Callable, list[torch.Tensor], torch.Tensor]:
    """The case's engine memory holding ``NB`` random canonical blocks, written the engine's way."""
    paged, put, tensors = _paged(case)
    blocks = _blocks(case, NB, gen)
    for b in range(NB):
        put(b, blocks[b])
    return paged, put, tensors, blocks


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_gather_returns_the_canonical_blocks(case: Case, gen: torch.Generator) -> None:
    paged, _, _, blocks = _filled(case, gen)
    ids = torch.tensor([4, 1, 1, 5])
    out = torch.empty(len(ids), *paged.geometry.payload_shape)
    paged.gather(ids, out, backend="torch")
    torch.testing.assert_close(out, blocks[ids], rtol=0, atol=0)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_scatter_writes_what_the_engine_reads_back(case: Case, gen: torch.Generator) -> None:
    paged, put, tensors, blocks = _filled(case, gen)
    expected = [t.clone() for t in tensors]
    new = _blocks(case, 2, gen)
    # The oracle writes the same two blocks through the engine's own indexing.
    saved = [t.clone() for t in tensors]
    put(3, new[0])
    put(0, new[1])
    expected = [t.clone() for t in tensors]
    for t, s in zip(tensors, saved):
        t.copy_(s)
    paged.scatter(torch.tensor([3, 0]), new, backend="torch")
    for t, e in zip(tensors, expected):
        torch.testing.assert_close(t, e, rtol=0, atol=0)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_triton_copies_what_torch_copies(case: Case, gen: torch.Generator) -> None:
    paged, put, tensors, blocks = _filled(case, gen)
    ids = torch.tensor([2, 5, 0])
    out = torch.empty(len(ids), *paged.geometry.payload_shape)
    paged.gather(ids, out, backend="triton")
    torch.testing.assert_close(out, blocks[ids], rtol=0, atol=0)

    reference = [t.clone() for t in tensors]
    new = _blocks(case, 2, gen)
    ref_paged, _, ref_tensors = _paged(case)
    for r, t in zip(ref_tensors, tensors):
        r.copy_(t)
    ref_paged.scatter(torch.tensor([1, 4]), new, backend="torch")
    paged.scatter(torch.tensor([1, 4]), new, backend="triton")
    for t, r in zip(tensors, ref_tensors):
        torch.testing.assert_close(t, r, rtol=0, atol=0)
    assert any(not torch.equal(t, r) for t, r in zip(tensors, reference))


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_per_block_payloads_copy_what_batches_copy(case: Case, gen: torch.Generator) -> None:
    paged, put, tensors, blocks = _filled(case, gen)
    outs = [torch.empty(paged.geometry.payload_shape) for _ in range(3)]
    paged.gather_each([5, 0, 5], outs)
    for out, b in zip(outs, (5, 0, 5)):
        torch.testing.assert_close(out, blocks[b], rtol=0, atol=0)
    paged.scatter_each([1, 2], [outs[0], outs[1]])
    check = torch.empty(2, *paged.geometry.payload_shape)
    paged.gather(torch.tensor([1, 2]), check)
    torch.testing.assert_close(check, blocks[[5, 0]], rtol=0, atol=0)
    with pytest.raises(ValueError, match="distinct"):
        paged.scatter_each([1, 1], [outs[0], outs[1]])
    with pytest.raises(ValueError, match="block ids"):
        paged.gather_each([NB], [outs[0]])
    with pytest.raises(ValueError, match="expected contiguous"):
        paged.gather_each([0], [torch.empty(3)])


def test_axes_view_shares_memory_and_refuses_bad_axes() -> None:
    pool = torch.zeros(NB, L, 2, BS, H, D)
    axes = ("block", "layer", "kv", "token", "head", "dim")
    view = axes_view(pool, axes, block_size=BS, layer=1)
    view[2, 1, 3, 0, 5] = 7.0
    assert pool[2, 1, 1, 3, 0, 5] == 7.0
    with pytest.raises(ValueError, match="name each"):
        axes_view(pool, axes[:-1], block_size=BS, layer=0)
    with pytest.raises(ValueError, match="name each"):
        axes_view(pool, ("block", "layer", "kv", "token", "head", "head"), block_size=BS, layer=0)
    with pytest.raises(ValueError, match="layer must be"):
        axes_view(pool, axes, block_size=BS, layer=L)
    with pytest.raises(ValueError, match="not 5"):
        axes_view(pool, axes, block_size=5, layer=0)
    with pytest.raises(ValueError, match="does not split"):
        axes_view(torch.zeros(2, 10, H, D), ("kv", "slot", "head", "dim"), block_size=BS)
    with pytest.raises(ValueError, match="lack"):
        axes_view(torch.zeros(NB, BS, D), ("token", "head", "dim"), block_size=BS)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn, torch.float16])
def test_every_kv_dtype_copies_bit_for_bit(dtype: torch.dtype) -> None:
    pool = torch.randn(NB, L, 2, BS, H, D).to(dtype)
    axes = ("block", "layer", "kv", "token", "head", "dim")
    paged = PagedBlocks([[axes_view(pool, axes, block_size=BS, layer=i)] for i in range(L)])
    out = torch.empty(2, *paged.geometry.payload_shape, dtype=dtype)
    paged.gather(torch.tensor([4, 2]), out)
    assert torch.equal(out.view(torch.uint8), pool[[4, 2]].view(torch.uint8))
    paged.scatter(torch.tensor([0, 1]), out)
    assert torch.equal(pool[[0, 1]].view(torch.uint8), out.view(torch.uint8))


def test_copies_refuse_wrong_ids_shapes_and_dtypes() -> None:
    paged, _, _ = _paged(CASES[0])
    shape = paged.geometry.payload_shape
    with pytest.raises(ValueError, match="block_ids"):
        paged.gather(torch.tensor([NB]), torch.empty(1, *shape))
    with pytest.raises(ValueError, match="shape"):
        paged.gather(torch.tensor([0]), torch.empty(2, *shape))
    with pytest.raises(ValueError, match="dtype"):
        paged.gather(torch.tensor([0]), torch.empty(1, *shape, dtype=torch.float16))
    with pytest.raises(ValueError, match="distinct"):
        paged.scatter(torch.tensor([1, 1]), torch.empty(2, *shape))
    with pytest.raises(ValueError, match="layer 1"):
        PagedBlocks([[torch.zeros(NB, 2, BS, H, D)], [torch.zeros(NB, 2, BS, H, D + 1)]])
    with pytest.raises(ValueError, match="other planes"):
        PagedBlocks([[torch.zeros(NB, 1, BS, H, D)] * 2, [torch.zeros(NB, 2, BS, H, D)]])


def test_first_copies_from_many_threads_see_every_layer() -> None:
    """The host copy plan is built lazily by whichever thread copies first; threads that
    copy meanwhile (SGLang's prefetch threads) must still copy every layer."""
    import threading

    layers, blocks = 24, 8
    pages = [torch.randn(blocks, 2, 4, 2, 8) for _ in range(layers)]  # separate tensors
    want = torch.stack([torch.stack([p[b] for p in pages]) for b in range(blocks)])
    for _ in range(20):
        paged = PagedBlocks([[p] for p in pages])
        outs = [torch.zeros(paged.geometry.payload_shape) for _ in range(blocks)]
        barrier = threading.Barrier(blocks)

        def copy(
            block: int,
            paged: PagedBlocks = paged,
            outs: list = outs,
            barrier: threading.Barrier = barrier,
        ) -> None:
            barrier.wait()
            paged.gather_each([block], [outs[block]])

        threads = [threading.Thread(target=copy, args=(b,)) for b in range(blocks)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        for block in range(blocks):
            assert torch.equal(outs[block], want[block]), f"block {block} lost layers"


@pytest.mark.parametrize(
    ("case", "launches"),
    [(CASES[0], 1), (CASES[2], 1), (CASES[5], 1), (CASES[1], 2)],
    ids=lambda v: v.name if isinstance(v, Case) else str(v),
)
def test_triton_copies_alike_parts_in_one_launch(
    case: Case, launches: int, gen: torch.Generator, monkeypatch: pytest.MonkeyPatch
) -> None:
    import cachetier.kernels.triton_layout_copy as copies

    # Every layer's parts alike: one launch for all. K and V laid out apart: one for each.
    calls: list[int] = []
    copy_parts = copies.copy_parts

    def counted(parts, *args, **kwargs):
        calls.append(len(parts))
        return copy_parts(parts, *args, **kwargs)

    monkeypatch.setattr(copies, "copy_parts", counted)
    paged, _, _, blocks = _filled(case, gen)
    ids = torch.tensor([4, 1, 4])
    out = torch.empty(len(ids), *paged.geometry.payload_shape)
    paged.gather(ids, out, backend="triton")
    torch.testing.assert_close(out, blocks[ids], rtol=0, atol=0)
    assert len(calls) == launches
    assert sum(calls) == sum(len(parts) for parts in paged.layers)
