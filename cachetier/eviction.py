"""Eviction policies a tier uses to choose which block leaves when it is over capacity.

A policy only orders keys; the tier owns the blocks and the byte accounting. Policies are not
thread-safe: the tier calls them under its own lock.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Protocol


class EvictionPolicy(Protocol):
    """Orders the keys a tier holds."""

    def insert(self, key: Hashable) -> None:
        """A new key was stored."""

    def touch(self, key: Hashable) -> None:
        """A stored key was read (or overwritten)."""

    def remove(self, key: Hashable) -> None:
        """A key left the tier for a reason other than eviction (delete, corruption)."""

    def pop_victim(self) -> Hashable | None:
        """Remove and return the key to evict next, ``None`` if the policy holds none."""

    def __len__(self) -> int: ...


class LRUPolicy:
    """Least recently used first."""

    def __init__(self) -> None:
        self._order: OrderedDict[Hashable, None] = OrderedDict()

    def insert(self, key: Hashable) -> None:
        self._order[key] = None
        self._order.move_to_end(key)

    def touch(self, key: Hashable) -> None:
        if key in self._order:
            self._order.move_to_end(key)

    def remove(self, key: Hashable) -> None:
        self._order.pop(key, None)

    def pop_victim(self) -> Hashable | None:
        if not self._order:
            return None
        key, _ = self._order.popitem(last=False)
        return key

    def __len__(self) -> int:
        return len(self._order)


POLICIES: dict[str, Callable[[], EvictionPolicy]] = {"lru": LRUPolicy}


def make_policy(name: str) -> EvictionPolicy:
    """Build a policy by name.

    Args:
        name: one of ``POLICIES``.

    Returns:
        A new, empty policy.
    """
    try:
        return POLICIES[name]()
    except KeyError:
        raise ValueError(f"eviction policy {name!r} is not one of {sorted(POLICIES)}") from None
