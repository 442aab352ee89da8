"""The record's bytes: encoding a block, checking and decoding a record held whole, and the
checksum (the format is described in ``cachetier.record``). ``reading`` reads a record from a
stream or a file with the same checks, piece by piece."""

from __future__ import annotations

import math
import struct
from collections.abc import Sequence
from enum import IntEnum
from typing import NamedTuple

import lz4.block
import xxhash

from cachetier.errors import CorruptBlockError
from cachetier.primitives.keys import DTYPE_BYTES, HASH_BYTES, BlockHash
from cachetier.record.block import MAX_NDIM, Buffer, KVBlock, checked_block
from cachetier.record.writer import UNKNOWN_WRITER, WRITER_BYTES, writer_of

MAGIC = b"CTKV"
FORMAT_VERSION = 3
_READABLE_VERSIONS = (1, 2, 3)
_WRITER_SINCE = 3  # the first version whose head names its writer
# Version 2's checksum segment: a multiple of the page size, so a segment boundary is a page
# boundary in a file, and small enough that a segment just read is still in cache when hashed.
SEGMENT_BYTES = 512 * 1024

_FIXED = struct.Struct("<4sHBBBBI32s32sIQQ")
_KEY_OFFSET = struct.calcsize("<4sHBBBBI")
_DTYPE_CODES: dict[str, int] = {name: code for code, name in enumerate(sorted(DTYPE_BYTES), 1)}
_DTYPE_NAMES: dict[int, str] = {code: name for name, code in _DTYPE_CODES.items()}


class Compression(IntEnum):
    """How a record's payload is stored."""

    NONE = 0
    LZ4 = 1


def encode_parts(block: KVBlock, compression: Compression = Compression.NONE) -> list[Buffer]:
    """Encode ``block`` as a list of buffers whose concatenation is its record.

    Returning parts lets a file or a socket take them with one vectored write instead of a
    join that copies the payload.

    Args:
        block: the block to encode.
        compression: ``LZ4`` compresses the payload unless that does not make it smaller.

    Returns:
        ``[header, aux, payload]``.
    """
    raw = memoryview(block.data).cast("B")
    payload: Buffer = raw
    used = Compression.NONE
    if compression == Compression.LZ4 and raw.nbytes:
        packed = lz4.block.compress(raw, store_size=False)
        if len(packed) < raw.nbytes:
            payload, used = packed, Compression.LZ4
    ndim = len(block.shape)
    fields = _Header(
        FORMAT_VERSION,
        int(used),
        _DTYPE_CODES[block.dtype],
        ndim,
        block.num_tokens,
        block.key,
        block.fingerprint,
        len(block.aux),
        len(payload),
        raw.nbytes,
        _FIXED.size + 8 * ndim + WRITER_BYTES,
    )
    head = _pack_fixed(fields) + struct.pack(f"<{ndim}Q", *block.shape) + writer_of(block.writer)
    seen = block.verified
    if used == Compression.NONE and seen and seen[0] is block.data and seen[1] is block.aux:
        return [head + seen[2], block.aux, payload]  # the same record: the same checksum
    digest = _Checksum.past_head(FORMAT_VERSION, head, len(head))
    digest.update(block.aux)
    digest.update(payload)
    return [head + digest.digest(), block.aux, payload]


def plain_record_nbytes(block: KVBlock) -> int:
    """The length of ``block``'s uncompressed record (``encode_parts`` with no compression),
    known without hashing its payload: a sender can announce it before encoding the record."""
    return _FIXED.size + 8 * len(block.shape) + WRITER_BYTES + 8 + block.nbytes


def encode_record(block: KVBlock, compression: Compression = Compression.NONE) -> bytes:
    """Encode ``block`` as one record (``cachetier.record`` describes the layout).

    Args:
        block: the block to encode.
        compression: payload compression; falls back to none if it does not help.

    Returns:
        The record bytes.
    """
    return b"".join(encode_parts(block, compression))


def peek_key(record: Buffer) -> BlockHash | None:
    """The key a record claims, without checking it (``None`` if it is too short to say)."""
    view = memoryview(record)
    if view.nbytes < _FIXED.size or bytes(view[:4]) != MAGIC:
        return None
    return BlockHash(bytes(view[_KEY_OFFSET : _KEY_OFFSET + HASH_BYTES]))


PEEK_BYTES = _FIXED.size
"""How many leading bytes of a record the ``peek_*`` functions read."""


def peek_inflated_nbytes(head: Buffer) -> int:
    """Bytes that decoding a record would allocate beyond the record itself, as it claims them,
    unchecked: its raw length when its payload is compressed, else 0 (an uncompressed payload
    is served as a view). A server reserves this much before it decodes an upload.

    Args:
        head: the record, or at least its first ``PEEK_BYTES`` bytes.

    Returns:
        The claimed bytes; 0 when ``head`` is too short or not a record (decoding refuses it).
    """
    view = memoryview(head).cast("B")
    if view.nbytes < _FIXED.size or bytes(view[:4]) != MAGIC:
        return 0
    comp, raw = view[6], _FIXED.unpack_from(view, 0)[-1]
    return raw if comp != Compression.NONE else 0


class _Checksum:
    """A record's checksum, fed the record's bytes in order (``past_head`` steps over its
    checksum field). A version-2 record held whole in one buffer is hashed by the same rule one
    segment per call instead (``_segment_digests``); the tests hold the two equal.

    Args:
        version: the record's format version (``cachetier.record`` gives each rule).
    """

    __slots__ = ("_segmented", "_hash", "_pos", "_digests")

    def __init__(self, version: int) -> None:
        self._segmented = version >= 2
        self._hash = xxhash.xxh3_64()
        self._pos = 0  # offset in the record of the next byte
        self._digests: list[bytes] = []

    @classmethod
    def past_head(cls, version: int, head: Buffer, head_len: int) -> _Checksum:
        """A record's checksum fed its first ``head_len`` bytes (from ``head``) and stepped
        over its checksum field: where every reader and writer starts."""
        digest = cls(version)
        digest.update(memoryview(head)[:head_len])
        digest._pos += 8
        return digest

    def update(self, data: Buffer) -> None:
        view = memoryview(data).cast("B")
        if not self._segmented:
            self._hash.update(view)
            return
        while view.nbytes:
            room = SEGMENT_BYTES - self._pos % SEGMENT_BYTES
            self._hash.update(view[:room])
            self._pos += min(room, view.nbytes)
            view = view[room:]
            if self._pos % SEGMENT_BYTES == 0:
                self._digests.append(self._hash.digest())
                self._hash.reset()

    def digest(self) -> bytes:
        if not self._segmented:
            return self._hash.digest()
        pending = [self._hash.digest()] if self._pos % SEGMENT_BYTES else []
        return _combine([*self._digests, *pending])


def reseal(record: bytearray | memoryview) -> None:
    """Recompute a record's checksum in place, by the rule of the version it carries: for
    tools and tests that edit records on purpose (nothing on a read or write path uses it)."""
    view = memoryview(record).cast("B")
    version, ndim = struct.unpack_from("<H", view, 4)[0], view[8]
    head_len = _head_len(version, ndim)
    view[head_len : head_len + 8] = _whole_checksum(version, view, head_len)


def _head_len(version: int, ndim: int) -> int:
    """Bytes of a record's head before its checksum: the fixed part, the shape and, from
    version 3, the writer id."""
    return _FIXED.size + 8 * ndim + (WRITER_BYTES if version >= _WRITER_SINCE else 0)


def _whole_checksum(version: int, record: memoryview, head_len: int) -> bytes:
    """The checksum of a record held whole in ``record``, by the rule of ``version``."""
    if version >= 2:
        return _combine(_segment_digests(record, 0, record.nbytes, head_len))
    digest = _Checksum.past_head(version, record, head_len)
    digest.update(record[head_len + 8 :])
    return digest.digest()


class _Header(NamedTuple):
    # A tuple, not a frozen dataclass: one is made per record read, and a frozen dataclass's
    # eleven object.__setattr__ calls were a visible part of a small get.
    version: int
    comp: int
    dtype_code: int
    ndim: int
    num_tokens: int
    key: bytes
    fingerprint: bytes
    aux_len: int
    payload_len: int
    raw_len: int
    head_len: int  # bytes before the checksum

    @property
    def total(self) -> int:
        return self.head_len + 8 + self.aux_len + self.payload_len


def _parse_header(view: memoryview, max_raw_bytes: int | None) -> _Header:
    """The fixed header fields of ``view`` (which holds at least ``_FIXED.size`` bytes)."""
    fields = _FIXED.unpack_from(view, 0)
    magic, version, comp, dtype_code, ndim, _pad, num_tokens, key, fp, aux, payload, raw = fields
    if magic != MAGIC:
        raise CorruptBlockError("record has a bad magic number")
    if version not in _READABLE_VERSIONS:
        raise CorruptBlockError(
            f"record format version {version} is not one this reader knows {_READABLE_VERSIONS}"
        )
    if not 0 < ndim <= MAX_NDIM:
        raise CorruptBlockError(f"record claims {ndim} dimensions")
    # Checked here, before anything is read, allocated or decompressed for it: a record that
    # claims an lz4 payload of gigabytes is a few bytes long.
    if max_raw_bytes is not None and raw > max_raw_bytes:
        raise CorruptBlockError(
            f"record claims a payload of {raw} bytes, over the limit of {max_raw_bytes}"
        )
    return _Header(
        version,
        comp,
        dtype_code,
        ndim,
        num_tokens,
        key,
        fp,
        aux,
        payload,
        raw,
        _head_len(version, ndim),
    )


def _build(
    h: _Header,
    head: memoryview,
    aux: memoryview,
    stored: memoryview,
    digest: bytes,
    key: bytes | None,
    fingerprint: bytes | None,
    remember: bool,
) -> KVBlock:
    """Check a record whose parts are read and whose checksum is computed; make its block
    (``remember``: its payload is immutable, so the block may carry the checksum)."""
    if digest != bytes(head[h.head_len : h.head_len + 8]):
        raise CorruptBlockError("record checksum does not match its contents")
    # From here the bytes are as written; what remains is whether they are what was asked for.
    if key is not None and h.key != key:
        raise CorruptBlockError("record belongs to another key")
    if fingerprint is not None and h.fingerprint != fingerprint:
        raise CorruptBlockError("record belongs to another namespace (model, layout or tenant)")
    dtype = _DTYPE_NAMES.get(h.dtype_code)
    if dtype is None:
        raise CorruptBlockError(f"record has an unknown dtype code {h.dtype_code}")
    shape = struct.unpack_from(f"<{h.ndim}Q", head, _FIXED.size)
    if math.prod(shape) * DTYPE_BYTES[dtype] != h.raw_len:
        raise CorruptBlockError(f"record shape {shape} of {dtype} does not match {h.raw_len} bytes")
    if h.comp == Compression.NONE:
        if h.payload_len != h.raw_len:
            raise CorruptBlockError("uncompressed record has a payload of the wrong size")
        data: Buffer = stored
    elif h.comp == Compression.LZ4:
        try:
            data = lz4.block.decompress(stored, uncompressed_size=h.raw_len)
        except lz4.block.LZ4BlockError as exc:
            raise CorruptBlockError(f"lz4 payload does not decompress: {exc}") from None
        except (OverflowError, ValueError, MemoryError):
            # A raw length lz4 cannot take (over 2 GiB) or memory cannot hold, when the caller
            # set no max_raw_bytes: still a bad record, never an error of the reader.
            raise CorruptBlockError(f"lz4 payload of {h.raw_len} bytes cannot be made") from None
        if len(data) != h.raw_len:
            raise CorruptBlockError("lz4 payload decompressed to the wrong size")
    else:
        raise CorruptBlockError(f"record has an unknown compression code {h.comp}")
    if h.num_tokens <= 0:
        raise CorruptBlockError(f"record claims {h.num_tokens} tokens")
    aux_bytes = bytes(aux)
    shape_end = _FIXED.size + 8 * h.ndim
    writer = bytes(head[shape_end : h.head_len]) if h.version >= _WRITER_SINCE else UNKNOWN_WRITER
    verified = None
    if remember and h.comp == Compression.NONE and _canonical(h, head):
        verified = (data, aux_bytes, digest)
    # Every check of KVBlock's own is made above or on the fixed header: the key and the
    # fingerprint are 32 bytes by the header's format, its ndim in 1..MAX_NDIM
    # (_parse_header), the shape's dimensions unsigned, and the payload its product's bytes.
    return checked_block(
        BlockHash(h.key),
        h.fingerprint,
        dtype,
        shape,
        h.num_tokens,
        data,
        aux_bytes,
        verified,
        h.version,
        writer,
        h.raw_len + len(aux_bytes),
    )


def _pack_fixed(h: _Header) -> bytes:
    """The fixed part of the head ``encode_parts`` writes for these fields."""
    return _FIXED.pack(
        MAGIC,
        FORMAT_VERSION,
        h.comp,
        h.dtype_code,
        h.ndim,
        0,
        h.num_tokens,
        h.key,
        h.fingerprint,
        h.aux_len,
        h.payload_len,
        h.raw_len,
    )


def _canonical(h: _Header, head: memoryview) -> bool:
    """Whether ``encode_parts`` would write exactly this head again (a record may differ in
    bytes the reader ignores, e.g. the pad byte; its checksum must then not be reused)."""
    return head[: _FIXED.size] == _pack_fixed(h)


def decode_record(
    record: Buffer,
    *,
    key: bytes | None = None,
    fingerprint: bytes | None = None,
    max_raw_bytes: int | None = None,
) -> KVBlock:
    """Decode and check a record.

    Args:
        record: the record bytes; an uncompressed payload is returned as a view into it.
        key: the key the caller asked for; a record naming another key is rejected.
        fingerprint: the namespace fingerprint the caller expects, if it knows one.
        max_raw_bytes: largest payload (decompressed) accepted; a record claiming more is
            refused before anything is decompressed. ``None`` for no limit (records a tier
            wrote itself); a server passes its own limit for uploads.

    Returns:
        The block.

    Raises:
        CorruptBlockError: truncated or oversized record, bad magic, unknown version, dtype or
            compression, inconsistent sizes, a payload over ``max_raw_bytes``, bad checksum, or
            another key / fingerprint.
    """
    view = memoryview(record).cast("B") if not isinstance(record, bytes) else memoryview(record)
    if view.nbytes < _FIXED.size:
        raise CorruptBlockError(f"record of {view.nbytes} bytes is shorter than its header")
    h = _parse_header(view, max_raw_bytes)
    if view.nbytes != h.total:
        raise CorruptBlockError(f"record is {view.nbytes} bytes, its header claims {h.total}")
    body = h.head_len + 8
    return _build(
        h,
        view[:body],
        view[body : body + h.aux_len],
        view[body + h.aux_len :],
        _whole_checksum(h.version, view, h.head_len),
        key,
        fingerprint,
        view.readonly,  # a buffer its owner may still write to: no checksum kept
    )


def _segment_digests(record: memoryview, start: int, end: int, head_len: int) -> list[bytes]:
    """The digests of a version-2 record's segments from ``start`` (a segment boundary) to
    ``end`` (one, or the record's end), all held in ``record`` from its first byte: one xxh3
    call per segment, segment 0 stepping over the checksum field (``_Checksum``'s rule for a
    record fed as a stream)."""
    out: list[bytes] = []
    for at in range(start, end, SEGMENT_BYTES):
        until = min(at + SEGMENT_BYTES, end)
        if at:
            out.append(xxhash.xxh3_64(record[at:until]).digest())
        else:
            first = xxhash.xxh3_64(record[:head_len])
            first.update(record[head_len + 8 : until])
            out.append(first.digest())
    return out


def _combine(digests: Sequence[bytes]) -> bytes:
    """A version-2 record's checksum from its segments' digests."""
    return xxhash.xxh3_64(b"".join(digests)).digest()


def record_checksum(parts: Sequence[Buffer]) -> bytes:
    """The checksum of a record given as parts (``encode_parts``): the last 8 bytes of its
    head. Equal checksums mean equal records (up to xxh3-64 collisions)."""
    return bytes(memoryview(parts[0])[-8:])


def record_nbytes(parts: Sequence[Buffer]) -> int:
    """Total length of a record given as parts."""
    return sum(memoryview(p).nbytes for p in parts)
