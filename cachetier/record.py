"""The self-describing binary record every tier stores a block as.

Layout (little-endian)::

    magic "CTKV" | version u16 | compression u8 | dtype u8 | ndim u8 | pad u8 | num_tokens u32
    key 32B | namespace fingerprint 32B | aux_len u32 | payload_len u64 | raw_len u64
    shape ndim x u64 | checksum u64 | aux (aux_len B) | payload (payload_len B)

The checksum covers every byte of the record but itself, so a torn write, a flipped bit or a
truncated file is always caught. The key and the fingerprint are checked against what the
caller asked for, so a record can never be served under another key or another model.

Version 2 (written since 2026-11-26): the record is cut into ``SEGMENT_BYTES`` segments at fixed
offsets from its first byte (the checksum field's 8 bytes are left out of the first), each is
hashed with xxh3-64, and the checksum is the xxh3-64 of those digests in order. A large record
can then be read on two threads that each hash the segments they read while those are still in
their own core's cache: one stream over the whole record made the second thread's share be
hashed again, out of cache, by the first (16 SmolLM2 records one per call: 17.7-18.5 ms
against 13.7-13.9 segmented, on this project's 2-core machine). Version 1 (one xxh3-64 over the
record but the checksum field) is still read; a version-1 reader refuses version 2 as unknown,
a clean miss.
"""

from __future__ import annotations

import math
import operator
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any, NamedTuple

import lz4.block
import xxhash

from cachetier import buffers, parallel
from cachetier.errors import CorruptBlockError
from cachetier.keys import DTYPE_BYTES, HASH_BYTES, BlockHash
from cachetier.landing import Destination, flat, parts

MAGIC = b"CTKV"
FORMAT_VERSION = 2
_READABLE_VERSIONS = (1, 2)
# Version 2's checksum segment: a multiple of the page size, so a segment boundary is a page
# boundary in a file, and small enough that a segment just read is still in cache when hashed.
SEGMENT_BYTES = 512 * 1024
MAX_NDIM = 8

_FIXED = struct.Struct("<4sHBBBBI32s32sIQQ")
_KEY_OFFSET = struct.calcsize("<4sHBBBBI")
_DTYPE_CODES: dict[str, int] = {name: code for code, name in enumerate(sorted(DTYPE_BYTES), 1)}
_DTYPE_NAMES: dict[int, str] = {code: name for name, code in _DTYPE_CODES.items()}


class Compression(IntEnum):
    """How a record's payload is stored."""

    NONE = 0
    LZ4 = 1


Buffer = bytes | bytearray | memoryview


@dataclass(frozen=True, slots=True)
class KVBlock:
    """One full block of KV as the tiers see it: raw bytes plus what they claim to be.

    Args:
        key: the block's key (``cachetier.keys``).
        fingerprint: the namespace fingerprint the key was computed under.
        dtype: element type name of ``data``.
        shape: shape of ``data`` in elements; its product times the dtype size is its length.
        num_tokens: tokens the block covers (the layout's block size for a full block).
        data: the raw payload. May be a read-only buffer shared with a tier: copy it before
            writing to it.
        aux: small side data that travels with the payload (e.g. fp8 scales), ``b""`` if none.
        verified: set by the record readers only: ``(data, aux, checksum)`` of the
            uncompressed record this block was read from and checked against, so encoding it
            again (a server answering a get) need not hash the payload again. It counts only
            while ``data`` and ``aux`` are still those very objects.
    """

    key: BlockHash
    fingerprint: bytes
    dtype: str
    shape: tuple[int, ...]
    num_tokens: int
    data: Buffer
    aux: Buffer = b""
    verified: tuple[Buffer, Buffer, bytes] | None = field(default=None, compare=False, repr=False)

    # Payload plus side data, counted once here: a connector's small gets read it per block.
    _nbytes: int = field(default=0, init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        if len(self.key) != HASH_BYTES or len(self.fingerprint) != HASH_BYTES:
            raise ValueError(f"key and fingerprint must be {HASH_BYTES} bytes each")
        itemsize = DTYPE_BYTES.get(self.dtype)
        if itemsize is None:
            raise ValueError(f"dtype {self.dtype!r} is not one of {sorted(DTYPE_BYTES)}")
        shape = self.shape
        if not 0 < len(shape) <= MAX_NDIM or min(shape) < 0:
            raise ValueError(f"shape {shape} must have 1..{MAX_NDIM} non-negative dims")
        size = memoryview(self.data).nbytes
        if size != math.prod(shape) * itemsize:
            raise ValueError(
                f"data has {size} bytes, shape {shape} of {self.dtype} needs "
                f"{math.prod(shape) * itemsize}"
            )
        if self.num_tokens <= 0:
            raise ValueError(f"num_tokens must be positive, got {self.num_tokens}")
        object.__setattr__(self, "_nbytes", size + len(self.aux))

    @property
    def nbytes(self) -> int:
        """Bytes of payload and side data (what capacities count for in-memory tiers)."""
        return self._nbytes

    def landed_in(self, data: memoryview) -> KVBlock:
        """This block with its payload in ``data``, which holds the same bytes (a copy landed
        there): its checks are not run again, only the length is compared.

        Raises:
            ValueError: ``data`` is not the payload's length.
        """
        if data.nbytes != self._nbytes - len(self.aux):
            raise ValueError(f"{data.nbytes} bytes for a payload of {self._nbytes - len(self.aux)}")
        block = object.__new__(KVBlock)
        # Every slot but these two is copied, so a field added later is not left unset.
        for slot, value in zip(_KEPT_SLOTS, _get_kept(self)):
            slot.__set__(block, value)
        _DATA_SLOT.__set__(block, data)
        _VERIFIED_SLOT.__set__(block, None)  # a checksum is kept only for its own data
        return block


# ``landed_in``'s copy of a block: the slot descriptors of every field but the two it replaces,
# read in one call (half the cost of a getattr/setattr pair per field, measured per block).
_REPLACED_SLOTS = ("data", "verified")
_KEPT_SLOTS = tuple(
    getattr(KVBlock, name) for name in KVBlock.__slots__ if name not in _REPLACED_SLOTS
)
_get_kept = operator.attrgetter(*(n for n in KVBlock.__slots__ if n not in _REPLACED_SLOTS))
_DATA_SLOT, _VERIFIED_SLOT = (getattr(KVBlock, name) for name in _REPLACED_SLOTS)
_SET_SLOTS = tuple(getattr(KVBlock, name).__set__ for name in KVBlock.__slots__)


def _checked_block(*values: Any) -> KVBlock:
    """A ``KVBlock`` of ``values`` (every slot, in order, ``_nbytes`` last) made without
    ``__post_init__``: for ``_build``, which checked all that it checks on the record's head.
    A frozen dataclass sets each field through ``object.__setattr__`` and then the checks
    ran a second time: together a tenth of a connector's one-block disk get."""
    block = object.__new__(KVBlock)
    for set_slot, value in zip(_SET_SLOTS, values, strict=True):
        set_slot(block, value)
    return block


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
        _FIXED.size + 8 * ndim,
    )
    head = _pack_fixed(fields) + struct.pack(f"<{ndim}Q", *block.shape)
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
    return _FIXED.size + 8 * len(block.shape) + 8 + block.nbytes


def encode_record(block: KVBlock, compression: Compression = Compression.NONE) -> bytes:
    """Encode ``block`` as one record (see the module docstring for the layout).

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
        version: the record's format version (see the module docstring for each rule).
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
    head_len = _FIXED.size + 8 * ndim
    view[head_len : head_len + 8] = _whole_checksum(version, view, head_len)


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
        _FIXED.size + 8 * ndim,
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
    verified = None
    if remember and h.comp == Compression.NONE and _canonical(h, head):
        verified = (data, aux_bytes, digest)
    # Every check of KVBlock's own is made above or on the fixed header: the key and the
    # fingerprint are 32 bytes by the header's format, its ndim in 1..MAX_NDIM
    # (_parse_header), the shape's dimensions unsigned, and the payload its product's bytes.
    return _checked_block(
        BlockHash(h.key),
        h.fingerprint,
        dtype,
        shape,
        h.num_tokens,
        data,
        aux_bytes,
        verified,
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


# The first read of a record read whole: its head (and whatever follows) up to a page boundary.
_PAGE = 4096
assert _FIXED.size + 8 * MAX_NDIM + 8 <= _PAGE, "a record's head must fit its first page"
# Small enough to still sit in cache when it is checksummed, large enough to keep syscalls few
# (5.6 MiB records from the page cache: 1 MiB measured ~5% faster than 256 KiB).
_READ_CHUNK = 1 << 20
assert _READ_CHUNK % SEGMENT_BYTES == 0, "a whole record's reads end on segment boundaries"
# A record read whole with a positional reader at hand reads part of itself on another thread
# from this size on (hand-off ~50 us). Measured on this machine, 16 records of 5.6 MiB from the
# page cache, one per call: 13.9-15.1 ms on the caller's thread alone (the copy runs at one
# core's memory bandwidth), 11.3-12.6 ms split.
_SPLIT_READ_BYTES = 2 << 20


def _read_exactly(
    readinto: Callable[[memoryview], int],
    dest: memoryview,
    digest: _Checksum | None,
    expected: int,
) -> None:
    got = 0
    while got < dest.nbytes:
        n = readinto(dest[got : got + _READ_CHUNK])
        if n <= 0:
            raise CorruptBlockError(f"record ended {dest.nbytes - got} bytes short of {expected}")
        if digest is not None:
            digest.update(dest[got : got + n])
        got += n


def _pread_exactly(
    pread: Callable[[memoryview, int], int], dest: memoryview, offset: int, expected: int
) -> None:
    got = 0
    while got < dest.nbytes:
        n = pread(dest[got:], offset + got)
        if n <= 0:
            raise CorruptBlockError(f"record ended {dest.nbytes - got} bytes short of {expected}")
        got += n


def read_record(
    readinto: Callable[[memoryview], int],
    size: int,
    *,
    key: bytes | None = None,
    fingerprint: bytes | None = None,
    payload_into: Destination | None = None,
    max_raw_bytes: int | None = None,
    trusted_size: bool = False,
    pread: Callable[[memoryview, int], int] | None = None,
) -> KVBlock:
    """Read a ``size``-byte record through ``readinto`` and decode it.

    The checksum is computed chunk by chunk right after each chunk is read, while it is still
    in the CPU cache, instead of in a second pass over the whole buffer; the buffer is
    allocated without zero-filling. Both matter for multi-megabyte blocks.

    Args:
        readinto: reads into the given buffer and returns the byte count (0 at end of file),
            like ``os.readv(fd, [buf])`` or ``file.readinto``.
        size: the record's length (the file's size).
        key: the key asked for.
        fingerprint: the namespace fingerprint expected, if known.
        payload_into: writable bytes the payload is read straight into (e.g. a KV pool block),
            or ``Runs`` each run is read to, when the record is uncompressed and exactly that
            size; otherwise ignored. If the record then fails a check, this memory holds
            garbage and must not be used.
        max_raw_bytes: as ``decode_record``: checked on the fixed header, before the rest of
            the record is read.
        trusted_size: ``size`` is the source's true length (a file's, from ``fstat``), never
            a length a peer claims: with no ``payload_into``, the record is then read whole
            into one page-aligned buffer from its first byte, so every byte lies at the same
            offset within a page as in the file and the kernel's copy runs aligned on both
            sides (a payload read alone starts a few dozen bytes into a page: measured ~20%
            slower per 5.6 MiB record).
        pread: reads into the given buffer from the given offset of the same source without
            moving ``readinto``'s position (``os.preadv``). With it, a large record read whole
            has the later half of its checksum segments read and hashed on another thread
            (``parallel.beside``) while this one reads and hashes the earlier half (version-2
            records; a version-1 record is read on this thread alone).

    Returns:
        The block. Its payload is ``payload_into`` when that was used, else a read-only view of
        a buffer nobody else holds (a tier that keeps it, like a promotion into the CPU tier,
        can hold it as it is instead of copying it).

    Raises:
        CorruptBlockError: as ``decode_record``, or if fewer than ``size`` bytes could be read.
    """
    if size < _FIXED.size:
        raise CorruptBlockError(f"record of {size} bytes is shorter than its header")
    whole = trusted_size and payload_into is None
    if whole and pread is not None and size <= _READ_CHUNK:
        return _read_small_whole(pread, size, key, fingerprint, max_raw_bytes)
    # Read whole, the first page comes in one read (the head always fits it); else only the
    # fixed header, since a peer's claimed size is not to be read ahead into.
    fixed = memoryview(bytearray(min(size, _PAGE) if whole else _FIXED.size))
    _read_exactly(readinto, fixed, None, size)
    h = _parse_header(fixed, max_raw_bytes)
    # Checked before anything of that size is allocated or read.
    if h.total != size:
        raise CorruptBlockError(f"record is {size} bytes, its header claims {h.total}")
    if whole:
        return _read_rest_whole(readinto, fixed, h, key, fingerprint, pread)
    body = h.head_len + 8
    head = memoryview(bytearray(body))
    head[: _FIXED.size] = fixed
    _read_exactly(readinto, head[_FIXED.size :], None, size)
    digest = _Checksum.past_head(h.version, head, h.head_len)
    aux = memoryview(bytearray(h.aux_len))
    _read_exactly(readinto, aux, digest, size)
    direct = (
        payload_into is not None
        and h.comp == Compression.NONE
        and flat(payload_into).nbytes == h.payload_len
    )
    if direct:
        stored = flat(payload_into)  # type: ignore[arg-type]
        for run in parts(payload_into):  # type: ignore[arg-type]
            _read_exactly(readinto, run, digest, size)
    else:
        stored = memoryview(buffers.take(h.payload_len)).cast("B")  # recycled: no page faults
        _read_exactly(readinto, stored, digest, size)
        stored = stored.toreadonly()
    return _build(h, head, aux, stored, digest.digest(), key, fingerprint, not direct)


def _read_small_whole(
    pread: Callable[[memoryview, int], int],
    size: int,
    key: bytes | None,
    fingerprint: bytes | None,
    max_raw_bytes: int | None,
) -> KVBlock:
    """A record of a true ``size`` of at most ``_READ_CHUNK``, read with positional reads
    straight into one recycled buffer (page-aligned, like the file's first byte), and hashed
    while still in cache: its first page, whose header is checked before anything more is
    read, then the rest in one read. A connector's one-block get pays for every Python step
    (this path took ~4 us off a 512 KiB get from the page cache). The first page is read apart
    on purpose: one read of a whole cold record took 1.6x as long (16 of 512 KiB: 8.7 against
    5.5 ms), the kernel's readahead serving a small first read better."""
    whole = memoryview(buffers.take(size)).cast("B")
    first = min(size, _PAGE)
    _pread_exactly(pread, whole[:first], 0, size)
    h = _parse_header(whole, max_raw_bytes)
    if h.total != size:  # before the head's lengths are used to slice anything
        raise CorruptBlockError(f"record is {size} bytes, its header claims {h.total}")
    _pread_exactly(pread, whole[first:], first, size)
    body = h.head_len + 8
    payload_at = body + h.aux_len
    return _build(
        h,
        whole[:body],
        whole[body:payload_at],
        whole[payload_at:].toreadonly(),
        _whole_checksum(h.version, whole, h.head_len),
        key,
        fingerprint,
        True,
    )


def _read_rest_whole(
    readinto: Callable[[memoryview], int],
    page: memoryview,
    h: _Header,
    key: bytes | None,
    fingerprint: bytes | None,
    pread: Callable[[memoryview, int], int] | None,
) -> KVBlock:
    """The rest of a record of a true size whose first ``page`` is read and its header ``h``
    checked, into one recycled buffer holding the whole record (see ``read_record``)."""
    size, first = h.total, page.nbytes
    whole = memoryview(buffers.take(size)).cast("B")  # page-aligned, like the file's first byte
    whole[:first] = page
    body = h.head_len + 8  # <= first: the head always fits the first page (asserted above)
    if h.version < 2:  # one checksum stream: read and hashed in order on this thread
        digest = _Checksum.past_head(h.version, whole, h.head_len)
        digest.update(whole[body:first])
        _read_exactly(readinto, whole[first:], digest, size)
        checksum = digest.digest()
    else:
        checksum = _read_segments_whole(readinto, whole, first, h.head_len, pread)
    payload_at = body + h.aux_len
    return _build(
        h,
        whole[:body],
        whole[body:payload_at],
        whole[payload_at:].toreadonly(),
        checksum,
        key,
        fingerprint,
        True,
    )


def _read_segments_whole(
    readinto: Callable[[memoryview], int],
    whole: memoryview,
    first: int,
    head_len: int,
    pread: Callable[[memoryview, int], int] | None,
) -> bytes:
    """Read a version-2 record's bytes from ``first`` on into ``whole`` and return its checksum.

    Reads end on segment boundaries, and the segments each read completes are hashed right
    after it, while still in cache, one call per segment (a connector's small get pays for
    every Python step here). From ``_SPLIT_READ_BYTES`` on, with ``pread``, the later half of
    the segments (whole ones, from a segment boundary, which is a page boundary in the file and
    the buffer alike) is read and hashed on a data thread while this one does the earlier half.
    """
    size = whole.nbytes
    helper = None
    stop = size
    if pread is not None and size - first >= _SPLIT_READ_BYTES:
        num_segments = -(-size // SEGMENT_BYTES)
        cut = (num_segments + 1) // 2 * SEGMENT_BYTES  # > first: the record is >= 2 MiB
        helper = parallel.beside(lambda: _pread_segments(pread, whole, cut, head_len))
        if helper is not None:
            stop = cut
    # Beside a helper, one segment a read: its hash then runs from this core's L2 (1 MiB here)
    # while the helper fills the other's. Bench-peers, SmolLM2 one chunk a call, five runs of
    # each: 0.93-0.98 of LMCache's with 1 MiB reads, 0.99-1.02 with 512 KiB. Alone (a batch's
    # records, one per data thread) the fewer calls of 1 MiB reads won (5.16 against 5.37 ms).
    step = SEGMENT_BYTES if helper is not None else _READ_CHUNK
    digests: list[bytes] = []
    try:
        start, pos = 0, first  # the first read completes segment 0, whose head is already in
        while start < stop:
            end = min(stop, start + step)
            _read_exactly(readinto, whole[pos:end], None, size)
            digests.extend(_segment_digests(whole, start, end, head_len))
            start = pos = end
    finally:
        # Always waited for: the buffer goes back to the recycler with the caller's frame, and
        # the helper must not be writing into it then.
        tail_error = None if helper is None else helper.exception()
    if tail_error is not None:
        raise tail_error
    if helper is not None:
        digests.extend(helper.result())
    return _combine(digests)


def _pread_segments(
    pread: Callable[[memoryview, int], int], whole: memoryview, cut: int, head_len: int
) -> list[bytes]:
    """Read ``whole`` (a record held from its first byte) from ``cut`` (a segment boundary) on,
    one segment per read, and hash each once it is in."""
    size = whole.nbytes
    digests: list[bytes] = []
    for start in range(cut, size, SEGMENT_BYTES):
        end = min(start + SEGMENT_BYTES, size)
        _pread_exactly(pread, whole[start:end], start, size)
        digests.extend(_segment_digests(whole, start, end, head_len))
    return digests


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


def byte_view(buffer: Buffer) -> memoryview:
    """``buffer`` as flat bytes; a view that already is one is returned itself, so a caller can
    tell by identity that its buffer was filled."""
    if type(buffer) is bytes:  # the common case, first: a connector's small get lands many
        return memoryview(buffer)
    view = memoryview(buffer) if not isinstance(buffer, memoryview) else buffer
    if view.format == "B" and view.ndim == 1:
        return view
    return view.cast("B")


def record_checksum(parts: Sequence[Buffer]) -> bytes:
    """The checksum of a record given as parts (``encode_parts``): the last 8 bytes of its
    head. Equal checksums mean equal records (up to xxh3-64 collisions)."""
    return bytes(memoryview(parts[0])[-8:])


def record_nbytes(parts: Sequence[Buffer]) -> int:
    """Total length of a record given as parts."""
    return sum(memoryview(p).nbytes for p in parts)
