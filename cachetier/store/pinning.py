"""The pinning half of ``TieredStore``'s interface: keep blocks from every tier's eviction,
now or once they arrive (``cachetier.pins.store``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from cachetier.pins.registry import Pins
from cachetier.pins.store import PinResult, StorePins, prefix_keys
from cachetier.primitives.keys import BlockHash, Namespace


class StorePinning:
    """``pin_keys``, ``pin_prefix``, ``unpin_keys`` and ``pinned`` over ``_pins``; the store
    that takes it in sets ``_pins`` and has ``flush``."""

    _pins: StorePins

    if TYPE_CHECKING:  # the store's own (``TieredStore.flush``)

        def flush(self, timeout: float | None = None) -> bool: ...

    def pin_keys(self, namespace: str, keys: Sequence[BlockHash]) -> PinResult:
        """Keep blocks from eviction in every tier that can pin, now or once they arrive.

        Args:
            namespace: storage namespace.
            keys: the keys to pin (e.g. a prefix's chain, ``block_keys``).

        Returns:
            The keys pinned, and how many each tier holds and protects now.

        Raises:
            PinLimitError: a tier's bound on pinned bytes refused them; nothing was pinned.
            TierUnavailableError: a tier's Redis did not answer; nothing was pinned.
        """
        self.flush()  # blocks queued for a lower tier are counted there
        return self._pins.pin(namespace, keys)

    def pin_prefix(self, namespace: Namespace, token_ids: Sequence[int]) -> PinResult:
        """Pin the chain of full blocks of a token prefix (a system prompt, say).

        Args:
            namespace: model, layout and tenant of the blocks (keys come from ``block_keys``).
            token_ids: the prefix's token ids; a partial last block is not pinned.

        Returns:
            As ``pin_keys``.

        Raises:
            ValueError: the prefix is shorter than one block.
            PinLimitError: as ``pin_keys``.
        """
        return self.pin_keys(namespace.id, prefix_keys(namespace, token_ids))

    def unpin_keys(self, namespace: str, keys: Sequence[BlockHash]) -> int:
        """Let pinned blocks be evicted again.

        Args:
            namespace: storage namespace.
            keys: the keys to unpin.

        Returns:
            How many of them were pinned.

        Raises:
            TierUnavailableError: a tier's Redis did not answer; the pins stay.
        """
        return self._pins.unpin(namespace, keys)

    def pinned(self, prefix: str = "") -> Pins:
        """Pinned keys by storage namespace (those starting with ``prefix``), in pin order."""
        return self._pins.listing(prefix)
