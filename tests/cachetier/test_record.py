from __future__ import annotations

import dataclasses
import io
import os
import struct
import threading
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

import cachetier.record as record_module
import cachetier.record.codec as codec_module
import cachetier.record.reading as reading_module
from cachetier.errors import CorruptBlockError
from cachetier.primitives.keys import KVLayout, Namespace
from cachetier.record import (
    FORMAT_VERSION,
    SEGMENT_BYTES,
    Compression,
    KVBlock,
    decode_record,
    encode_parts,
    encode_record,
    peek_key,
    plain_record_nbytes,
    read_record,
    record_nbytes,
    reseal,
)
from cachetier.util.parallel import map_in_threads
from tests.support import SMALL_LAYOUT, make_blocks


def read_streamed(record: bytes, **checks: bytes | None) -> KVBlock:
    """The streaming reader the disk tier uses, over an in-memory file."""
    stream = io.BytesIO(record)
    return read_record(stream.readinto, len(record), **checks)


def read_whole_file(record: bytes, **checks: bytes | None) -> KVBlock:
    """The disk tier's read of a file with no destination: its true size, read whole."""
    stream = io.BytesIO(record)
    return read_record(stream.readinto, len(record), trusted_size=True, **checks)


def read_positioned(record: bytes, **checks: bytes | None) -> KVBlock:
    """The disk tier's read of a file with no destination, given positional reads as it is:
    a record up to ``_READ_CHUNK`` (2 MiB) is read by its first page, then the rest."""
    preads: list[tuple[int, int]] = []
    back = _read_positioned(record, preads, **checks)
    if len(record) <= reading_module._READ_CHUNK:
        assert len(preads) <= 2, "a small record is read in two positional reads at most"
    return back


def _read_positioned(
    record: bytes, preads: list[tuple[int, int]], **checks: bytes | None
) -> KVBlock:
    def pread(buf: memoryview, offset: int) -> int:
        preads.append((offset, buf.nbytes))
        got = record[offset : offset + buf.nbytes]
        buf[: len(got)] = got
        return len(got)

    stream = io.BytesIO(record)  # a larger record's reader (split reads use both)

    def readinto(buf: memoryview) -> int:
        assert len(record) > reading_module._READ_CHUNK, "a small record is read by position"
        return stream.readinto(buf)

    return read_record(readinto, len(record), trusted_size=True, pread=pread, **checks)


# Every check runs through every decoder: whole-buffer, streamed, and a file read whole (as a
# stream, and by position).
DECODERS = [decode_record, read_streamed, read_whole_file, read_positioned]


@pytest.mark.parametrize("compression", [Compression.NONE, Compression.LZ4])
def test_round_trip(namespace: Namespace, compression: Compression) -> None:
    block = make_blocks(namespace, 1)[0]
    record = encode_record(block, compression)
    back = decode_record(record, key=block.key, fingerprint=namespace.fingerprint)
    assert bytes(back.data) == bytes(block.data)
    assert (back.key, back.fingerprint, back.dtype, back.shape, back.num_tokens) == (
        block.key,
        block.fingerprint,
        block.dtype,
        block.shape,
        block.num_tokens,
    )
    assert peek_key(record) == block.key
    assert b"".join(encode_parts(block, compression)) == record


def test_lz4_shrinks_compressible_data_and_falls_back_when_it_cannot(namespace: Namespace) -> None:
    block = make_blocks(namespace, 1)[0]
    zeros = KVBlock(
        block.key, block.fingerprint, block.dtype, block.shape, 16, bytes(len(block.data))
    )
    assert len(encode_record(zeros, Compression.LZ4)) < len(block.data) // 10
    noise = np.random.default_rng(1).integers(0, 256, len(block.data), dtype=np.uint8).tobytes()
    random_block = KVBlock(block.key, block.fingerprint, "float16", block.shape, 16, noise)
    assert len(encode_record(random_block, Compression.LZ4)) == len(
        encode_record(random_block, Compression.NONE)
    )


def test_aux_travels_with_the_block(namespace: Namespace) -> None:
    b = make_blocks(namespace, 1)[0]
    block = KVBlock(b.key, b.fingerprint, b.dtype, b.shape, 16, b.data, aux=b"scales!!")
    assert decode_record(encode_record(block, Compression.LZ4)).aux == b"scales!!"


@pytest.mark.parametrize("aux", [b"", b"scales!!"])
def test_an_uncompressed_record_length_is_known_before_encoding(
    namespace: Namespace, aux: bytes
) -> None:
    # A sender announces this length before it hashes the payload: it must be exact.
    b = make_blocks(namespace, 1)[0]
    for shape in (b.shape, (int(np.prod(b.shape)),)):
        block = KVBlock(b.key, b.fingerprint, b.dtype, shape, 16, b.data, aux=aux)
        assert plain_record_nbytes(block) == record_nbytes(encode_parts(block))
        assert plain_record_nbytes(block) == len(encode_record(block))


def _record(namespace: Namespace) -> tuple[KVBlock, bytearray]:
    block = make_blocks(namespace, 1)[0]
    return block, bytearray(encode_record(block))


@pytest.mark.parametrize("decode", DECODERS)
def test_every_single_byte_flip_is_caught(
    namespace: Namespace, decode: Callable[..., KVBlock]
) -> None:
    block, record = _record(namespace)
    # Every header byte, and a spread of payload bytes.
    positions = list(range(0, 200)) + list(range(200, len(record), 97))
    for pos in positions:
        bad = bytearray(record)
        bad[pos] ^= 0x01
        with pytest.raises(CorruptBlockError):
            decode(bytes(bad), key=block.key)


@pytest.mark.parametrize("cut", [0, 1, 10, 100, -1, -100])
@pytest.mark.parametrize("decode", DECODERS)
def test_truncated_records_are_caught(
    namespace: Namespace, cut: int, decode: Callable[..., KVBlock]
) -> None:
    block, record = _record(namespace)
    with pytest.raises(CorruptBlockError):
        decode(bytes(record[:cut]), key=block.key)


@pytest.mark.parametrize("decode", DECODERS)
def test_trailing_garbage_is_caught(namespace: Namespace, decode: Callable[..., KVBlock]) -> None:
    block, record = _record(namespace)
    with pytest.raises(CorruptBlockError):
        decode(bytes(record) + b"x", key=block.key)


@pytest.mark.parametrize("decode", DECODERS)
def test_wrong_key_or_fingerprint_is_refused(
    namespace: Namespace, decode: Callable[..., KVBlock]
) -> None:
    a, b = make_blocks(namespace, 2)
    record = encode_record(a)
    with pytest.raises(CorruptBlockError, match="another key"):
        decode(record, key=b.key)
    other = Namespace("other-model", SMALL_LAYOUT)
    with pytest.raises(CorruptBlockError, match="another namespace"):
        decode(record, key=a.key, fingerprint=other.fingerprint)


def test_unknown_version_is_refused(namespace: Namespace) -> None:
    _, record = _record(namespace)
    struct.pack_into("<H", record, 4, FORMAT_VERSION + 1)
    reseal(record)  # so only the version is wrong
    with pytest.raises(CorruptBlockError, match="version"):
        decode_record(bytes(record))


def _as_version_1(record: bytes) -> bytearray:
    """``record`` as the previous format wrote it: version 1, one xxh3-64 over it all."""
    old = bytearray(record)
    struct.pack_into("<H", old, 4, 1)
    reseal(old)
    return old


@pytest.mark.parametrize("decode", DECODERS)
def test_records_of_the_previous_version_are_still_read(
    namespace: Namespace, decode: Callable[..., KVBlock]
) -> None:
    block = make_blocks(namespace, 1)[0]
    old = _as_version_1(encode_record(block))
    back = decode(bytes(old), key=block.key)
    assert bytes(back.data) == bytes(block.data)
    assert back.verified is None  # encoding it again writes the current version, hashed afresh
    assert encode_record(back) == encode_record(block)
    old[-1] ^= 1
    with pytest.raises(CorruptBlockError, match="checksum"):
        decode(bytes(old))
    # The version is covered too: a current record relabelled as version 1 fails its check.
    relabelled = bytearray(encode_record(block))
    struct.pack_into("<H", relabelled, 4, 1)
    with pytest.raises(CorruptBlockError, match="checksum"):
        decode(bytes(relabelled))


@pytest.mark.parametrize("extra", [-1, 0, 1])
@pytest.mark.parametrize("decode", DECODERS)
def test_every_checksum_segment_is_covered(decode: Callable[..., KVBlock], extra: int) -> None:
    # Records of three segments and a byte under, exactly, and a byte over: a flip in any
    # segment, the last (possibly one byte long) included, is caught.
    block = make_blocks(Namespace("seg-model", SMALL_LAYOUT), 1)[0]
    empty = KVBlock(block.key, block.fingerprint, "uint8", (0,), 16, b"")
    head = plain_record_nbytes(empty)
    nbytes = 3 * SEGMENT_BYTES + extra - head
    sized = KVBlock(block.key, block.fingerprint, "uint8", (nbytes,), 16, os.urandom(nbytes))
    record = encode_record(sized)
    assert len(record) == 3 * SEGMENT_BYTES + extra
    assert bytes(decode(record).data) == sized.data
    for where in (head + 1, SEGMENT_BYTES + 3, 2 * SEGMENT_BYTES, len(record) - 1):
        flipped = bytearray(record)
        flipped[where] ^= 1
        with pytest.raises(CorruptBlockError, match="checksum"):
            decode(bytes(flipped))


def test_block_validates_its_claims(namespace: Namespace) -> None:
    b = make_blocks(namespace, 1)[0]
    with pytest.raises(ValueError, match="needs"):
        KVBlock(b.key, b.fingerprint, b.dtype, b.shape, 16, b"123")
    with pytest.raises(ValueError, match="bytes each"):
        KVBlock(b"short", b.fingerprint, b.dtype, b.shape, 16, b.data)
    with pytest.raises(ValueError, match="dtype"):
        KVBlock(b.key, b.fingerprint, "complex64", b.shape, 16, b.data)


@pytest.mark.parametrize("compression", [Compression.NONE, Compression.LZ4])
def test_streamed_read_round_trips(namespace: Namespace, compression: Compression) -> None:
    block = make_blocks(namespace, 1)[0]
    back = read_streamed(encode_record(block, compression), key=block.key)
    assert bytes(back.data) == bytes(block.data)


def test_a_file_shorter_than_its_size_is_caught(namespace: Namespace) -> None:
    block, record = _record(namespace)
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


def test_a_checked_block_encodes_again_without_hashing_its_payload(
    namespace: Namespace, monkeypatch: pytest.MonkeyPatch
) -> None:
    [block] = make_blocks(namespace, 1)
    record = encode_record(block)
    decoded = decode_record(record, key=block.key)  # bytes: immutable, the checksum is kept
    calls: list[int] = []
    real = codec_module._Checksum.past_head  # where every checksum starts
    monkeypatch.setattr(codec_module._Checksum, "past_head", lambda *a: calls.append(1) or real(*a))
    assert encode_record(decoded) == record and calls == []
    # Another payload (or aux) under the same block: hashed afresh, so the record stays valid.
    other = dataclasses.replace(decoded, data=bytes(len(block.data)))
    with_aux = dataclasses.replace(decoded, aux=b"scales")
    records = [encode_record(other), encode_record(with_aux)]
    assert len(calls) == 2
    assert decode_record(records[0]).data == other.data
    assert decode_record(records[1]).aux == b"scales"


def test_a_checksum_is_kept_only_for_payloads_nobody_else_writes(namespace: Namespace) -> None:
    [block] = make_blocks(namespace, 1)
    record = encode_record(block)
    assert decode_record(bytearray(record)).verified is None  # its owner may write to it
    assert decode_record(record).verified is not None
    stream = io.BytesIO(record)
    assert read_record(stream.readinto, len(record)).verified is not None
    pool_block = memoryview(bytearray(len(block.data)))  # e.g. a KV pool block
    stream = io.BytesIO(record)
    got = read_record(stream.readinto, len(record), payload_into=pool_block)
    assert got.data is pool_block and got.verified is None
    zeros = dataclasses.replace(block, data=bytes(len(block.data)))  # lz4 shrinks it
    lz4 = encode_record(zeros, Compression.LZ4)
    assert len(lz4) < len(zeros.data)
    assert decode_record(lz4).verified is None  # decompressed: not that record's payload


def test_a_record_that_differs_in_ignored_bytes_keeps_no_checksum(namespace: Namespace) -> None:
    # Found by the transfer fuzzer: a resealed record with a non-zero pad byte decoded fine,
    # and its checksum was reused for a re-encoding that writes pad 0.
    [block] = make_blocks(namespace, 1)
    record = bytearray(encode_record(block))
    record[9] = 5  # the pad byte
    reseal(record)
    decoded = decode_record(bytes(record))
    assert decoded.verified is None
    assert decode_record(encode_record(decoded), key=block.key).data == decoded.data


def _lz4_claiming(block: KVBlock, raw_len: int) -> bytes:
    """``block``'s lz4 record with its raw length (and shape) set to ``raw_len``, resealed: a
    record whose checksum passes and whose header lies about what it decompresses to."""
    record = bytearray(encode_record(block, Compression.LZ4))
    assert record[6] == Compression.LZ4, "the payload compresses"
    record[90:98] = raw_len.to_bytes(8, "little")  # raw_len (record_module's fixed header)
    record[98:106] = (raw_len // 2).to_bytes(8, "little")  # shape[0], float16
    for dim in range(1, len(block.shape)):
        record[98 + 8 * dim : 106 + 8 * dim] = (1).to_bytes(8, "little")
    reseal(record)
    return bytes(record)


@pytest.mark.parametrize("decode", DECODERS)
def test_a_raw_length_over_the_limit_is_refused_before_decompressing(
    namespace: Namespace, decode: Callable[..., KVBlock]
) -> None:
    block = make_blocks(namespace, 1)[0]
    zeros = dataclasses.replace(block, data=bytes(len(block.data)))
    record = encode_record(zeros, Compression.LZ4)
    raw = len(zeros.data)
    assert record_module.peek_inflated_nbytes(record) == raw
    assert record_module.peek_inflated_nbytes(encode_record(zeros)) == 0  # served as a view
    assert decode(record, max_raw_bytes=raw).data == zeros.data
    with pytest.raises(CorruptBlockError, match="over the limit"):
        decode(record, max_raw_bytes=raw - 1)
    # A claim lz4 cannot even take (over 2 GiB), with no limit set: still a bad record.
    for claim in (3 << 30, 1 << 62):
        with pytest.raises(CorruptBlockError):
            decode(_lz4_claiming(zeros, claim))
        with pytest.raises(CorruptBlockError, match="over the limit"):
            decode(_lz4_claiming(zeros, claim), max_raw_bytes=1 << 20)


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
    back = _read_positioned(record, preads)
    # Its first page, then the rest in one read; its payload as aligned as in the file.
    assert preads == [(0, 4096), (4096, len(record) - 4096)]
    address = np.frombuffer(back.data, dtype=np.uint8).__array_interface__["data"][0]
    assert address % 4096 == (len(record) - len(bytes(back.data))) % 4096
    # A file longer than its header says: refused on the first page.
    preads.clear()
    with pytest.raises(CorruptBlockError, match="header claims"):
        _read_positioned(record + bytes(4096), preads)
    assert preads == [(0, 4096)]


def test_a_record_claiming_no_tokens_is_corrupt(namespace: Namespace) -> None:
    record = bytearray(encode_record(make_blocks(namespace, 1)[0]))
    struct.pack_into("<I", record, codec_module._KEY_OFFSET - 4, 0)  # num_tokens
    reseal(record)
    for decode in DECODERS:
        with pytest.raises(CorruptBlockError, match="0 tokens"):
            decode(bytes(record))


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
    path.write_bytes(_as_version_1(record))
    preads: list[tuple[int, str]] = []
    assert bytes(_read_file(path, len(record), preads).data) == bytes(block.data)
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
