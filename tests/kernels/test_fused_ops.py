"""The fused CPU ops (cachetier.kernels.fused_ops) against their torch references and transformers'
math,
and the fallbacks: another backend, non-contiguous inputs, the environment switch."""

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from cachetier.kernels.fused_ops import (
    native_fused_ops,
    rms_norm,
    rms_norm_ref,
    rope_angles,
    rope_store,
    rope_store_ref,
    silu_mul,
    silu_mul_ref,
)

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# fp32: the kernels differ from torch only in a sum's order; the low-precision dtypes by a
# rounding of the storage dtype (the kernel rotates with float32 angles where the reference
# rounds them first), i.e. an ulp of values up to ~4.
TOL = {
    torch.float32: {"rtol": 1e-5, "atol": 1e-5},
    torch.bfloat16: {"rtol": 1.6e-2, "atol": 3.2e-2},
    torch.float16: {"rtol": 2e-3, "atol": 4e-3},
}
ROWS = [1, 7, 33, 300]  # one decode row, fewer than a task's grain, more, a prefill chunk
INV_FREQ = 1.0 / (10000 ** (torch.arange(0, 64, 2).float() / 64))


def test_the_extension_builds_here():
    # The README asks for a C++ compiler; a machine that has one must not fall back silently.
    assert native_fused_ops() is not None


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("with_delta", [False, True])
def test_rms_norm_matches_the_reference_and_adds_delta_in_place(gen, dtype, rows, with_delta):
    x = torch.randn(rows, 576, generator=gen).to(dtype)
    weight = torch.randn(576, generator=gen).to(dtype)
    delta = torch.randn(rows, 576, generator=gen).to(dtype) if with_delta else None
    x_ref = x.clone()

    out = rms_norm(x, weight, 1e-5, delta)
    expected = rms_norm_ref(x_ref, weight, 1e-5, delta)

    torch.testing.assert_close(out, expected, **TOL[dtype])
    # The residual stream after the add is the same tensor values either way.
    torch.testing.assert_close(x, x_ref, rtol=0, atol=0)


def test_rms_norm_is_transformers_math_in_float32(gen):
    x = torch.randn(5, 64, generator=gen)
    weight = torch.randn(64, generator=gen)
    variance = x.pow(2).mean(-1, keepdim=True)
    expected = weight * (x * torch.rsqrt(variance + 1e-6))

    torch.testing.assert_close(rms_norm(x.clone(), weight, 1e-6), expected, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", ROWS)
def test_silu_mul_matches_the_reference(gen, dtype, rows):
    gate_up = (4 * torch.randn(rows, 2 * 96, generator=gen)).to(dtype)

    torch.testing.assert_close(silu_mul(gate_up), silu_mul_ref(gate_up), **TOL[dtype])


def test_silu_mul_at_extreme_gates_stays_finite_and_exact():
    # e^-x overflows for x < -88 and underflows for x > 88: silu must give 0 and x there.
    gate = torch.tensor([[-1000.0, -100.0, -88.0, 0.0, 88.0, 100.0, 1000.0, float("inf")]])
    up = torch.ones_like(gate)

    out = silu_mul(torch.cat([gate, up], dim=1))

    expected = F.silu(gate)
    assert torch.isfinite(out[:, :-1]).all()
    torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-30)


def _qkv_case(gen, rows, dtype, num_heads=9, num_kv_heads=3, head_dim=64):
    qkv = torch.randn(rows, (num_heads + 2 * num_kv_heads) * head_dim, generator=gen).to(dtype)
    cos, sin = rope_angles(torch.arange(rows) + 1000, INV_FREQ[: head_dim // 2])
    return qkv, cos, sin


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", ROWS)
def test_rope_store_matches_the_reference(gen, make_pool, dtype, rows):
    qkv, cos, sin = _qkv_case(gen, rows, dtype)
    pool = make_pool(num_blocks=24, num_layers=3, block_size=16, num_kv_heads=3, dtype=dtype)
    slots = torch.randperm(24 * 16, generator=gen)[:rows]
    slots[rows // 2] = -1  # a padding row: nothing written for it
    qkv_ref, pool_ref = qkv.clone(), pool.clone()

    rope_store(qkv, cos, sin, 9, 3, pool, 1, slots)
    rope_store_ref(qkv_ref, cos, sin, 9, 3, pool_ref, 1, slots)

    torch.testing.assert_close(qkv, qkv_ref, **TOL[dtype])
    torch.testing.assert_close(pool, pool_ref, **TOL[dtype])
    # Only the written slots of layer 1 changed.
    untouched = pool_ref.clone()
    untouched[:, 1] = 0
    changed = pool.clone()
    changed[:, 1] = 0
    assert torch.equal(changed, untouched)


def test_rope_store_is_transformers_rotate_half(gen):
    qkv, cos, sin = _qkv_case(gen, 6, torch.float32, num_heads=2, num_kv_heads=1)
    q = qkv[:, :64].clone()
    full_cos, full_sin = torch.cat([cos, cos], -1), torch.cat([sin, sin], -1)
    rotated_half = torch.cat([-q[:, 32:], q[:, :32]], -1)
    expected = q * full_cos + rotated_half * full_sin

    rope_store(qkv, cos, sin, 2, 1)

    torch.testing.assert_close(qkv[:, :64], expected, rtol=1e-6, atol=1e-6)


def test_a_slot_out_of_range_raises_and_writes_nothing(gen, make_pool):
    qkv, cos, sin = _qkv_case(gen, 4, torch.float32)
    pool = make_pool(num_blocks=4, num_layers=2, block_size=16, num_kv_heads=3)
    before = pool.clone()

    with pytest.raises(ValueError, match="out of range"):
        rope_store(qkv, cos, sin, 9, 3, pool, 0, torch.tensor([0, 1, 4 * 16, 2]))
    with pytest.raises(ValueError, match="out of range"):
        rope_store(qkv, cos, sin, 9, 3, pool, 0, torch.tensor([0, -2, 1, 2]))

    assert torch.equal(pool, before)


@pytest.mark.parametrize(
    "call",
    [
        lambda: rms_norm(torch.zeros(2, 8), torch.zeros(7), 1e-5),
        lambda: rms_norm(torch.zeros(2, 8), torch.zeros(8), 1e-5, torch.zeros(3, 8)),
        lambda: rms_norm(torch.zeros(2, 8), torch.zeros(8, dtype=torch.bfloat16), 1e-5),
        lambda: silu_mul(torch.zeros(2, 7)),
        lambda: rope_store(torch.zeros(2, 100), torch.zeros(2, 2), torch.zeros(2, 2), 2, 1),
        lambda: rope_store(torch.zeros(2, 16), torch.zeros(2, 3), torch.zeros(2, 3), 2, 1),
        lambda: rope_store(torch.zeros(2, 16), torch.zeros(2, 2), torch.zeros(2, 2), 2, 0),
        lambda: rope_store(
            torch.zeros(2, 16), torch.zeros(2, 2), torch.zeros(2, 2), 2, 1, torch.zeros(1)
        ),
    ],
)
def test_bad_shapes_are_value_errors(call):
    with pytest.raises(ValueError):
        call()


def test_the_pool_of_another_dtype_is_refused(gen, make_pool):
    qkv, cos, sin = _qkv_case(gen, 3, torch.float32)
    pool = make_pool(num_blocks=4, num_kv_heads=3, dtype=torch.bfloat16)

    with pytest.raises(ValueError):
        rope_store(qkv, cos, sin, 9, 3, pool, 0, torch.tensor([0, 1, 2]))


def test_torch_backend_and_strided_inputs_take_the_reference(gen):
    x = torch.randn(8, 64, generator=gen)
    weight = torch.randn(64, generator=gen)
    gate_up = torch.randn(8, 2 * 32, generator=gen)
    strided = torch.randn(8, 2 * 64, generator=gen)[:, ::2]

    assert torch.equal(
        rms_norm(x.clone(), weight, 1e-5, backend="torch"), rms_norm_ref(x.clone(), weight, 1e-5)
    )
    assert torch.equal(silu_mul(gate_up, backend="torch"), silu_mul_ref(gate_up))
    assert torch.equal(rms_norm(strided, weight, 1e-5), rms_norm_ref(strided, weight, 1e-5))


def test_int32_slots_write_what_int64_ones_do(gen, make_pool):
    qkv, cos, sin = _qkv_case(gen, 5, torch.float32)
    pool = make_pool(num_blocks=4, num_kv_heads=3)
    pool_64, qkv_64 = pool.clone(), qkv.clone()
    slots = torch.tensor([3, 9, 17, 33, 60])

    rope_store(qkv, cos, sin, 9, 3, pool, 1, slots.int())
    rope_store(qkv_64, cos, sin, 9, 3, pool_64, 1, slots)

    assert torch.equal(pool, pool_64)


def test_the_environment_switch_turns_the_extension_off():
    code = (
        "from cachetier.kernels.fused_ops import native_fused_ops\n"
        "assert native_fused_ops() is None\n"
    )
    env = {**os.environ, "CACHETIER_NATIVE_KERNELS": "0"}
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=120)
