"""The compiled CPU prefill attention (cachetier.kernels.native_prefill_attention) against the
float64
reference, on every shape it is built for, and its refusals where it is not."""

import pytest
import torch

from cachetier.kernels.native_prefill_attention import (
    PrefillChunk,
    native_prefill_kernel,
    paged_prefill_attention,
    paged_prefill_attention_ref,
    plan_prefill,
)


def test_the_kernel_builds_here():
    # The README asks for a C++ compiler; a machine that has one must not fall back silently.
    assert native_prefill_kernel() is not None


def _step(
    gen: torch.Generator,
    *,
    block_size: int,
    num_kv_heads: int,
    group: int,
    head_dim: int,
    shared_tokens: int,
    chunks: list[tuple[int, int]],
) -> tuple[torch.Tensor, torch.Tensor, list[PrefillChunk]]:
    """A two-layer pool whose unused slots are NaN, a shared prefix of ``shared_tokens`` in
    blocks of its own, and one chunk per ``(cached_own, num_new)``: its context is the shared
    prefix (when ``cached_own`` >= 0; none when it is -1), ``cached_own`` more cached tokens and
    the new ones. Returns queries ``[T, heads, dim]`` as a strided view, the pool, the chunks."""
    shared_blocks = -(-shared_tokens // block_size)
    lengths = [(shared_tokens if own >= 0 else 0) + max(own, 0) + new for own, new in chunks]
    num_blocks = 1 + shared_blocks + sum(-(-n // block_size) for n in lengths)
    pool = torch.full((num_blocks, 2, 2, block_size, num_kv_heads, head_dim), float("nan"))
    order = torch.randperm(num_blocks - 1, generator=gen) + 1  # block 0 never used
    shared = order[:shared_blocks]
    next_free = shared_blocks
    for i in range(shared_tokens):
        pool[shared[i // block_size], :, :, i % block_size] = torch.randn(
            2, 2, num_kv_heads, head_dim, generator=gen
        )
    out: list[PrefillChunk] = []
    start = 0
    for (own, new), length in zip(chunks, lengths):
        prefix = shared_tokens if own >= 0 else 0
        own_blocks = -(-length // block_size) - prefix // block_size
        own_ids = order[next_free : next_free + own_blocks]
        table = torch.cat([shared[: prefix // block_size], own_ids])
        next_free += own_blocks
        # Only whole blocks are shared: the prefix's partial last block is the chunk's own copy.
        for pos in range(prefix // block_size * block_size, length):
            pool[table[pos // block_size], :, :, pos % block_size] = torch.randn(
                2, 2, num_kv_heads, head_dim, generator=gen
            )
        out.append(PrefillChunk(start, new, length, table))
        start += new
    heads = num_kv_heads * group
    # As the engine passes it: the query part of a fused QKV row.
    qkv = torch.randn(start, heads + 2 * num_kv_heads, head_dim, generator=gen)
    return qkv[:, :heads], pool, out


def _assert_matches_reference(
    gen: torch.Generator,
    block_size: int,
    group: int,
    head_dim: int,
    shared_tokens: int,
    chunks: list[tuple[int, int]],
) -> None:
    """Runs the kernel on a ``_step`` of two KV heads and checks it against the reference."""
    q, pool, plan_chunks = _step(
        gen,
        block_size=block_size,
        num_kv_heads=2,
        group=group,
        head_dim=head_dim,
        shared_tokens=shared_tokens,
        chunks=chunks,
    )
    plan = plan_prefill(plan_chunks, block_size, len(pool))
    assert plan is not None
    out = torch.full(q.shape, 7.0)

    assert paged_prefill_attention(q, pool, 1, plan, head_dim**-0.5, out)

    expected = paged_prefill_attention_ref(q, pool, 1, plan_chunks, head_dim**-0.5)
    assert not out.isnan().any(), "a stale pool slot reached the output"
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=2e-6)


CASES = [
    # (cached own tokens or -1 for no shared prefix, new tokens)
    [(0, 100)],
    [(-1, 70)],
    [(0, 1), (5, 3), (-1, 2)],
    [(0, 64), (17, 130), (40, 7), (-1, 33)],
]


@pytest.mark.parametrize("chunks", CASES)
@pytest.mark.parametrize("group", [1, 3])
@pytest.mark.parametrize("block_size", [16, 48])  # one unit a block, three
@pytest.mark.parametrize("head_dim", [64, 128])
def test_matches_the_reference(gen, chunks, group, block_size, head_dim):
    # The shared prefix ends inside a block.
    _assert_matches_reference(gen, block_size, group, head_dim, 3 * block_size + 5, chunks)


@pytest.mark.parametrize("chunks", [[(20, 5)], [(0, 15), (300, 2)], [(700, 1)]])
@pytest.mark.parametrize("group", [1, 3])
@pytest.mark.parametrize("block_size", [16, 48])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_a_few_rows_over_a_long_context_split_its_keys(gen, chunks, group, block_size, head_dim):
    # Only narrow chunks (every row of a KV head in one task) over 1,000+ keys: the kernel
    # splits each chunk's keys between tasks that read the pool in place, then merges them.
    # 1,000 shared tokens are not a multiple of any tile: the splits end inside units.
    _assert_matches_reference(gen, block_size, group, head_dim, 1000, chunks)


def test_rows_outside_the_plan_are_left_alone(gen):
    q, pool, chunks = _step(
        gen,
        block_size=16,
        num_kv_heads=1,
        group=2,
        head_dim=64,
        shared_tokens=20,
        chunks=[(0, 9), (3, 12)],
    )
    plan = plan_prefill(chunks[1:], 16, len(pool))  # only the second chunk
    out = torch.full(q.shape, 7.0)

    assert paged_prefill_attention(q, pool, 0, plan, 0.125, out)

    assert torch.equal(out[:9], torch.full_like(out[:9], 7.0))
    expected = paged_prefill_attention_ref(q, pool, 0, chunks[1:], 0.125)
    torch.testing.assert_close(out[9:].double(), expected[9:], rtol=1e-5, atol=2e-6)


def test_a_prefix_shared_by_chunks_is_packed_once(gen):
    _, pool, chunks = _step(
        gen,
        block_size=32,
        num_kv_heads=1,
        group=1,
        head_dim=64,
        shared_tokens=96,
        chunks=[(0, 40), (10, 40), (0, 1)],
    )
    plan = plan_prefill(chunks, 32, len(pool))

    # 96 shared tokens are 6 units of 16; each chunk adds its own after them.
    own_units = [-(-(c.context_len - 96) // 16) for c in chunks]
    assert plan is not None and len(plan.unit_ids) == 6 + sum(own_units)
    assert len(set(plan.unit_ids.tolist())) == len(plan.unit_ids)
    assert torch.equal(plan.seq_units[0, :6], plan.seq_units[1, :6])
    # A unit's valid count is the most any chunk reads of it: the last unit of chunk 2 holds 1.
    last = plan.seq_units[2, own_units[2] + 5]
    assert plan.unit_valid[last] == 1


def test_plan_refuses_what_the_kernel_cannot_read():
    chunk = PrefillChunk(0, 4, 4, torch.zeros(1, dtype=torch.long))
    assert plan_prefill([chunk], 8, 4) is None  # block size not a multiple of 16
    assert plan_prefill([], 16, 4) is None


@pytest.mark.parametrize(
    "change",
    ["bfloat16 query", "bfloat16 pool", "head_dim 32"],
)
def test_unsupported_inputs_return_false_and_leave_out_alone(gen, change):
    head_dim = 32 if change == "head_dim 32" else 64
    q, pool, chunks = _step(
        gen,
        block_size=16,
        num_kv_heads=1,
        group=2,
        head_dim=head_dim,
        shared_tokens=0,
        chunks=[(0, 20)],
    )
    plan = plan_prefill(chunks, 16, len(pool))
    assert plan is not None
    if change == "bfloat16 query":
        q = q.bfloat16()
    if change == "bfloat16 pool":
        pool = pool.bfloat16()
    out = torch.full(q.shape, 7.0)

    assert not paged_prefill_attention(q, pool, 0, plan, 0.125, out)

    assert torch.equal(out, torch.full_like(out, 7.0))


@pytest.mark.parametrize(
    ("chunk", "why"),
    [
        (PrefillChunk(0, 4, 20, torch.tensor([1, 99])), "outside the pool"),
        (PrefillChunk(0, 4, 20, torch.tensor([1, -1])), "outside the pool"),
        (PrefillChunk(0, 4, 20, torch.tensor([1])), "needs 2"),
        (PrefillChunk(0, 0, 20, torch.tensor([1, 2])), "num_new"),
        (PrefillChunk(0, 21, 20, torch.tensor([1, 2])), "num_new"),
        (PrefillChunk(-1, 4, 20, torch.tensor([1, 2])), "start"),
    ],
)
def test_a_plan_that_would_read_outside_the_pool_is_refused(chunk, why):
    # The kernel reads the pool through these ids unchecked: the plan is where they are checked.
    with pytest.raises(ValueError, match=why):
        plan_prefill([chunk], 16, 8)


@pytest.mark.parametrize("change", ["rows", "pool", "layer", "head_dim", "heads", "out"])
def test_tensors_that_do_not_fit_the_plan_or_the_pool_are_refused(gen, change):
    q, pool, chunks = _step(
        gen,
        block_size=16,
        num_kv_heads=2,
        group=2,
        head_dim=64,
        shared_tokens=20,
        chunks=[(0, 9)],
    )
    plan = plan_prefill(chunks, 16, len(pool))
    assert plan is not None
    layer, out = 0, torch.zeros(q.shape)
    if change == "rows":
        q, out = q[:5], out[:5]  # the plan covers 9 rows
    if change == "pool":
        pool = pool[:-1].contiguous()  # another pool than the plan's
    if change == "layer":
        layer = 2
    if change == "head_dim":
        q, out = q[..., :32], out[..., :32]
    if change == "heads":
        q, out = q[:, :3], out[:, :3]  # 3 query heads over 2 KV heads
    if change == "out":
        out = out[:, :2]

    with pytest.raises(ValueError):
        paged_prefill_attention(q, pool, layer, plan, 0.125, out)
