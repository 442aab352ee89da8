"""Recycled payload buffers: reused only once nothing holds them, bounded, and what records
are read into."""

from __future__ import annotations

import gc
import io

import numpy as np

from cachetier.primitives.keys import KVLayout, Namespace
from cachetier.record import encode_record, read_record
from cachetier.util import buffers
from tests.support import make_blocks

SIZE = 3 * buffers.MIN_RECYCLED_BYTES + 5


def _address(array: np.ndarray) -> int:
    return int(array.__array_interface__["data"][0])


def test_a_buffer_is_reused_only_after_every_holder_is_gone() -> None:
    size = SIZE + 1  # a size no other test uses: the idle list starts empty for it
    first = buffers.take(size)
    where = _address(first)
    view = memoryview(first).toreadonly()  # what a KVBlock keeps
    del first
    gc.collect()
    second = buffers.take(size)
    assert _address(second) != where  # still held through the memoryview
    del view
    gc.collect()
    third = buffers.take(size)
    assert _address(third) == where  # now idle: reused
    assert _address(second) != where


def test_small_buffers_are_not_recycled_and_the_idle_list_is_bounded() -> None:
    small = buffers.take(100)
    assert small.nbytes == 100
    before = buffers.idle_bytes()
    held = [buffers.take(buffers.MAX_IDLE_BYTES // 4 + 1) for _ in range(6)]
    del held
    gc.collect()
    assert buffers.idle_bytes() <= buffers.MAX_IDLE_BYTES
    assert buffers.idle_bytes() >= before


def test_records_read_into_recycled_memory_keep_their_bytes() -> None:
    layout = KVLayout("float16", block_size=64, num_layers=4, num_kv_heads=2, head_dim=64)
    blocks = make_blocks(Namespace("buffers-model", layout), 6)
    got = []
    for block in blocks:  # each read may reuse the buffer of a block dropped before it
        record = encode_record(block)
        got.append(read_record(io.BytesIO(record).readinto, len(record)))
        if len(got) > 2:
            got.pop(0)
            gc.collect()
        assert bytes(got[-1].data) == block.data


def test_recycled_buffers_start_on_a_page_boundary() -> None:
    # A read into memory that is not cache-line aligned is measurably slower (buffers' docs).
    for size in (buffers.MIN_RECYCLED_BYTES, SIZE + 2, 5 << 20):
        assert _address(buffers.take(size)) % buffers.ALIGN_BYTES == 0
