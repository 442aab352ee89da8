"""The pins of a ``TieredStore``: which keys each namespace pins, applied to every tier that
can pin, and kept in a ``PinRegistry`` when the store has one (so they survive a restart).

A pin request is all or nothing across the tiers: if one tier refuses it (its bound on pinned
bytes) or fails (a Redis that is down), the tiers that took it give it back and nothing is
recorded. An unpin that a tier fails is undone the same way, so the record and the tiers agree.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from cachetier.errors import CacheTierError, PinLimitError
from cachetier.pins.registry import PinRegistry, Pins
from cachetier.primitives.keys import BlockHash, Namespace, block_keys
from cachetier.tiers.base import Tier, check_namespace

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class PinResult:
    """What one pin request did.

    Args:
        keys: every key of the request, in order (all pinned: a refused request raises).
        num_new: how many of them were not pinned before.
        protected: tier name -> how many of ``keys`` it holds and keeps from eviction now;
            the others are pinned on arrival (protected once stored there).
    """

    keys: tuple[BlockHash, ...]
    num_new: int
    protected: dict[str, int]


class StorePins:
    """Pins of one store.

    Args:
        tiers: the store's tiers (those with ``supports_pins`` are pinned in).
        registry: where pins are kept across restarts; ``None`` keeps them in memory only.
        max_keys: most keys pinned at once, over every namespace. Pins of keys not stored
            yet cost no tier bytes, so without this a caller could grow the registry (and
            the file rewritten on every pin) without end.
    """

    def __init__(
        self, tiers: Sequence[Tier], registry: PinRegistry | None, max_keys: int = 16_384
    ) -> None:
        if max_keys < 0:
            raise ValueError(f"max_keys must be >= 0, got {max_keys}")
        self.max_keys = max_keys
        self._tiers = [t for t in tiers if t.supports_pins]
        self._registry = registry
        self._lock = threading.Lock()
        self._pins: dict[str, dict[BlockHash, None]] = {}
        if registry is not None:
            for namespace, keys in registry.load().items():
                self._pins[namespace] = dict.fromkeys(keys)
                for tier in self._tiers:
                    try:
                        tier.pin(namespace, keys)
                    except CacheTierError as exc:
                        # The bound was lowered since they were pinned, or the tier's service
                        # is down (a Redis keeps its pins itself): keep the pins (an unpin
                        # makes room), but say which ones this tier does not protect.
                        log.warning(
                            "pins of %s are not kept in the %s tier: %s", namespace, tier.name, exc
                        )

    def pin(self, namespace: str, keys: Sequence[BlockHash]) -> PinResult:
        """Pin keys in every tier that can pin (all or nothing) and record them.

        Args:
            namespace: storage namespace.
            keys: the keys, e.g. the chain of a prefix.

        Returns:
            What was pinned.

        Raises:
            PinLimitError: a tier's bound, or ``max_keys``, refused them; nothing was pinned.
            TierUnavailableError: a tier's service (Redis) did not answer; nothing was pinned.
        """
        check_namespace(namespace)
        keys = list(dict.fromkeys(BlockHash(bytes(k)) for k in keys))
        with self._lock:
            held = self._pins.get(namespace, {})
            new = [k for k in keys if k not in held]
            num_pinned = sum(len(ks) for ks in self._pins.values())
            if num_pinned + len(new) > self.max_keys:
                raise PinLimitError(
                    f"the store may pin {self.max_keys} keys; {num_pinned} are pinned and this "
                    f"request adds {len(new)}: unpin some first"
                )
            protected: dict[str, int] = {}
            done: list[Tier] = []
            try:
                for tier in self._tiers:
                    protected[tier.name] = tier.pin(namespace, keys)
                    done.append(tier)
            except CacheTierError:
                for tier in done:
                    _undo(tier.unpin, namespace, new)  # only what this request added
                raise
            if new:
                if self._registry is not None:
                    self._registry.add(namespace, new)
                self._pins.setdefault(namespace, {}).update(dict.fromkeys(new))
        return PinResult(tuple(keys), len(new), protected)

    def unpin(self, namespace: str, keys: Sequence[BlockHash]) -> int:
        """Unpin keys in every tier and forget them.

        Returns:
            How many of them were pinned.

        Raises:
            TierUnavailableError: a tier's service (Redis) did not answer; the pins stay.
        """
        check_namespace(namespace)
        keys = [BlockHash(bytes(k)) for k in keys]
        with self._lock:
            held = self._pins.get(namespace, {})
            gone = [k for k in dict.fromkeys(keys) if k in held]
            done: list[Tier] = []
            try:
                for tier in self._tiers:
                    tier.unpin(namespace, keys)
                    done.append(tier)
            except CacheTierError:
                for tier in done:
                    _undo(tier.pin, namespace, gone)
                raise
            if gone:
                if self._registry is not None:
                    self._registry.remove(namespace, gone)
                for key in gone:
                    del held[key]
                if not held:
                    self._pins.pop(namespace, None)
        return len(gone)

    def holds(self, namespace: str, key: BlockHash) -> bool:
        """Whether ``key`` is pinned in ``namespace`` (admission always writes pinned blocks)."""
        return key in self._pins.get(namespace, {})  # dict reads are atomic under the GIL

    def listing(self, prefix: str = "") -> Pins:
        """Pinned keys by namespace, for the namespaces that start with ``prefix``."""
        with self._lock:
            return {ns: list(keys) for ns, keys in self._pins.items() if ns.startswith(prefix)}


def prefix_keys(namespace: Namespace, token_ids: Sequence[int]) -> list[BlockHash]:
    """The keys of a token prefix's full blocks, to pin.

    Raises:
        ValueError: the prefix is shorter than one block.
    """
    keys = block_keys(namespace, token_ids)
    if not keys:
        raise ValueError(
            f"{len(token_ids)} tokens make no full block of {namespace.block_size}: nothing to pin"
        )
    return keys


def _undo(
    change: Callable[[str, Sequence[BlockHash]], int], namespace: str, keys: Sequence[BlockHash]
) -> None:
    """Best effort to take back what a tier did for a request that failed elsewhere: the
    request's own error is what the caller hears, so a failure here is only logged."""
    if not keys:
        return
    try:
        change(namespace, keys)
    except CacheTierError as exc:
        log.warning("could not take back a pin change of %s: %s", namespace, exc)
