"""Reading a record through a caller's read functions as the disk tier does: streamed, straight
into caller memory, a file read whole (aligned as on disk, its header checked before anything
is allocated), by position, and a large record split with a helper thread."""

from __future__ import annotations

import io
import os
import threading
from pathlib import Path

import numpy as np
import pytest

import cachetier.record.reading as reading_module
from cachetier.errors import CorruptBlockError
from cachetier.primitives.keys import KVLayout, Namespace
from cachetier.record import SEGMENT_BYTES, Compression, KVBlock, encode_record, read_record
from cachetier.util.parallel import map_in_threads
from tests.cachetier.record_readers import (
    as_version_1,
    one_record,
    read_logging_preads,
    read_streamed,
)
from tests.support import make_blocks


@pytest.mark.parametrize("compression", [Compression.NONE, Compression.LZ4])
def test_streamed_read_round_trips(namespace: Namespace, compression: Compression) -> None:
    block = make_blocks(namespace, 1)[0]
    back = read_streamed(encode_record(block, compression), key=block.key)
    assert bytes(back.data) == bytes(block.data)


def test_a_file_shorter_than_its_size_is_caught(namespace: Namespace) -> None:
    block, record = one_record(namespace)
    short = io.BytesIO(bytes(record[:-10]))
    with pytest.raises(CorruptBlockError, match="ended"):
        read_record(short.readinto, len(record), key=block.key)


def test_payload_can_be_read_straight_into_caller_memory(namespace: Namespace) -> None:
    block = make_blocks(namespace, 1)[0]
    dest = bytearray(len(block.data))
    back = read_record(
        io.BytesIO(encode_record(block)).readinto,
        len(encode_record(block)),
        key=block.key,
        payload_into=memoryview(dest),
    )
    assert bytes(dest) == bytes(block.data)
    assert memoryview(back.data).obj is dest
    # A compressed record cannot land there directly: it decodes into its own buffer.
    packed = encode_record(
        KVBlock(block.key, block.fingerprint, block.dtype, block.shape, 16, bytes(len(block.data))),
        Compression.LZ4,
    )
    other = bytearray(len(block.data))
    back = read_record(io.BytesIO(packed).readinto, len(packed), payload_into=memoryview(other))
    assert memoryview(back.data).obj is not other and bytes(back.data) == bytes(len(block.data))


def test_a_file_read_whole_spans_several_reads_and_keeps_its_payload_aligned_as_on_disk() -> None:
    # Over one page, so the head and the rest come in separate reads; the payload lies at the
    # same offset within a page as in the file (the buffer starts on a page boundary).
    layout = KVLayout("float16", block_size=64, num_layers=4, num_kv_heads=2, head_dim=64)
    block = make_blocks(Namespace("whole-model", layout), 1)[0]
    record = encode_record(block)
    assert len(record) > 2 * 4096
    reads: list[int] = []
    stream = io.BytesIO(record)

    def readinto(buf: memoryview) -> int:
        reads.append(buf.nbytes)
        return stream.readinto(buf)

    back = read_record(readinto, len(record), key=block.key, trusted_size=True)
    assert bytes(back.data) == bytes(block.data)
    assert len(reads) >= 2
    address = np.frombuffer(back.data, dtype=np.uint8).__array_interface__["data"][0]
    assert address % 4096 == (len(record) - len(bytes(block.data))) % 4096
    flipped = bytearray(record)
    flipped[3 * 4096 + 5] ^= 1  # a byte of a later read
    with pytest.raises(CorruptBlockError, match="checksum"):
        read_record(io.BytesIO(flipped).readinto, len(record), trusted_size=True)


def test_a_file_read_whole_is_checked_against_its_header_before_it_is_allocated(
    namespace: Namespace, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A huge file in a shared folder whose header describes a small record: refused on the
    # header, nothing of its size allocated.
    record = encode_record(make_blocks(namespace, 1)[0])
    taken: list[int] = []
    real_take = reading_module.buffers.take
    monkeypatch.setattr(reading_module.buffers, "take", lambda n: taken.append(n) or real_take(n))
    padded = record + bytes(8192)
    with pytest.raises(CorruptBlockError, match="header claims"):
        read_record(io.BytesIO(padded).readinto, 1 << 40, trusted_size=True)
    with pytest.raises(CorruptBlockError, match="header claims"):
        read_record(io.BytesIO(padded).readinto, len(padded), trusted_size=True)
    assert taken == []


def test_a_small_record_read_by_position_checks_its_header_before_reading_the_rest() -> None:
    layout = KVLayout("float16", block_size=64, num_layers=4, num_kv_heads=2, head_dim=64)
    record = encode_record(make_blocks(Namespace("positioned-model", layout), 1)[0])
    assert 4096 < len(record) <= reading_module._READ_CHUNK
    preads: list[tuple[int, int]] = []
    back = read_logging_preads(record, preads)
    # Its first page, then the rest in one read; its payload as aligned as in the file.
    assert preads == [(0, 4096), (4096, len(record) - 4096)]
    address = np.frombuffer(back.data, dtype=np.uint8).__array_interface__["data"][0]
    assert address % 4096 == (len(record) - len(bytes(back.data))) % 4096
    # A file longer than its header says: refused on the first page.
    preads.clear()
    with pytest.raises(CorruptBlockError, match="header claims"):
        read_logging_preads(record + bytes(4096), preads)
    assert preads == [(0, 4096)]


def _big_record_file(tmp_path: Path) -> tuple[KVBlock, bytes, Path]:
    # Over the size whose second half is read on a helper thread.
    layout = KVLayout("float16", block_size=256, num_layers=10, num_kv_heads=4, head_dim=64)
    block = make_blocks(Namespace("split-model", layout), 1)[0]
    record = encode_record(block)
    assert len(record) - 4096 >= reading_module._SPLIT_READ_BYTES
    path = tmp_path / "record.ctkv"
    path.write_bytes(record)
    return block, record, path


def _read_file(path: Path, size: int, preads: list[tuple[int, str]]) -> KVBlock:
    fd = os.open(path, os.O_RDONLY)
    try:

        def pread(buf: memoryview, offset: int) -> int:
            preads.append((offset, threading.current_thread().name))
            return os.preadv(fd, [buf], offset)

        return read_record(lambda b: os.readv(fd, [b]), size, trusted_size=True, pread=pread)
    finally:
        os.close(fd)


def test_a_large_record_reads_its_later_segments_on_a_helper_thread(tmp_path: Path) -> None:
    block, record, path = _big_record_file(tmp_path)
    preads: list[tuple[int, str]] = []
    back = _read_file(path, len(record), preads)
    assert bytes(back.data) == bytes(block.data) and back.key == block.key
    offsets = [offset for offset, _ in preads]
    # One read per segment, from a segment boundary near the middle on to the end.
    assert offsets == list(range(offsets[0], len(record), SEGMENT_BYTES))
    assert offsets[0] % SEGMENT_BYTES == 0 and len(record) // 3 < offsets[0] < 2 * len(record) // 3
    assert all(thread.startswith("cachetier-data") for _, thread in preads)


def test_beside_its_helper_the_caller_reads_one_segment_at_a_time(tmp_path: Path) -> None:
    # So that each segment is hashed from the core's own cache right after its read.
    block, record, path = _big_record_file(tmp_path)
    reads: list[int] = []
    fd = os.open(path, os.O_RDONLY)
    try:

        def readinto(buf: memoryview) -> int:
            reads.append(buf.nbytes)
            return os.readv(fd, [buf])

        back = read_record(
            readinto, len(record), trusted_size=True, pread=lambda b, at: os.preadv(fd, [b], at)
        )
    finally:
        os.close(fd)
    assert bytes(back.data) == bytes(block.data)
    assert reads[0] == 4096  # the first page, with the header
    assert reads[1] == SEGMENT_BYTES - 4096 and set(reads[2:]) == {SEGMENT_BYTES}


def test_a_large_record_of_the_previous_version_is_read_on_one_thread(tmp_path: Path) -> None:
    # Its checksum is one stream: nothing to split.
    block, record, path = _big_record_file(tmp_path)
    old = as_version_1(record)
    path.write_bytes(old)
    preads: list[tuple[int, str]] = []
    assert bytes(_read_file(path, len(old), preads).data) == bytes(block.data)
    assert preads == []


def test_a_split_read_still_checks_every_byte(tmp_path: Path) -> None:
    _, record, path = _big_record_file(tmp_path)
    cut = len(record) // 2 // SEGMENT_BYTES * SEGMENT_BYTES
    # The caller's first and last byte, then the helper's first and last.
    for where in (4096 + 7, cut - 1, cut + SEGMENT_BYTES, len(record) - 9):
        flipped = bytearray(record)
        flipped[where] ^= 1
        path.write_bytes(flipped)
        with pytest.raises(CorruptBlockError, match="checksum"):
            _read_file(path, len(record), [])


def test_a_split_read_of_a_short_file_is_a_corrupt_record_not_a_hang(tmp_path: Path) -> None:
    _, record, path = _big_record_file(tmp_path)
    path.write_bytes(record[:-100])  # the size claimed is more than the file holds
    with pytest.raises(CorruptBlockError, match="short"):
        _read_file(path, len(record), [])


def test_a_split_read_on_a_data_thread_stays_on_that_thread(tmp_path: Path) -> None:
    # The pool's threads never wait on each other: a read on one of them is not split.
    block, record, path = _big_record_file(tmp_path)
    preads: list[tuple[int, str]] = []
    out = map_in_threads(lambda _: _read_file(path, len(record), preads), [0, 1], workers=2)
    assert all(isinstance(b, KVBlock) and bytes(b.data) == bytes(block.data) for b in out)
    assert preads == []
