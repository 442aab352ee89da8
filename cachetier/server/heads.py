"""Where a request head ends in the bytes a connection reads, and whether it fits the head cap.

Sans-IO: the guarded HTTP protocol (``httpserver``) asks, before it hands bytes to the parser,
how many of them belong to the head being read. It then feeds the parser the head alone, so a
second head that arrives behind the first in the same read (pipelined) is measured from its own
first byte, not hidden behind the first one's end.
"""

from __future__ import annotations

from cachetier.util.checks import positive_int

_END = b"\r\n\r\n"  # the blank line that ends a head


class HeadCap:
    """The raw bytes of the head being read, across reads, against ``max_head_bytes``.

    Args:
        max_head_bytes: largest head, request line and blank line included.
    """

    __slots__ = ("_max", "_tail", "num_bytes")

    def __init__(self, max_head_bytes: int) -> None:
        positive_int("max_head_bytes", max_head_bytes)
        self._max = max_head_bytes
        self.num_bytes = 0  # of the head being read, so far
        self._tail = b""  # its last 3 bytes: its end may straddle two reads

    def reset(self) -> None:
        """A new head begins (the parser finished the one before)."""
        self.num_bytes = 0
        self._tail = b""

    def take(self, data: bytes | memoryview) -> int | None:
        """Count the bytes of ``data`` that belong to the head being read.

        Args:
            data: bytes just read, the first of them part of the head.

        Returns:
            How many of ``data``'s first bytes are head (up to its blank line, or all of
            ``data`` if it does not end there), counted; ``None`` when the head passes
            ``max_head_bytes`` (nothing counted: refuse it).
        """
        allowed = self._max - self.num_bytes
        # Only as far as the cap could reach: a 64 KiB read is not copied to find a 40 B head.
        window = self._tail + bytes(data[: max(allowed, 0) + len(_END)])
        end = window.find(_END)
        if end >= 0:
            size = end + len(_END) - len(self._tail)
            if size > allowed:
                return None
            self._count(data, size)
            return size
        if len(data) > allowed:
            return None
        self._count(data, len(data))
        return len(data)

    def charge(self, data: bytes | memoryview) -> None:
        """Count all of ``data`` as head: the parser was fed it without a look (the end of a
        chunked body and the start of the next head), so it counts as if all were head."""
        self._count(data, len(data))

    def _count(self, data: bytes | memoryview, size: int) -> None:
        self.num_bytes += size
        self._tail = (self._tail + bytes(data[max(0, size - 3) : size]))[-3:]


def body_length(headers: list[tuple[bytes, bytes]]) -> int | None:
    """Where a request's body ends after its head: its Content-Length (the parser has checked
    it).

    Args:
        headers: its headers, names in lower case.

    Returns:
        The length; ``None`` without one, or with a Transfer-Encoding (which wins over it:
        the parser finds the end of a chunked body).
    """
    if any(name == b"transfer-encoding" for name, _ in headers):
        return None
    for name, value in headers:
        if name == b"content-length" and value.strip().isdigit():
            return int(value)
    return None
