"""Reading a record through a caller's read functions (a file's, a socket's), checked as it
arrives: the header before anything of the sizes it claims is allocated, each checksum segment
right after it is read, while it is still in cache; a large file's record on two threads."""

from __future__ import annotations

from collections.abc import Callable

from cachetier.errors import CorruptBlockError
from cachetier.record.block import KVBlock
from cachetier.record.codec import (
    _FIXED,
    MAX_NDIM,
    SEGMENT_BYTES,
    Compression,
    _build,
    _Checksum,
    _combine,
    _Header,
    _parse_header,
    _segment_digests,
    _whole_checksum,
)
from cachetier.record.writer import WRITER_BYTES
from cachetier.util import buffers, parallel
from cachetier.util.landing import Destination, flat, parts

# The first read of a record read whole: its head (and whatever follows) up to a page boundary.
_PAGE = 4096
assert _FIXED.size + 8 * MAX_NDIM + WRITER_BYTES + 8 <= _PAGE, (
    "a record's head must fit its first page"
)
# Small enough to still sit in the last-level cache when it is checksummed, large enough to
# keep syscalls few: for multi-megabyte records from the page cache, 2 MiB chunks beat both
# smaller ones and 4 MiB (the peers benchmark's disk reads agree).
_READ_CHUNK = 2 << 20
assert _READ_CHUNK % SEGMENT_BYTES == 0, "a whole record's reads end on segment boundaries"
# A record read whole with a positional reader at hand reads part of itself on another thread
# from this size on: one thread's copy runs at one core's memory bandwidth, and past this size
# a second thread wins more than the hand-off costs.
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
    return _read_rest_in_parts(readinto, fixed, h, key, fingerprint, payload_into)


def _read_rest_in_parts(
    readinto: Callable[[memoryview], int],
    fixed: memoryview,
    h: _Header,
    key: bytes | None,
    fingerprint: bytes | None,
    payload_into: Destination | None,
) -> KVBlock:
    """The rest of a record whose ``fixed`` header is read and its header ``h`` checked, read
    part by part (head, aux, payload), each allocated only once the one before it is in; the
    payload straight into ``payload_into`` when it fits (see ``read_record``)."""
    size = h.total
    head = memoryview(bytearray(h.head_len + 8))
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
    read, then the rest in one read. A connector's one-block get pays for every Python step,
    so this path keeps them few. The first page is read apart on purpose: one read of a whole
    cold record is markedly slower, the kernel's readahead serving a small first read better."""
    whole = memoryview(buffers.take(size)).cast("B")
    first = min(size, _PAGE)
    _pread_exactly(pread, whole[:first], 0, size)
    h = _parse_header(whole, max_raw_bytes)
    if h.total != size:  # before the head's lengths are used to slice anything
        raise CorruptBlockError(f"record is {size} bytes, its header claims {h.total}")
    _pread_exactly(pread, whole[first:], first, size)
    return _build_whole(h, whole, _whole_checksum(h.version, whole, h.head_len), key, fingerprint)


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
    return _build_whole(h, whole, checksum, key, fingerprint)


def _build_whole(
    h: _Header, whole: memoryview, checksum: bytes, key: bytes | None, fingerprint: bytes | None
) -> KVBlock:
    """``_build`` of a record read whole into a recycled buffer nobody else holds: its payload
    handed out read-only, so the block may carry the checksum."""
    body = h.head_len + 8
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
    # records, one per data thread) fewer, larger reads win (see _READ_CHUNK).
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
