"""``KeyTokens``: the tokens and parent of the block keys a process computed, for its events.

vLLM's ``BlockStored`` carries each block's token ids, so that a consumer hashing tokens its
own way (llm-d's indexer, Dynamo's) can index them. A tier's records keep no tokens, and the
store's writers see only records; the engine, which computed the blocks, notes each key's
tokens here as its pool indexes them, and the tier events look them up when the same keys
reach a tier. Bounded: the oldest notes go first, and a key without a note is published
without tokens (consumers that match our keys still find it).

Thread-safe.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence

from cachetier.primitives.keys import BlockHash

DEFAULT_MAX_KEYS = 1 << 16
"""Notes kept: 65,536 blocks (a few MiB at 16 tokens a block)."""


class KeyTokens:
    """Token ids and parent key per block key, the most recent ``max_keys`` of them.

    Args:
        max_keys: notes kept at most.
    """

    def __init__(self, max_keys: int = DEFAULT_MAX_KEYS) -> None:
        if isinstance(max_keys, bool) or not isinstance(max_keys, int) or max_keys <= 0:
            raise ValueError(f"max_keys must be a positive int, got {max_keys!r}")
        self.max_keys = max_keys
        self._lock = threading.Lock()
        self._notes: OrderedDict[bytes, tuple[bytes | None, tuple[int, ...]]] = OrderedDict()

    def __len__(self) -> int:
        with self._lock:
            return len(self._notes)

    def note(self, key: BlockHash, parent: BlockHash | None, token_ids: Sequence[int]) -> None:
        """``key`` is the block of ``token_ids`` whose chain continues ``parent``."""
        entry = (parent, tuple(int(t) for t in token_ids))
        with self._lock:
            self._notes[key] = entry
            self._notes.move_to_end(key)
            while len(self._notes) > self.max_keys:
                self._notes.popitem(last=False)

    def runs(
        self, keys: Sequence[BlockHash], block_size: int
    ) -> list[tuple[list[BlockHash], BlockHash | None, tuple[int, ...]]]:
        """``keys`` cut into chains: ``(keys, parent, token_ids)`` each, the tokens of every key
        (``block_size`` each) where all of the chain's keys are noted, else empty; a key whose
        noted parent is not the key before it starts a new chain.

        Args:
            keys: block keys, as a tier stored them (a sequence's in order, or evicted ones of
                several sequences).
            block_size: tokens per block.
        """
        out: list[tuple[list[BlockHash], BlockHash | None, tuple[int, ...]]] = []
        with self._lock:
            notes = [self._notes.get(key) for key in keys]
        for key, entry in zip(keys, notes):
            tokens = entry[1] if entry is not None and len(entry[1]) == block_size else None
            parent = entry[0] if entry is not None else None
            last = out[-1] if out else None
            if last is not None and tokens is not None and parent == last[0][-1] and last[2]:
                last[0].append(key)
                out[-1] = (last[0], last[1], last[2] + tokens)
            elif last is not None and tokens is None and not last[2]:
                last[0].append(key)  # runs without tokens need no chain: one event
            else:
                out.append(([key], parent if tokens is not None else None, tokens or ()))
        return out
