"""The HTTP API's batch framing, shared by the server and the remote tier (stdlib and numpy only).

A batch of block records travels as one ``application/x-cachetier-batch`` body::

    magic "CTB1" | num_records u32 | num_records x length u64 | record 0 | record 1 | ...

little-endian, each record a ``cachetier.record`` record (it carries its own key, checksum and
namespace fingerprint), a length of 0 standing for a miss. The lengths come first so a reader
can refuse an oversized batch before reading it and give every record a buffer of its own:
a block kept by a CPU tier then pins its own bytes, not the whole batch it arrived in.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

import numpy as np

from cachetier.record import Buffer

BATCH_MEDIA_TYPE = "application/x-cachetier-batch"
RECORD_MEDIA_TYPE = "application/octet-stream"
BATCH_MAGIC = b"CTB1"

_COUNT = struct.Struct("<4sI")


class FrameError(ValueError):
    """A batch body that does not follow the framing (bad magic, truncated, trailing bytes)."""


class FrameTooLargeError(FrameError):
    """A batch, or one record in it, is larger than the reader's limits allow."""


def batch_parts(records: Sequence[Sequence[Buffer] | None]) -> tuple[list[Buffer], int]:
    """Frame records for sending, without joining them.

    Args:
        records: per record its parts (``encode_parts``) or ``None`` for a miss.

    Returns:
        The buffers to send in order, and their total length in bytes.
    """
    lengths = [
        0 if parts is None else sum(memoryview(p).nbytes for p in parts) for parts in records
    ]
    head = _COUNT.pack(BATCH_MAGIC, len(lengths)) + struct.pack(f"<{len(lengths)}Q", *lengths)
    out: list[Buffer] = [head]
    for parts in records:
        if parts is not None:
            out.extend(p for p in parts if memoryview(p).nbytes)
    return out, len(head) + sum(lengths)


class BatchReader:
    """Parses a batch body fed in chunks of any size, one buffer per record.

    Args:
        max_records: most records a batch may hold.
        max_record_bytes: largest record.
        max_batch_bytes: largest whole body, framing included.
    """

    def __init__(self, *, max_records: int, max_record_bytes: int, max_batch_bytes: int) -> None:
        self._max_records = max_records
        self._max_record_bytes = max_record_bytes
        self._max_batch_bytes = max_batch_bytes
        self._head = bytearray()
        self._lengths: list[int] | None = None
        self._records: list[memoryview | None] = []
        self._buf: memoryview | None = None  # the record being filled
        self._filled = 0
        self._seen = 0

    @property
    def lengths(self) -> list[int] | None:
        """Record lengths once the framing head has been read."""
        return self._lengths

    def feed(self, chunk: Buffer) -> None:
        """Take the next bytes of the body.

        Raises:
            FrameError: the bytes cannot belong to a valid batch.
            FrameTooLargeError: the batch or a record exceeds the limits.
        """
        view = memoryview(chunk).cast("B")
        self._seen += view.nbytes
        if self._seen > self._max_batch_bytes:
            raise FrameTooLargeError(f"batch is larger than {self._max_batch_bytes} bytes")
        while view.nbytes:
            if self._lengths is None:
                view = self._feed_head(view)
                continue
            if self._buf is None:
                raise FrameError(f"batch has bytes after its {len(self._lengths)} records")
            n = min(view.nbytes, self._buf.nbytes - self._filled)
            self._buf[self._filled : self._filled + n] = view[:n]
            self._filled += n
            view = view[n:]
            if self._filled == self._buf.nbytes:
                # Read-only: a tier that keeps the block may then hold the buffer as it is.
                self._records.append(self._buf.toreadonly())
                self._next_record()

    def _feed_head(self, view: memoryview) -> memoryview:
        need = _COUNT.size if len(self._head) < _COUNT.size else self._head_size()
        take = min(need - len(self._head), view.nbytes)
        self._head += view[:take]
        if len(self._head) == _COUNT.size:
            magic, count = _COUNT.unpack(self._head)
            if magic != BATCH_MAGIC:
                raise FrameError(f"batch must start with {BATCH_MAGIC!r}, got {bytes(magic)!r}")
            if count > self._max_records:
                raise FrameTooLargeError(
                    f"batch holds {count} records, at most {self._max_records} are allowed"
                )
        if len(self._head) >= _COUNT.size and len(self._head) == self._head_size():
            self._start_records()
        return view[take:]

    def _head_size(self) -> int:
        return _COUNT.size + 8 * _COUNT.unpack_from(self._head)[1]

    def _start_records(self) -> None:
        count = _COUNT.unpack_from(self._head)[1]
        lengths = list(struct.unpack_from(f"<{count}Q", self._head, _COUNT.size))
        for i, length in enumerate(lengths):
            if length > self._max_record_bytes:
                raise FrameTooLargeError(
                    f"record {i} is {length} bytes, at most {self._max_record_bytes} are allowed"
                )
        total = len(self._head) + sum(lengths)
        if total > self._max_batch_bytes:
            raise FrameTooLargeError(
                f"batch is {total} bytes, at most {self._max_batch_bytes} are allowed"
            )
        self._lengths = lengths
        self._next_record()

    def _next_record(self) -> None:
        assert self._lengths is not None, "records start after the head"
        while len(self._records) < len(self._lengths) and self._lengths[len(self._records)] == 0:
            self._records.append(None)
        self._filled = 0
        if len(self._records) == len(self._lengths):
            self._buf = None
        else:
            size = self._lengths[len(self._records)]
            # np.empty: no zero-filling of memory that is overwritten at once.
            self._buf = memoryview(np.empty(size, dtype=np.uint8)).cast("B")

    def finish(self) -> list[memoryview | None]:
        """The records, once the whole body has been fed.

        Returns:
            One read-only buffer per record, ``None`` where the length was 0.

        Raises:
            FrameError: the body ended early.
        """
        if self._lengths is None:
            raise FrameError(f"batch ended after {self._seen} bytes, inside its head")
        if self._buf is not None:
            expected = len(self._head) + sum(self._lengths)
            raise FrameError(f"batch ended after {self._seen} of {expected} bytes")
        return self._records
