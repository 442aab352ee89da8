"""What the KV-event tests share beyond fixtures: reading a stream until a condition holds."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable

from cachetier.kvevents import BlockRemoved, Delivery, KVEventPublisher, KVEventSubscriber
from cachetier.primitives.keys import BlockHash

WAIT_S = 5.0


def random_keys(count: int) -> list[BlockHash]:
    """``count`` distinct 32-byte keys (the events carry keys only; no chain is needed)."""
    return [BlockHash(os.urandom(32)) for _ in range(count)]


def collect(
    subscriber: KVEventSubscriber,
    done: Callable[[list[Delivery]], bool],
    timeout_s: float = WAIT_S,
) -> list[Delivery]:
    """Deliveries received until ``done(all so far)``; fails after ``timeout_s``.

    A subscriber that connects after a batch went out learns of it from the next one (the
    publishers of these tests beat every 50 ms) and replays it.
    """
    got: list[Delivery] = []
    deadline = time.monotonic() + timeout_s
    while not done(got):
        assert time.monotonic() < deadline, f"stream incomplete after {timeout_s} s: {got[-3:]}"
        got += subscriber.receive(timeout_s=0.05)
    return got


def with_events(deliveries: list[Delivery]) -> list[Delivery]:
    """The deliveries that carry events (not heartbeats)."""
    return [d for d in deliveries if d.batch.events]


def wait_connected(publisher: KVEventPublisher, subscriber: KVEventSubscriber) -> int:
    """Publish empty probes until ``subscriber`` receives one live, then read until it has seen
    every batch sent: from then on it misses nothing (ZMQ's SUB drops what was sent before it
    connected). Returns the last sequence number seen."""
    deadline = time.monotonic() + WAIT_S
    last = -1
    while last < 0 or last != publisher.stats().next_seq - 1:
        assert time.monotonic() < deadline, "the subscriber never connected"
        if last < 0:
            publisher.publish([BlockRemoved((), "probe")])
        for delivery in subscriber.receive(timeout_s=0.05):
            last = delivery.seq
    return last


def wait_sent(publisher: KVEventPublisher, num_events: int) -> None:
    """Wait until ``publisher`` has sent ``num_events`` events."""
    deadline = time.monotonic() + WAIT_S
    while publisher.stats().num_events < num_events:
        assert time.monotonic() < deadline, publisher.stats()
        time.sleep(0.001)


class HeldClock:
    """A publisher's clock that, once ``hold`` is called, stops the publisher's thread at the
    next batch it stamps, until ``release``: what a slow thread looks like to its callers."""

    def __init__(self) -> None:
        self._holding = threading.Event()
        self._held = threading.Event()
        self._released = threading.Event()

    def __call__(self) -> float:
        if self._holding.is_set():
            self._held.set()
            self._released.wait(WAIT_S)
        return time.time()

    def hold(self) -> None:
        self._released.clear()
        self._holding.set()

    def wait_held(self) -> None:
        assert self._held.wait(WAIT_S), "the publisher's thread never stamped a batch"

    def release(self) -> None:
        self._holding.clear()
        self._released.set()
