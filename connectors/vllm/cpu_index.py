"""The scheduler's view of the worker's in-process CPU tier (``WorkerCPUIndex``)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from cachetier.connectors.vllm.metadata import StoredBlocks
from cachetier.primitives.keys import BlockHash, num_leading_hits


class WorkerCPUIndex:
    """The scheduler's view of the worker's in-process CPU tier, from what the worker reports.

    Disk and Redis the scheduler asks itself; the worker's CPU tier lives in another object (or
    process), so the worker reports the keys it stored or loaded and the keys it failed to
    restore. The index is an LRU bounded like the tier and used in the same order (a load is a
    use: without it, a conversation served from the tier turn after turn aged out of the index
    by its write alone while the tier kept it, and every later turn missed). It may still
    believe in a block the tier evicted: that load then fails and vLLM recomputes the block.

    Args:
        max_blocks: most keys kept (the CPU tier's capacity in blocks); 0 keeps none.
    """

    def __init__(self, max_blocks: int) -> None:
        if max_blocks < 0:
            raise ValueError(f"max_blocks must be >= 0, got {max_blocks}")
        self._max_blocks = max_blocks
        self._keys: OrderedDict[tuple[str, bytes], None] = OrderedDict()

    def update(self, report: StoredBlocks) -> None:
        """Apply one step's worker report."""
        if not self._max_blocks:
            return
        for namespace_id, keys in report.stored.items():
            for key in keys:
                self._keys[(namespace_id, key)] = None
                self._keys.move_to_end((namespace_id, key))
        for namespace_id, keys in report.failed.items():
            for key in keys:
                self._keys.pop((namespace_id, key), None)
        while len(self._keys) > self._max_blocks:
            self._keys.popitem(last=False)

    def leading(self, namespace_id: str, keys: Sequence[BlockHash]) -> int:
        """How many leading ``keys`` the worker's CPU tier holds, as far as we know."""
        return num_leading_hits(keys, lambda key: (namespace_id, key) in self._keys)
