"""cachetier.kernels.cpu_linear.linear against F.linear: one projection, summed in another order."""

import pytest
import torch
import torch.nn.functional as F

from cachetier.kernels.cpu_linear import _onednn_dtypes, _onednn_linear, linear, prepack


def test_onednn_is_there_on_this_torch():
    # The x86 CPU wheels ship oneDNN; without it every call would quietly take F.linear.
    assert _onednn_linear() is not None


@pytest.mark.parametrize(
    ("dtype", "tol"), [(torch.float32, 1e-4), (torch.bfloat16, 5e-2), (torch.float16, 5e-3)]
)
@pytest.mark.parametrize("lead", [(1,), (7,), (2, 5), (0,)])
@pytest.mark.parametrize("with_bias", [True, False])
@pytest.mark.parametrize("packed", [False, True])
def test_linear_matches_f_linear(gen, dtype, tol, lead, with_bias, packed):
    x = torch.randn(*lead, 96, generator=gen).to(dtype)
    weight = torch.randn(40, 96, generator=gen).to(dtype)
    bias = torch.randn(40, generator=gen).to(dtype) if with_bias else None

    out = linear(x, prepack(weight) if packed else weight, bias)

    assert out.shape == (*lead, 40) and out.dtype == dtype
    torch.testing.assert_close(out, F.linear(x, weight, bias), rtol=tol, atol=tol)


# bf16 only where this CPU has oneDNN's bf16 kernels (AVX-512 or AMX); elsewhere F.linear runs it.
BF16_ON_ONEDNN = torch.bfloat16 in _onednn_dtypes()


@pytest.mark.parametrize(
    ("dtype", "packs"),
    [(torch.float32, True), (torch.bfloat16, BF16_ON_ONEDNN), (torch.float16, False)],
)
def test_prepack_packs_only_what_onednn_runs(gen, dtype, packs):
    weight = torch.randn(40, 96, generator=gen).to(dtype)
    packed = prepack(weight, batch_hint=32)
    assert packed.is_mkldnn is packs and packed.shape == weight.shape and packed.dtype == dtype
    row = weight[0]
    assert prepack(row) is row  # not a matrix: left as it is


def test_prepacked_weight_refuses_another_dtype(gen):
    packed = prepack(torch.randn(4, 8, generator=gen))
    with pytest.raises(ValueError, match="prepacked"):
        linear(torch.randn(3, 8, generator=gen).to(torch.bfloat16), packed)


def test_non_contiguous_input(gen):
    x = torch.randn(6, 192, generator=gen)[:, ::2]  # a strided view, as a chunk() gives
    weight = torch.randn(24, 96, generator=gen)
    torch.testing.assert_close(linear(x, weight), F.linear(x, weight), rtol=1e-4, atol=1e-4)


def test_mismatched_dtypes_fall_back_to_f_linear_and_its_error(gen):
    x = torch.randn(3, 8, generator=gen)
    with pytest.raises(RuntimeError):
        linear(x, torch.randn(4, 8, generator=gen).to(torch.bfloat16))
