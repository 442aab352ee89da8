"""KV events from every tier: which blocks each process holds, and where, as vLLM's KV-event
consumers read them.

- ``events``: the events, the batch and their msgpack codec (vLLM's wire format, no vLLM).
- ``framing``: the ZMQ frames: topic with replica and model, sequence numbers, replay.
- ``curve``: CURVE keys and the allowed clients of the sockets.
- ``KVEventPublisher``: PUB + replay ROUTER, fed from a bounded queue by a thread of its own.
- ``TierEvents``: a tier's stored / removed / cleared notifications as events.
- ``KVEventSubscriber``: one publisher's batches in order, gaps replayed or counted missed.
"""

from cachetier.kvevents.adapter import EventSink, TierEvents
from cachetier.kvevents.config import PublisherConfig, SubscriberConfig
from cachetier.kvevents.events import (
    MEDIUM_GPU,
    AllBlocksCleared,
    BatchCodec,
    BlockRemoved,
    BlockStored,
    EventBatch,
    KVEvent,
    MalformedEventError,
    check_medium,
)
from cachetier.kvevents.framing import Topic, parse_topic
from cachetier.kvevents.publisher import KVEventPublisher, PublisherStats
from cachetier.kvevents.subscriber import Delivery, KVEventSubscriber, SubscriberStats

__all__ = [
    "MEDIUM_GPU",
    "AllBlocksCleared",
    "BatchCodec",
    "BlockRemoved",
    "BlockStored",
    "Delivery",
    "EventBatch",
    "EventSink",
    "KVEvent",
    "KVEventPublisher",
    "KVEventSubscriber",
    "MalformedEventError",
    "PublisherConfig",
    "PublisherStats",
    "SubscriberConfig",
    "SubscriberStats",
    "TierEvents",
    "Topic",
    "check_medium",
    "parse_topic",
]
