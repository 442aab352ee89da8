"""Fixtures of the KV-event tests: real publishers and subscribers on 127.0.0.1, each bound
to port 0 and read back, closed at the end of the test."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from cachetier.kvevents import (
    KVEventPublisher,
    KVEventSubscriber,
    PublisherConfig,
    SubscriberConfig,
)


@pytest.fixture
def make_publisher() -> Iterator[Callable[..., KVEventPublisher]]:
    """Builds publishers (replica ``r0``, epoch 1, a heartbeat every 50 ms unless told
    otherwise); closes them afterwards."""
    made: list[KVEventPublisher] = []

    def make(
        replica: str = "r0",
        *,
        epoch: int = 1,
        clock: Callable[[], float] = time.time,
        **settings: Any,
    ) -> KVEventPublisher:
        settings.setdefault("heartbeat_s", 0.05)
        publisher = KVEventPublisher(PublisherConfig(replica, **settings), epoch=epoch, clock=clock)
        made.append(publisher)
        return publisher

    yield make
    for publisher in made:
        publisher.close()


@pytest.fixture
def make_subscriber() -> Iterator[Callable[..., KVEventSubscriber]]:
    """Builds a subscriber of a publisher (its replay endpoint too unless told otherwise);
    closes them afterwards."""
    made: list[KVEventSubscriber] = []

    def make(publisher: KVEventPublisher, **settings: Any) -> KVEventSubscriber:
        settings.setdefault("replay_endpoint", publisher.replay_endpoint)
        subscriber = KVEventSubscriber(SubscriberConfig(publisher.endpoint, **settings))
        made.append(subscriber)
        return subscriber

    yield make
    for subscriber in made:
        subscriber.close()
