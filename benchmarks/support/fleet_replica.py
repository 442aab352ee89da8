"""A simulated engine replica for ``benchmarks.fleet_sim``: a pool and a node-local disk of
bounded blocks (LRU), a FIFO queue served one request at a time, and the shared tier every
replica writes and reads.

Blocks are a trace's hash ids. A served request's blocks are stored in its replica's pool, its
disk and the shared tier (store-all, the default admission), and a store of blocks already held
refreshes them. Within a request the blocks are touched last to first, so that under LRU a
prompt's tail is evicted before its head, as vLLM's free queue does: a prefix cache can only
reuse a leading run, and a head evicted first would strand the rest.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Sequence

from cachetier.util.checks import positive_int

POOL, DISK, SHARED = "pool", "disk", "redis"
"""The media a simulated replica reads from, by their ``cachetier.kvindex`` names."""


class LRUBlocks:
    """At most ``capacity`` block ids, the least recently stored evicted first.

    Args:
        capacity: blocks held.
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = positive_int("capacity", capacity)
        self._blocks: OrderedDict[int, None] = OrderedDict()
        self.num_evictions = 0

    def __contains__(self, block: int) -> bool:
        return block in self._blocks

    def __len__(self) -> int:
        return len(self._blocks)

    def store(self, blocks: Sequence[int]) -> None:
        """Store (or refresh) ``blocks``, last to first (see the module's docstring)."""
        held = self._blocks
        for block in reversed(blocks):
            if block in held:
                held.move_to_end(block)
            else:
                held[block] = None
        while len(held) > self.capacity:
            held.popitem(last=False)
            self.num_evictions += 1

    def leading_run(self, blocks: Sequence[int]) -> int:
        """How many of ``blocks``, from the first, are held."""
        count = 0
        for block in blocks:
            if block not in self._blocks:
                break
            count += 1
        return count


class SimReplica:
    """One replica: its pool, its disk and its queue.

    Args:
        name: its name.
        pool_blocks: blocks its engine's pool holds.
        disk_blocks: blocks its node-local disk tier holds.
    """

    def __init__(self, name: str, pool_blocks: int, disk_blocks: int) -> None:
        self.name = name
        self.pool = LRUBlocks(pool_blocks)
        self.disk = LRUBlocks(disk_blocks)
        self.busy_until = 0.0
        self._finishes: deque[float] = deque()
        self.num_routed = 0
        self.busy_s = 0.0

    def load_at(self, now: float) -> tuple[int, float]:
        """``(requests running and queued, seconds of work ahead)`` at time ``now``."""
        finishes = self._finishes
        while finishes and finishes[0] <= now:
            finishes.popleft()
        return len(finishes), max(self.busy_until - now, 0.0)

    def media(self, blocks: Sequence[int], shared_run: int) -> tuple[str, ...]:
        """Where this replica reads each leading block of ``blocks`` from, fastest first:
        its pool, its disk, then the shared tier (which holds the first ``shared_run``)."""
        out: list[str] = []
        pool, disk = self.pool, self.disk
        for i, block in enumerate(blocks):
            if block in pool:
                out.append(POOL)
            elif block in disk:
                out.append(DISK)
            elif i < shared_run:
                out.append(SHARED)
            else:
                break
        return tuple(out)

    def serve(self, now: float, prefill_s: float, decode_s: float) -> float:
        """Queue a request that arrives at ``now``; returns its TTFT.

        It starts once the requests before it are done, reaches its first token
        ``prefill_s`` later, and holds the replica ``decode_s`` more.
        """
        start = max(now, self.busy_until)
        service = prefill_s + decode_s
        self.busy_until = start + service
        self._finishes.append(self.busy_until)
        self.num_routed += 1
        self.busy_s += service
        return start - now + prefill_s

    def store(self, blocks: Sequence[int]) -> None:
        """The request's blocks, computed or loaded, are in its pool and written to disk."""
        self.pool.store(blocks)
        self.disk.store(blocks)
