"""What one process knows of a disk tier folder: each record's size and last-use stamp, in the
eviction policy's order.

The folder is the truth and several processes may change it; this index is one process's view
of it, refreshed by its own puts and reads, by the files it finds at open and by rescans. The
folder checks a victim's file before it removes it (``folder``), so a stale entry costs a
``stat``, never a wrong eviction. Not thread-safe: the tier calls it under its own lock.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import NamedTuple

from cachetier.pins.pinset import PinSet
from cachetier.tiers.eviction import EvictionPolicy, make_policy

Slot = tuple[str, bytes]
"""(namespace, key bytes) of a record."""


class IndexEntry(NamedTuple):
    """What the disk tier's index knows of one record file.

    Args:
        size: the record file's size in bytes.
        stamp: the file's mtime (ns) as this process last set or saw it; a newer mtime on disk
            means another process used the record since.
    """

    size: int
    stamp: int


class LocalIndex:
    """Records by slot, with an eviction policy over those that are not pinned.

    Args:
        policy: eviction policy name (``cachetier.tiers.eviction.make_policy``).
        pins: the tier's pins; a pinned record within their bound never enters the policy,
            so this process never evicts it.
    """

    def __init__(self, policy: str, pins: PinSet | None = None) -> None:
        self._policy_name = policy
        self._policy: EvictionPolicy = make_policy(policy)
        self.pins = pins if pins is not None else PinSet(0, "disk")
        # Plain ints, not an object per record: the garbage collector does not track ints, and
        # 100k tracked objects made opening a large folder a third slower.
        self._sizes: dict[Slot, int] = {}
        self._stamps: dict[Slot, int] = {}
        self._used = 0

    def __len__(self) -> int:
        return len(self._sizes)

    @property
    def used_bytes(self) -> int:
        return self._used

    def get(self, slot: Slot) -> IndexEntry | None:
        size = self._sizes.get(slot)
        return None if size is None else IndexEntry(size, self._stamps[slot])

    def add(self, slot: Slot, size: int, stamp: int) -> None:
        """A record was written, found or used: it becomes the most recently used."""
        old = self._sizes.get(slot)
        self.pins.place(self._policy, slot, size, replaces=old is not None)
        if old is None:
            self._stamps[slot] = stamp
        else:
            self._used -= old
            self._stamps[slot] = max(stamp, self._stamps[slot])
        self._sizes[slot] = size
        self._used += size

    def forget(self, slot: Slot) -> IndexEntry | None:
        """A record left the folder other than by this index's eviction."""
        size = self._sizes.pop(slot, None)
        if size is None:
            return None
        self._used -= size
        self.pins.leave(slot)
        self._policy.remove(slot)
        return IndexEntry(size, self._stamps.pop(slot))

    def pin(self, slots: list[Slot]) -> int:
        """Pin slots (``PinSet.pin``); those stored leave the policy.

        Returns:
            How many of them are stored and protected now.
        """
        stored = {s: self._sizes[s] for s in slots if s in self._sizes}
        return self.pins.pin_stored(self._policy, slots, stored)

    def unpin(self, slots: list[Slot]) -> int:
        """Remove pins; their stored records enter the policy as just used.

        Returns:
            How many were pinned.
        """
        return self.pins.unpin_stored(self._policy, slots)

    def pop_victim(self) -> tuple[Slot, IndexEntry] | None:
        """Remove and return the policy's next victim, ``None`` if the index is empty."""
        slot = self._policy.pop_victim()
        if slot is None:
            return None
        size = self._sizes.pop(slot)  # type: ignore[call-overload]
        self._used -= size
        return slot, IndexEntry(size, self._stamps.pop(slot))  # type: ignore[return-value,call-overload]

    def slots(self) -> list[Slot]:
        return list(self._sizes)

    def slots_of(self, namespace: str) -> list[Slot]:
        return [slot for slot in self._sizes if slot[0] == namespace]

    def rebuild(
        self, records: Iterable[tuple[int, str, bytes, int]], keep_after: int | None
    ) -> None:
        """Replace the view with the files a scan found, in stamp order.

        Args:
            records: ``(mtime ns, namespace, key, size)`` of the files found, oldest first.
            keep_after: entries the scan did not see are kept if their stamp is later than
                this (written while the scan ran); ``None`` keeps none.
        """
        if not self._sizes:  # at open: the records come sorted, nothing to merge
            merged = ((stamp, (ns, key), size) for stamp, ns, key, size in records)
        else:
            found = {(ns, key): (stamp, size) for stamp, ns, key, size in records}
            by_slot = {
                slot: (max(stamp, self._stamps.get(slot, stamp)), slot, size)
                for slot, (stamp, size) in found.items()
            }
            if keep_after is not None:
                for slot, stamp in self._stamps.items():
                    if slot not in by_slot and stamp > keep_after:
                        by_slot[slot] = (stamp, slot, self._sizes[slot])
            # The policy's order is rebuilt from the stamps: what another process used since
            # the last look moves to its place (an LRU's order is then the folder's).
            merged = iter(sorted(by_slot.values(), key=lambda item: item[0]))
        self._policy = make_policy(self._policy_name)
        self.pins.forget_protected()
        insert, arrive, sizes, stamps, used = self._policy.insert, self.pins.arrive, {}, {}, 0
        for stamp, slot, size in merged:
            if not arrive(slot, size):
                insert(slot)
            sizes[slot] = size
            stamps[slot] = stamp
            used += size
        self._sizes, self._stamps, self._used = sizes, stamps, used
