"""Picks the implementation (plain torch or Triton) for one kernel call.

Every public kernel takes ``backend: str = "auto"`` and passes it here with its tensors, so the
choice is made per call from its arguments and nothing is kept in module state.
"""

from __future__ import annotations

import importlib.util
from typing import Literal

import torch

BACKENDS = ("auto", "torch", "triton")

Resolved = Literal["torch", "triton"]


def triton_installed() -> bool:
    """Whether the ``triton`` package can be imported (without importing it)."""
    return importlib.util.find_spec("triton") is not None


def resolve_backend(backend: str, *tensors: torch.Tensor) -> Resolved:
    """Turns a requested backend into the one that will run.

    Args:
        backend: ``"auto"``, ``"torch"`` or ``"triton"``. ``"auto"`` means Triton when the
            tensors live on a GPU and Triton is installed, plain torch otherwise (on CPU the
            torch code is the fast path; Triton on CPU runs only in its slow interpreter).
            ``"triton"`` is honoured on CPU tensors only when ``TRITON_INTERPRET=1`` was set
            before Triton was imported.
        tensors: the call's tensor arguments; all must be on one device.

    Returns:
        ``"torch"`` or ``"triton"``.

    Raises:
        ValueError: unknown backend name, tensors on different devices, or ``"triton"`` asked
            for where it cannot run.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    devices = {t.device for t in tensors}
    if len(devices) > 1:
        raise ValueError(f"all tensors must be on one device, got {sorted(map(str, devices))}")
    on_gpu = any(d.type == "cuda" for d in devices)
    if backend == "torch":
        return "torch"
    if backend == "auto":
        return "triton" if on_gpu and triton_installed() else "torch"
    if not triton_installed():
        raise ValueError("backend='triton' needs the triton package (pip install '.[kernels]')")
    if not on_gpu and not _triton_interprets():
        raise ValueError(
            "backend='triton' on CPU tensors needs TRITON_INTERPRET=1 in the environment "
            "before triton is imported; use backend='torch' or 'auto' on CPU"
        )
    return "triton"


def _triton_interprets() -> bool:
    # Ask Triton itself rather than re-parsing the variable: it decides at @triton.jit time.
    import triton

    return bool(triton.knobs.runtime.interpret)
