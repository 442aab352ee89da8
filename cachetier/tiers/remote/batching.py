"""How the remote tier cuts calls into requests the server accepts (pure functions, no I/O)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields

from cachetier.record import KVBlock
from cachetier.util.checks import positive_int


@dataclass(frozen=True, slots=True)
class RequestLimits:
    """The server's per-request limits, which the remote tier cuts its calls to fit.

    Args:
        max_block_bytes: largest record a put may carry.
        max_batch_bytes: most record bytes per put request.
        max_batch_blocks: most records per put, keys per get.
        max_keys: most keys per lookup, exists or delete.
    """

    max_block_bytes: int
    max_batch_bytes: int
    max_batch_blocks: int
    max_keys: int

    def __post_init__(self) -> None:
        for f in fields(self):
            positive_int(f.name, getattr(self, f.name))

    def narrowed(self, other: Mapping[str, int]) -> RequestLimits:
        """Combine with another side's limits.

        Args:
            other: limits by field name (the server's ``/v1/limits`` answer).

        Returns:
            These limits, lowered to ``other``'s wherever it is stricter.
        """
        return RequestLimits(
            **{
                f.name: min(getattr(self, f.name), int(other.get(f.name, getattr(self, f.name))))
                for f in fields(self)
            }
        )

    def put_groups(self, sizes: Sequence[int]) -> tuple[list[list[int]], int]:
        """Group records of the given byte sizes into put requests, by index.

        Args:
            sizes: each record's length in bytes.

        Returns:
            Per request the indices of its records, in order, and how many records were left
            out as larger than ``max_block_bytes``.
        """
        groups: list[list[int]] = []
        size = too_large = 0
        # A batch's framing costs 8 bytes per record on top of the records (http_batch).
        budget = self.max_batch_bytes - 8
        for index, nbytes in enumerate(sizes):
            if nbytes > self.max_block_bytes or nbytes + 8 > budget:
                too_large += 1
                continue
            if not groups or len(groups[-1]) >= self.max_batch_blocks or size + nbytes + 8 > budget:
                groups.append([])
                size = 0
            groups[-1].append(index)
            size += nbytes + 8
        return groups, too_large

    def num_put_requests(self, blocks: Sequence[KVBlock]) -> int:
        """Count put requests without encoding the blocks.

        Args:
            blocks: the blocks to put.

        Returns:
            An upper bound on ``len(put_groups(...)[0])``.
        """
        total = sum(b.nbytes + 1024 for b in blocks)  # 1 KiB: more than any record header
        by_count = -(-len(blocks) // self.max_batch_blocks)
        return max(1, by_count + -(-total // self.max_batch_bytes))

    def num_requests(self, num_keys: int, per_request: int) -> int:
        """Count requests for a call on many keys.

        Args:
            num_keys: keys in the call.
            per_request: most keys one request may carry.

        Returns:
            The number of requests (at least 1).
        """
        return max(1, -(-num_keys // per_request))
