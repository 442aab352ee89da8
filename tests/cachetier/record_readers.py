"""The ways the record tests read a record back: whole from bytes, streamed, and as the disk
tier reads a file (whole, as a stream or by position), plus the records they read."""

from __future__ import annotations

import io
import struct

import cachetier.record.reading as reading_module
from cachetier.primitives.keys import Namespace
from cachetier.record import (
    PEEK_BYTES,
    KVBlock,
    decode_record,
    encode_record,
    read_record,
    reseal,
)
from cachetier.record.writer import WRITER_BYTES
from tests.support import make_blocks


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
    back = read_logging_preads(record, preads, **checks)
    if len(record) <= reading_module._READ_CHUNK:
        assert len(preads) <= 2, "a small record is read in two positional reads at most"
    return back


def read_logging_preads(
    record: bytes, preads: list[tuple[int, int]], **checks: bytes | None
) -> KVBlock:
    """``read_positioned``, adding (offset, size) of each positional read to ``preads``."""

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


def one_record(namespace: Namespace) -> tuple[KVBlock, bytearray]:
    """A block of ``namespace`` and its record, to be spoilt."""
    block = make_blocks(namespace, 1)[0]
    return block, bytearray(encode_record(block))


def as_version(record: bytes, version: int) -> bytearray:
    """``record`` as an earlier format wrote it: no writer id (versions 1 and 2), and one
    xxh3-64 over it all (version 1)."""
    old = bytearray(record)
    shape_end = PEEK_BYTES + 8 * old[8]
    del old[shape_end : shape_end + WRITER_BYTES]
    struct.pack_into("<H", old, 4, version)
    reseal(old)
    return old


def as_version_1(record: bytes) -> bytearray:
    """``record`` as the first format wrote it (``as_version``)."""
    return as_version(record, 1)
