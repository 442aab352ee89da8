"""Backend choice and the lazy Triton import."""

import subprocess
import sys

import pytest
import torch

from cachetier import kernels
from cachetier.kernels import resolve_backend


def test_auto_picks_torch_for_cpu_tensors():
    assert resolve_backend("auto", torch.zeros(2), torch.zeros(2, dtype=torch.int64)) == "torch"
    assert resolve_backend("torch", torch.zeros(2)) == "torch"


def test_explicit_triton_runs_on_cpu_under_the_interpreter():
    assert resolve_backend("triton", torch.zeros(2)) == "triton"


def test_explicit_triton_on_cpu_without_the_interpreter_is_refused(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        resolve_backend("triton", torch.zeros(2))


def test_unknown_backend_is_refused():
    with pytest.raises(ValueError, match="backend must be one of"):
        resolve_backend("cuda", torch.zeros(2))


def test_tensors_on_different_devices_are_refused():
    with pytest.raises(ValueError, match="one device"):
        resolve_backend("auto", torch.zeros(2), torch.zeros(2, device="meta"))


def test_triton_backend_runs_the_triton_kernel(monkeypatch):
    import cachetier.kernels.triton_cache_ops as triton_cache_ops

    launched = []
    original = triton_cache_ops.copy_blocks_triton

    def spy(*args, **kwargs):
        launched.append(kwargs["gather"])
        return original(*args, **kwargs)

    monkeypatch.setattr(triton_cache_ops, "copy_blocks_triton", spy)
    pool = torch.randn(4, 1, 2, 16, 1, 8)
    staged = kernels.gather_blocks(pool, torch.tensor([2]), backend="triton")
    kernels.gather_blocks(pool, torch.tensor([2]), backend="auto")
    assert launched == [True], "backend='triton' must launch the kernel and 'auto' on CPU not"
    torch.testing.assert_close(staged[0], pool[2], rtol=0, atol=0)


def test_importing_kernels_does_not_import_triton():
    code = (
        "import sys, cachetier.kernels; "
        "assert 'triton' not in sys.modules, 'triton imported eagerly'"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
