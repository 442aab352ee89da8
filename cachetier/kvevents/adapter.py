"""``TierEvents``: what a tier, the store or the engine's pool tells, as KV events.

Wiring a tier is a few lines where its blocks come and go::

    events = TierEvents(publisher)
    events.stored("disk", keys)              # after a put
    events.removed("disk", evicted_keys)     # after an eviction or a delete
    events.cleared("disk")                   # after a clear
    tier.listen_evictions(events.on_evicted("disk"))

Nothing here blocks or raises for a full queue: the publisher drops and counts. What the
events said is kept in ``held`` (``HeldKeys``) whether or not they went out, so a consumer
that compares digests finds a lost event; ``tokens`` (``KeyTokens``) supplies the token ids of
keys this process computed, for consumers that index by their own hash.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Protocol

from cachetier.kvevents.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
    check_keys,
    check_medium,
)
from cachetier.kvevents.held import HeldKeys
from cachetier.kvevents.tokens import KeyTokens
from cachetier.primitives.keys import BlockHash


class EventSink(Protocol):
    """Where events go: ``KVEventPublisher``, or anything that queues them the same way."""

    def publish(self, events: Sequence[KVEvent]) -> bool: ...


class TierEvents:
    """Turns a tier's stored / evicted / cleared notifications into KV events.

    Args:
        sink: the publisher the events are queued on.
        held: where what the events say is held is kept (a new one by default).
        tokens: the token ids of keys, where known (``stored_keys`` reads it).
    """

    def __init__(
        self, sink: EventSink, held: HeldKeys | None = None, tokens: KeyTokens | None = None
    ) -> None:
        self._sink = sink
        self.held = held if held is not None else HeldKeys()
        self.tokens = tokens if tokens is not None else KeyTokens()

    def stored(
        self,
        medium: str,
        keys: Sequence[BlockHash],
        parent: BlockHash | None = None,
        token_ids: Sequence[int] = (),
        block_size: int = 0,
    ) -> bool:
        """``keys`` are now held in ``medium``.

        Args:
            medium: the tier's medium name.
            keys: the blocks' keys, in chain order.
            parent: the key before ``keys[0]`` in its chain, ``None`` for a first block or
                where the tier does not know it.
            token_ids: the blocks' tokens, ``block_size`` per key, or empty where the tier
                does not keep them.
            block_size: tokens per block (0 where unknown).

        Returns:
            False when the publisher dropped the event.

        Raises:
            ValueError: a key is not a 32-byte key, or the tokens do not fill the blocks.
        """
        if not keys:
            return True
        hashes = check_keys(keys)
        if parent is not None:
            check_keys([parent])
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 0:
            raise ValueError(f"block_size must be an int >= 0, got {block_size!r}")
        # len(), not truth: the engine passes numpy arrays, whose truth value raises.
        if len(token_ids) and len(token_ids) != len(hashes) * block_size:
            raise ValueError(
                f"{len(token_ids)} token ids for {len(hashes)} blocks of {block_size}: pass "
                "block_size tokens per key, or none"
            )
        event = BlockStored(
            hashes, parent, tuple(int(t) for t in token_ids), block_size, check_medium(medium)
        )
        self.held.add(medium, hashes)
        return self._sink.publish([event])

    def stored_keys(self, medium: str, keys: Sequence[BlockHash], block_size: int = 0) -> bool:
        """``keys`` are now held in ``medium``, with their parent and tokens where ``tokens``
        knows every one of them (blocks this process computed or restored), else keys only.

        Args:
            medium: the tier's medium name.
            keys: the blocks' keys, in chain order.
            block_size: tokens per block.

        Returns:
            False when the publisher dropped the event.
        """
        sent = True
        for run, parent, token_ids in self.tokens.runs(keys, block_size):
            sent &= self.stored(medium, run, parent, token_ids, block_size)
        return sent

    def snapshot(
        self, medium: str, keys: Iterable[BlockHash], chunk: int = 1024, block_size: int = 0
    ) -> int:
        """Announce what a persistent tier holds (at start, so that a restarted process's
        blocks are routable at once), in events of ``chunk`` keys, without tokens (a record
        keeps none; consumers match by key).

        Returns:
            How many keys were announced.
        """
        check_medium(medium)
        count = 0
        batch: list[BlockHash] = []
        for key in keys:
            batch.append(key)
            if len(batch) == chunk:
                self.stored(medium, batch, block_size=block_size)
                count, batch = count + len(batch), []
        if batch:
            self.stored(medium, batch, block_size=block_size)
            count += len(batch)
        return count

    def removed(self, medium: str, keys: Sequence[BlockHash]) -> bool:
        """``keys`` are no longer held in ``medium`` (evicted, deleted, found corrupt).

        Args:
            medium: the tier's medium name.
            keys: the keys that left.

        Returns:
            False when the publisher dropped the event.
        """
        if not keys:
            return True
        hashes = check_keys(keys)
        self.held.remove(medium, hashes)
        return self._sink.publish([BlockRemoved(hashes, check_medium(medium))])

    def cleared(self, medium: str) -> bool:
        """``medium`` holds nothing any more.

        Args:
            medium: the tier's medium name.

        Returns:
            False when the publisher dropped the event.
        """
        self.held.clear(check_medium(medium))
        return self._sink.publish([AllBlocksCleared(medium)])

    def on_evicted(self, medium: str) -> Callable[[str, BlockHash, float | None], None]:
        """A tier's eviction listener (``Tier.listen_evictions``) publishing each evicted key.

        Args:
            medium: the tier's medium name.

        Returns:
            ``listener(namespace, key, stamp)``; keys chain from their namespace, so the
            namespace is not sent.
        """
        check_medium(medium)

        def listener(namespace: str, key: BlockHash, stamp: float | None) -> None:
            self.removed(medium, [key])

        return listener
