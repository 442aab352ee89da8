"""The record codec: what a record holds, how it is compressed, and every check a decoder makes
(flipped, cut, relabelled or lying records), through every way a record is read back."""

from __future__ import annotations

import dataclasses
import io
import os
import struct
from collections.abc import Callable

import numpy as np
import pytest

import cachetier.record as record_module
import cachetier.record.codec as codec_module
from cachetier.errors import CorruptBlockError
from cachetier.primitives.keys import Namespace
from cachetier.record import (
    FORMAT_VERSION,
    SEGMENT_BYTES,
    UNKNOWN_WRITER,
    Compression,
    KVBlock,
    decode_record,
    encode_parts,
    encode_record,
    peek_key,
    plain_record_nbytes,
    process_writer,
    read_record,
    record_nbytes,
    reseal,
)
from tests.cachetier.record_readers import DECODERS, as_version, one_record
from tests.support import SMALL_LAYOUT, make_blocks


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


@pytest.mark.parametrize("decode", DECODERS)
def test_every_single_byte_flip_is_caught(
    namespace: Namespace, decode: Callable[..., KVBlock]
) -> None:
    block, record = one_record(namespace)
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
    block, record = one_record(namespace)
    with pytest.raises(CorruptBlockError):
        decode(bytes(record[:cut]), key=block.key)


@pytest.mark.parametrize("decode", DECODERS)
def test_trailing_garbage_is_caught(namespace: Namespace, decode: Callable[..., KVBlock]) -> None:
    block, record = one_record(namespace)
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
    _, record = one_record(namespace)
    struct.pack_into("<H", record, 4, FORMAT_VERSION + 1)
    reseal(record)  # so only the version is wrong
    with pytest.raises(CorruptBlockError, match="version"):
        decode_record(bytes(record))


@pytest.mark.parametrize("decode", DECODERS)
def test_a_record_names_its_writer(namespace: Namespace, decode: Callable[..., KVBlock]) -> None:
    block = make_blocks(namespace, 1)[0]
    assert decode(encode_record(block)).writer == process_writer()  # made here: this process
    other = dataclasses.replace(block, writer=b"w" * 16)
    back = decode(encode_record(other))
    assert back.writer == b"w" * 16
    assert encode_record(back) == encode_record(other)  # kept as it travels on
    # The writer is inside the checksummed head: another writer's name is caught.
    record = bytearray(encode_record(other))
    record[record.index(b"w" * 16)] ^= 1
    with pytest.raises(CorruptBlockError, match="checksum"):
        decode(bytes(record))


@pytest.mark.parametrize("version", [1, 2])
@pytest.mark.parametrize("decode", DECODERS)
def test_records_of_earlier_versions_are_still_read(
    namespace: Namespace, decode: Callable[..., KVBlock], version: int
) -> None:
    block = make_blocks(namespace, 1)[0]
    old = as_version(encode_record(block), version)
    back = decode(bytes(old), key=block.key)
    assert bytes(back.data) == bytes(block.data)
    assert back.writer == UNKNOWN_WRITER  # written before records named their writer
    assert back.verified is None  # encoding it again writes the current version, hashed afresh
    assert encode_record(back) == encode_record(dataclasses.replace(block, writer=UNKNOWN_WRITER))
    old[-1] ^= 1
    with pytest.raises(CorruptBlockError, match="checksum"):
        decode(bytes(old))
    # The version is covered too: a current record relabelled as an older one is refused.
    relabelled = bytearray(encode_record(block))
    struct.pack_into("<H", relabelled, 4, version)
    # (a version-3 head is longer by its writer, so the lengths disagree first)
    with pytest.raises(CorruptBlockError, match="checksum|claims"):
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


def test_a_record_claiming_no_tokens_is_corrupt(namespace: Namespace) -> None:
    record = bytearray(encode_record(make_blocks(namespace, 1)[0]))
    struct.pack_into("<I", record, codec_module._KEY_OFFSET - 4, 0)  # num_tokens
    reseal(record)
    for decode in DECODERS:
        with pytest.raises(CorruptBlockError, match="0 tokens"):
            decode(bytes(record))
