"""Pool blocks: reference counts, the prefix cache (key -> block), and the LRU of free blocks.

A free block that holds a full, computed block of tokens keeps its key and stays findable in
the prefix cache until it is reused; reuse evicts it, and the eviction callback gets to save it
to the tiers first (its memory is untouched until the caller writes the new owner's KV).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from cachetier.primitives.keys import BlockHash


@dataclass(slots=True)
class Block:
    block_id: int
    ref_count: int = 0
    key: BlockHash | None = None  # set once the block is full and its KV computed
    stored: bool = False  # already handed to the tiers (or restored from them)
    # The keys of the records the block is stored as, when it holds several (a block of
    # ``n * record_tokens`` tokens); empty when the block is one record named ``key``.
    record_keys: tuple[BlockHash, ...] = ()


EvictHook = Callable[[list[Block]], None]
AllocateHook = Callable[[list[int]], None]


class BlockManager:
    """Owns the ids of ``num_blocks`` pool blocks.

    Args:
        num_blocks: blocks in the pool.
        on_evict: called with cached blocks that are about to be reused, before reuse.
        on_allocate: called with the ids of newly allocated blocks, after ``on_evict`` (e.g. to
            reset an fp8 pool's per-block scales for their new owner).
    """

    def __init__(
        self,
        num_blocks: int,
        on_evict: EvictHook | None = None,
        on_allocate: AllocateHook | None = None,
    ) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Free blocks, next to reuse first. Keyless blocks go to the front, cached ones to the
        # back, so cached KV lives as long as possible (LRU among cached blocks).
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._cached: dict[BlockHash, int] = {}
        self._on_evict = on_evict
        self._on_allocate = on_allocate
        # Told of each block newly indexed by its key (its KV computed or restored): the
        # engine publishes it as a KV event (``LLMEngine.publish_events``).
        self.on_register: Callable[[Block, BlockHash | None, Sequence[int]], None] | None = None
        self.num_evicted = 0

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    def usage(self) -> float:
        """Fraction of blocks held by running sequences (vLLM's KV cache usage)."""
        return 1.0 - len(self._free) / len(self.blocks)

    def match_prefix(self, keys: Sequence[BlockHash]) -> list[int]:
        """Pool block ids of the leading keys present in the prefix cache."""
        out: list[int] = []
        for key in keys:
            block_id = self._cached.get(key)
            if block_id is None:
                break
            out.append(block_id)
        return out

    def num_free_among(self, block_ids: Sequence[int]) -> int:
        """How many of ``block_ids`` sit in the free list (acquiring them shrinks it)."""
        return sum(1 for b in block_ids if b in self._free)

    def acquire(self, block_ids: Sequence[int]) -> None:
        """Take a reference on cached blocks (prefix hits)."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self._free[block_id]
            block.ref_count += 1

    def allocate(self, num: int) -> list[int] | None:
        """Take ``num`` free blocks (evicting cached ones, least recently used first).

        Returns:
            The block ids, or ``None`` (and nothing taken) if fewer are free.
        """
        if num > len(self._free):
            return None
        ids = [self._free.popitem(last=False)[0] for _ in range(num)]
        evicted = [self.blocks[i] for i in ids if self.blocks[i].key is not None]
        if evicted and self._on_evict is not None:
            self._on_evict(evicted)
        for block_id in ids:
            block = self.blocks[block_id]
            if block.key is not None:
                if self._cached.get(block.key) == block_id:
                    del self._cached[block.key]
                self.num_evicted += 1
            block.key, block.stored, block.ref_count = None, False, 1
            block.record_keys = ()
        if self._on_allocate is not None:
            self._on_allocate(ids)
        return ids

    def release(self, block_ids: Sequence[int]) -> None:
        """Drop a reference on each block; blocks that reach zero become free.

        Freed in reverse so a sequence's tail is evicted before its head (the head is what
        other requests share).
        """
        for block_id in reversed(block_ids):
            block = self.blocks[block_id]
            assert block.ref_count > 0, f"block {block_id} released more often than taken"
            block.ref_count -= 1
            if block.ref_count == 0:
                self._free[block_id] = None
                if block.key is None:
                    self._free.move_to_end(block_id, last=False)

    def register(
        self,
        block_id: int,
        key: BlockHash,
        *,
        stored: bool = False,
        record_keys: tuple[BlockHash, ...] = (),
        parent: BlockHash | None = None,
        token_ids: Sequence[int] = (),
    ) -> None:
        """Record that ``block_id`` holds the full, computed block named ``key`` (stored as
        the records ``record_keys`` where it holds several); ``parent`` (the block before it
        in its sequence) and ``token_ids`` are passed on to ``on_register``."""
        block = self.blocks[block_id]
        block.key = key
        block.record_keys = record_keys
        block.stored = block.stored or stored
        # A second block with the same content stays usable by its owner but is not indexed.
        if self._cached.setdefault(key, block_id) == block_id and self.on_register is not None:
            self.on_register(block, parent, token_ids)

    def clear_cache(self) -> int:
        """Forget every cached key of free blocks (e.g. to force tier restores in tests)."""
        forgotten = 0
        for block_id in list(self._free):
            block = self.blocks[block_id]
            if block.key is not None:
                if self._cached.get(block.key) == block_id:
                    del self._cached[block.key]
                block.key, block.stored, block.record_keys = None, False, ()
                forgotten += 1
        return forgotten
