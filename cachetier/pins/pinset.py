"""Pinned blocks of one tier: keys its eviction never takes, within a bound in bytes.

A pin names a (namespace, key) whether or not the block is stored yet: a block that arrives
under a pinned key is protected from then on (pin on arrival), so a prefix pinned before any
engine computed it, or a tier that starts empty after a restart, keeps it once it comes.

A pinned block that is stored is *protected*: the tier keeps it out of its eviction policy, so
the policy never offers it as a victim. Protected bytes are bounded (``max_bytes``, from a
tier's ``max_pinned_fraction``), so the rest of the tier always has room to evict into. A pin
request that would protect more is refused whole (``PinLimitError``). A pinned block that
arrives when the bound is already used up is stored like any other block and counted as
``pinned_waiting`` until room is made (an unpin) and it is stored again.

Not thread-safe: the tier calls it under its own lock, like its eviction policy.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Mapping
from typing import Any

from cachetier.errors import PinLimitError
from cachetier.tiers.eviction import EvictionPolicy


class PinSet:
    """The pins of one tier and the bytes of those it holds.

    Args:
        max_bytes: most bytes of protected blocks at once (0: the tier pins nothing).
        tier: the tier's name, for messages.
    """

    def __init__(self, max_bytes: int, tier: str) -> None:
        self.max_bytes = max_bytes
        self._tier = tier
        self._pinned: set[Hashable] = set()
        self._protected: dict[Hashable, int] = {}  # stored and pinned: its bytes
        self._protected_bytes = 0

    def pin(self, slots: Iterable[Hashable], stored: Mapping[Hashable, int]) -> list[Hashable]:
        """Pin slots, all or none.

        Args:
            slots: the slots to pin (pinned ones again are left as they are).
            stored: bytes of each of ``slots`` the tier holds now (absent: not stored).

        Returns:
            The slots that became protected now (the tier takes them out of its policy).

        Raises:
            PinLimitError: the stored ones would pass ``max_bytes``; nothing was pinned.
        """
        new = [s for s in dict.fromkeys(slots) if s not in self._pinned]
        grow = [s for s in new if s in stored]
        extra = sum(stored[s] for s in grow)
        if grow and self._protected_bytes + extra > self.max_bytes:
            raise PinLimitError(
                f"the {self._tier} tier may hold {self.max_bytes} pinned bytes "
                f"(max_pinned_fraction of its capacity); {self._protected_bytes} are pinned "
                f"and these {len(grow)} stored blocks add {extra}: unpin others or raise "
                "max_pinned_fraction"
            )
        self._pinned.update(new)
        for slot in grow:
            self._protected[slot] = stored[slot]
        self._protected_bytes += extra
        return grow

    def unpin(self, slots: Iterable[Hashable]) -> tuple[int, list[Hashable]]:
        """Remove pins.

        Returns:
            How many slots were pinned, and those that were protected (the tier gives them
            back to its policy).
        """
        removed = 0
        released: list[Hashable] = []
        for slot in dict.fromkeys(slots):
            if slot not in self._pinned:
                continue
            self._pinned.discard(slot)
            removed += 1
            size = self._protected.pop(slot, None)
            if size is not None:
                self._protected_bytes -= size
                released.append(slot)
        return removed, released

    def arrive(self, slot: Hashable, size: int) -> bool:
        """A block was stored (or found) under ``slot``; call ``leave`` first for the block it
        replaces.

        Returns:
            Whether it is protected (pinned, and within the bound).
        """
        if slot not in self._pinned or self._protected_bytes + size > self.max_bytes:
            return False
        self._protected[slot] = size
        self._protected_bytes += size
        return True

    def leave(self, slot: Hashable) -> bool:
        """The block under ``slot`` left the tier (deleted, corrupt, replaced); its pin stays.

        Returns:
            Whether it was protected.
        """
        size = self._protected.pop(slot, None)
        if size is None:
            return False
        self._protected_bytes -= size
        return True

    def place(self, policy: EvictionPolicy, slot: Hashable, size: int, replaces: bool) -> None:
        """A block of ``size`` bytes was stored (or found) under ``slot``: account its pin and
        tell the tier's eviction ``policy`` whether it may ever offer it.

        Args:
            policy: the tier's policy over its unprotected blocks.
            slot: the block's slot.
            size: its bytes.
            replaces: the tier already held a block under ``slot`` (now replaced or used).
        """
        was_protected = replaces and self.leave(slot)
        if self.arrive(slot, size):
            policy.remove(slot)
        elif replaces and not was_protected:
            policy.touch(slot)
        else:
            policy.insert(slot)  # new, or just left the protected set

    def pin_stored(
        self, policy: EvictionPolicy, slots: Iterable[Hashable], stored: Mapping[Hashable, int]
    ) -> int:
        """``pin``, then take the blocks it protected out of ``policy``.

        Returns:
            How many of ``slots`` are stored and protected now.
        """
        slots = list(dict.fromkeys(slots))
        for slot in self.pin(slots, stored):
            policy.remove(slot)
        return sum(1 for s in slots if s in self._protected)

    def unpin_stored(self, policy: EvictionPolicy, slots: Iterable[Hashable]) -> int:
        """``unpin``, then give the blocks it released back to ``policy`` as just used.

        Returns:
            How many of ``slots`` were pinned.
        """
        removed, released = self.unpin(slots)
        for slot in released:
            policy.insert(slot)
        return removed

    def forget_protected(self) -> None:
        """Every block left at once (a tier rebuilding its view): pins stay, none protected."""
        self._protected.clear()
        self._protected_bytes = 0

    def snapshot(self) -> dict[str, Any]:
        """``pinned_keys`` (pins), ``pinned_blocks`` and ``pinned_bytes`` (those stored and
        protected), ``pinned_waiting`` (pins not protected here: not stored yet, or over the
        bound) and ``max_pinned_bytes``."""
        return {
            "pinned_keys": len(self._pinned),
            "pinned_blocks": len(self._protected),
            "pinned_bytes": self._protected_bytes,
            "pinned_waiting": len(self._pinned) - len(self._protected),
            "max_pinned_bytes": self.max_bytes,
        }


NO_PINS: dict[str, Any] = {
    "pinned_keys": 0,
    "pinned_blocks": 0,
    "pinned_bytes": 0,
    "pinned_waiting": 0,
    "max_pinned_bytes": 0,
}
"""``PinSet.snapshot`` of a tier that cannot pin."""
