"""The store's block events: which tier took or let go of which keys, as they happen, and
their publication as KV events (``cachetier.kvevents``).

``BlockEvents`` is the store's fan-out: the first tier's puts and promotions, each writer's
completed puts, every eviction, corrupt record, delete and clear are told to its listeners as
``(kind, tier, namespace, keys)``. ``publish_store`` is the listener that turns them into KV
events under each tier's name as its medium (``cpu``, ``disk``, ``redis``, ``remote``), after
announcing what the persistent tiers hold already, so that a restarted process's blocks are
routable as soon as it starts.

A listener runs on the thread that made the change (the engine's, a writer's): it must be
quick and must not raise; one that raises is logged and the change goes on.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Literal

from cachetier.kvevents import TierEvents
from cachetier.primitives.keys import BlockHash
from cachetier.tiers.base import Tier

logger = logging.getLogger("cachetier.store")

BlockKind = Literal["stored", "removed", "cleared"]
BlockListener = Callable[[BlockKind, str, str, Sequence[BlockHash]], None]
"""``listener(kind, tier, namespace, keys)``; ``keys`` is empty for ``cleared``."""


class BlockEvents:
    """The store's listeners of block changes."""

    def __init__(self) -> None:
        self._listeners: tuple[BlockListener, ...] = ()
        self._lock = threading.Lock()

    def listen(self, listener: BlockListener) -> None:
        """Tell ``listener`` of every change from now on."""
        with self._lock:
            self._listeners = (*self._listeners, listener)

    def tell(self, kind: BlockKind, tier: str, namespace: str, keys: Sequence[BlockHash]) -> None:
        """Tell every listener; one that raises is logged, not passed on (a put must not fail
        because a publisher did)."""
        if not keys and kind != "cleared":
            return
        for listener in self._listeners:
            try:
                listener(kind, tier, namespace, keys)
            except Exception:  # noqa: BLE001 - a listener's bug must not fail the store
                logger.exception("a block listener failed on %s %s in %s", kind, tier, namespace)


def tell_cleared(events: BlockEvents, tiers: Sequence[Tier], namespace: str) -> None:
    """Tell that ``namespace`` is about to be cleared in every tier: as the removal of its keys
    where a tier can list them, so that other namespaces' blocks stay known; as a clear of the
    whole tier where it cannot (Redis, the sidecar)."""
    for tier in tiers:
        held = tier.held_keys()
        if held is None:
            events.tell("cleared", tier.name, namespace, ())
        else:
            events.tell("removed", tier.name, namespace, [k for ns, k in held if ns == namespace])


def publish_store(
    events: BlockEvents,
    tiers: Sequence[Tier],
    tier_events: TierEvents,
    block_size: int,
    *,
    media: Mapping[str, str] | None = None,
    announce: bool = True,
) -> int:
    """Publish a store's block changes as KV events.

    Args:
        events: the store's ``block_events``.
        tiers: its tiers, whose held keys are announced first (those that can list them).
        tier_events: where the events go.
        block_size: tokens per record, for the events (and to look up their tokens); 0 where
            the store holds several layouts (a sidecar's).
        media: tier name -> the medium its events go out under; tiers not named are not
            published. ``None``: every tier of ``tiers``, under its own name.
        announce: announce what the tiers hold now (``TierEvents.snapshot``).

    Returns:
        How many keys were announced.
    """
    names = dict(media) if media is not None else {tier.name: tier.name for tier in tiers}

    def listener(kind: BlockKind, tier: str, namespace: str, keys: Sequence[BlockHash]) -> None:
        medium = names.get(tier)
        if medium is None:
            return
        if kind == "stored":
            tier_events.stored_keys(medium, keys, block_size)
        elif kind == "removed":
            tier_events.removed(medium, keys)
        else:
            tier_events.cleared(medium)

    # Listen first, then list: a block stored in between is announced twice, never missed.
    events.listen(listener)
    announced = 0
    for tier in tiers if announce else ():
        held = tier.held_keys() if tier.name in names else None
        if held:
            keys = (key for _, key in held)
            announced += tier_events.snapshot(names[tier.name], keys, block_size=block_size)
    return announced
