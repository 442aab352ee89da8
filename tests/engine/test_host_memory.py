"""The engine keeps freed activations' memory: a second step's tensors do not fault in again."""

from __future__ import annotations

import resource
import sys

import pytest
import torch

from engine.host_memory import MMAP_THRESHOLD_BYTES, keep_freed_memory


def _minor_faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt is Linux's")
def test_a_large_activation_freed_and_allocated_again_faults_no_pages_in() -> None:
    assert keep_freed_memory() is True
    assert keep_freed_memory() is True  # once per process; the answer is remembered
    size = MMAP_THRESHOLD_BYTES // 2  # a 2,048-token gate/up activation is about this size
    first = torch.empty(size // 4, dtype=torch.float32)
    first.fill_(1.0)  # faulted in once
    del first
    before = _minor_faults()
    again = torch.empty(size // 4, dtype=torch.float32)
    again.fill_(2.0)
    faults = _minor_faults() - before
    del again
    # A fresh mapping of 16 MiB is 4,096 pages; the heap's own memory needs none of them.
    assert faults < 256, f"{faults} pages faulted in for memory freed a moment ago"
