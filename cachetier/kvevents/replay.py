"""The publisher's replay buffer: the latest batches, bounded in count and in bytes."""

from __future__ import annotations

from collections import deque
from itertools import islice

from cachetier.util.checks import positive_int


class ReplayBuffer:
    """The last batches sent, oldest first, for subscribers that missed some.

    A snapshot of a large disk tier is many batches of many keys, so the buffer is bounded in
    bytes as well as in batches: the oldest batches leave first. Not thread-safe: the
    publisher's thread owns it.

    Args:
        max_batches: most batches kept.
        max_bytes: most payload bytes kept (the newest batch is kept even when larger).
    """

    def __init__(self, max_batches: int, max_bytes: int) -> None:
        self.max_batches = positive_int("max_batches", max_batches)
        self.max_bytes = positive_int("max_bytes", max_bytes)
        self._batches: deque[tuple[int, bytes]] = deque()
        self._num_bytes = 0

    def __len__(self) -> int:
        return len(self._batches)

    @property
    def num_bytes(self) -> int:
        return self._num_bytes

    @property
    def first_seq(self) -> int | None:
        """The oldest sequence number still held, ``None`` when empty."""
        return self._batches[0][0] if self._batches else None

    def append(self, seq: int, payload: bytes) -> None:
        """Keep a sent batch; sequence numbers must increase (they may skip)."""
        assert not self._batches or seq > self._batches[-1][0], "sequence numbers must increase"
        self._batches.append((seq, payload))
        self._num_bytes += len(payload)
        while len(self._batches) > self.max_batches or (
            self._num_bytes > self.max_bytes and len(self._batches) > 1
        ):
            _, old = self._batches.popleft()
            self._num_bytes -= len(old)

    def since(self, start: int) -> list[tuple[int, bytes]]:
        """``(seq, payload)`` of every held batch with ``seq >= start``, oldest first."""
        if not self._batches or start > self._batches[-1][0]:
            return []
        # Sequence numbers increase but may skip (a dropped batch burns one), so search by
        # value rather than by offset.
        lo, hi = 0, len(self._batches)
        while lo < hi:
            mid = (lo + hi) // 2
            if self._batches[mid][0] < start:
                lo = mid + 1
            else:
                hi = mid
        return list(islice(self._batches, lo, None))
