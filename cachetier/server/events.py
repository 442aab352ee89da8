"""The sidecar's KV events: what its last tier holds, published for every replica's router.

The sidecar is shared: every engine that reads it can load what it holds. Its events go out
under replica ``*`` (``cachetier.kvindex.SHARED``) and medium ``remote`` (the name engines give
the tier that reads the sidecar), so an index holds its blocks for every replica. Only the
last tier is published: the tiers above it are written through to it, so it holds what they
hold, and a block the first tier evicts is still there to load. Beyond loopback the events need
CURVE keys (``kv_events_curve_key``, ``kv_events_curve_clients``): only listed readers get them.
"""

from __future__ import annotations

import logging

from cachetier.kvevents import KVEventPublisher, TierEvents
from cachetier.server.config import ServerConfig
from cachetier.server.events_config import kv_events_publisher
from cachetier.store.events import publish_store
from cachetier.store.tiered import TieredStore

logger = logging.getLogger("cachetier.server")
SHARED_MEDIUM = "remote"
"""The medium the sidecar's blocks are published under (``RemoteTier.name``)."""


def shared_publisher(config: ServerConfig, store: TieredStore) -> KVEventPublisher | None:
    """Start publishing ``store``'s last tier as KV events, where ``config.kv_events`` says.

    Returns:
        The publisher (the caller closes it), or ``None`` without ``kv_events``.

    Raises:
        ValueError: an endpoint cannot be bound, or a CURVE file cannot be read (missing, not
            a certificate, no secret key, no ``*.key`` in the clients' folder).
    """
    settings = kv_events_publisher(
        config.kv_events,
        config.kv_events_replay,
        config.kv_events_curve_key,
        config.kv_events_curve_clients,
    )
    if settings is None:
        return None
    publisher = KVEventPublisher(settings)
    last = store.tiers[-1]
    try:
        announced = publish_store(
            store.block_events, [last], TierEvents(publisher), 0, media={last.name: SHARED_MEDIUM}
        )
    except BaseException:
        publisher.close()
        raise
    logger.info(
        "KV events of tier %s at %s (replay %s): %d blocks announced",
        last.name,
        publisher.endpoint,
        publisher.replay_endpoint,
        announced,
    )
    return publisher
