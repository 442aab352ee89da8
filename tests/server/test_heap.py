"""The heap trimmer: due after a burst of ended handshakes, never while one is in progress."""

from __future__ import annotations

import pytest

from cachetier.server.heap import HeapTrimmer


def test_a_trim_is_due_only_after_a_burst_with_nothing_in_progress() -> None:
    heap = HeapTrimmer(threshold=3)
    assert not heap.note_ended(num_in_progress=0)  # 1 ended: no burst yet
    assert not heap.note_ended(num_in_progress=5)  # 2
    assert not heap.note_ended(num_in_progress=1)  # 3, but one is still going on
    assert heap.note_ended(num_in_progress=0)
    heap.trim()  # glibc's malloc_trim, for real
    assert heap.num_trims == 1
    assert not heap.note_ended(num_in_progress=0)  # counting starts again


def test_a_threshold_must_be_positive() -> None:
    with pytest.raises(ValueError, match="threshold must be positive"):
        HeapTrimmer(threshold=0)
