"""``Runs``: a payload's runs scattered in one buffer, and the copies that land one there."""

from __future__ import annotations

import pytest

from cachetier.util.landing import Runs, copy_pairs, flat, normalize, parts


def test_runs_must_tile_the_buffer_once() -> None:
    buf = memoryview(bytearray(12))
    assert Runs(buf, 4, (8, 0, 4)).nbytes == 12
    for run_bytes, offsets in ((4, (0, 4)), (4, (0, 0, 8)), (4, (0, 4, 9)), (0, ())):
        with pytest.raises(ValueError):
            Runs(buf, run_bytes, offsets)
    with pytest.raises(ValueError, match="flat writable"):
        Runs(memoryview(bytes(12)), 4, (0, 4, 8))


def test_a_flat_payload_lands_run_by_run() -> None:
    dest = Runs(memoryview(bytearray(6)), 2, (4, 0, 2))
    for to, src in copy_pairs(dest, memoryview(b"aabbcc")):
        to[:] = src
    assert bytes(dest.buffer) == b"bbccaa"
    assert [bytes(p) for p in parts(dest)] == [b"aa", b"bb", b"cc"]


def test_a_plain_buffer_is_its_own_flat_view() -> None:
    view = memoryview(bytearray(8))
    assert flat(view) is view and normalize(view) is view
    assert flat(memoryview(bytearray(8)).cast("I")).nbytes == 8
    runs = Runs(view, 4, (0, 4))
    assert normalize(runs) is runs and flat(runs) is view
