"""``KVEventSubscriber``: one publisher's batches, in order, with gaps replayed.

A consumer (the fleet's prefix index) calls ``receive`` from a thread of its own and applies
what comes back::

    for d in subscriber.receive(timeout_s=0.5):
        index.apply(d.replica, d.epoch, d.seq, d.batch.changes())

Each delivery says how many batches before it never arrived (``num_missed``): lost beyond
the publisher's replay buffer, dropped from its full queue, or undecodable. A consumer that
sees one knows its view of that replica is incomplete and resyncs it.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import zmq

from cachetier.kvevents.config import SubscriberConfig
from cachetier.kvevents.events import BatchCodec, EventBatch, MalformedEventError
from cachetier.kvevents.framing import (
    END_SEQ,
    Topic,
    decode_seq,
    encode_replay_request,
    parse_topic,
)


@dataclass(frozen=True, slots=True)
class Delivery:
    """One batch of one publisher's stream.

    ``num_missed`` counts the batches of this stream between the previous delivery and this
    one that never arrived (for the first delivery of an epoch: since sequence number 0).
    """

    replica: str
    epoch: int
    seq: int
    batch: EventBatch
    num_missed: int = 0


@dataclass(frozen=True, slots=True)
class SubscriberStats:
    """Counters of one subscriber since it started."""

    num_delivered: int
    num_replayed: int
    num_missed: int
    num_duplicates: int
    num_stale: int
    num_malformed: int
    num_foreign: int
    num_replay_timeouts: int


@dataclass(slots=True)
class _Stream:
    epoch: int
    last_seq: int = -1


class KVEventSubscriber:
    """Follows one publisher: SUB for the live stream, a DEALER for replays.

    Not thread-safe: one thread calls ``receive``.

    Args:
        config: the publisher's endpoints and the subscriber's bounds.
    """

    def __init__(self, config: SubscriberConfig) -> None:
        self.config = config
        self._codec = BatchCodec()
        self._streams: dict[str, _Stream] = {}
        self._counts = dict.fromkeys(
            ("delivered", "replayed", "missed", "duplicates", "stale", "malformed", "foreign"), 0
        )
        self._counts["replay_timeouts"] = 0
        self._ctx = zmq.Context()
        self._dealer: zmq.Socket | None = None
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.LINGER, 0)
        self._sub.setsockopt(zmq.MAXMSGSIZE, config.max_message_bytes)
        self._sub.setsockopt(zmq.SUBSCRIBE, config.topic.encode("utf-8"))
        self._sub.connect(config.endpoint)

    def receive(self, timeout_s: float = 0.0, max_messages: int = 1000) -> list[Delivery]:
        """Wait up to ``timeout_s`` for a message, then take what is waiting.

        Args:
            timeout_s: seconds to wait for the first message (0: do not wait).
            max_messages: most live messages taken in one call (replayed ones come on top).

        Returns:
            Deliveries in stream order; empty when nothing came.
        """
        out: list[Delivery] = []
        if not self._sub.poll(max(0, int(timeout_s * 1000))):
            return out
        for _ in range(max_messages):
            try:
                frames = self._sub.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            out.extend(self._on_message(frames))
        return out

    def stats(self) -> SubscriberStats:
        """The counters now."""
        c = self._counts
        return SubscriberStats(
            num_delivered=c["delivered"],
            num_replayed=c["replayed"],
            num_missed=c["missed"],
            num_duplicates=c["duplicates"],
            num_stale=c["stale"],
            num_malformed=c["malformed"],
            num_foreign=c["foreign"],
            num_replay_timeouts=c["replay_timeouts"],
        )

    def close(self) -> None:
        """Close the sockets (pending messages are dropped); closing twice is harmless."""
        self._sub.close(linger=0)
        self._reset_dealer()
        if not self._ctx.closed:
            self._ctx.term()

    def __enter__(self) -> KVEventSubscriber:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _on_message(self, frames: Sequence[bytes]) -> list[Delivery]:
        seq = decode_seq(frames[1]) if len(frames) == 3 else None
        if seq is None:
            self._counts["malformed"] += 1
            return []
        topic = self._topic(frames[0], seq)
        if topic is None:
            self._counts["foreign"] += 1
            return []
        stream = self._streams.get(topic.replica)
        if stream is None or topic.epoch > stream.epoch:
            stream = self._streams[topic.replica] = _Stream(topic.epoch)
        elif topic.epoch < stream.epoch:
            self._counts["stale"] += 1  # a process that is gone
            return []
        expected = stream.last_seq + 1
        if seq < expected:
            self._counts["duplicates"] += 1
            return []
        found = self._replay(frames[0], expected, seq) if seq > expected else []
        found.append((seq, frames[2]))
        return self._deliver(topic, stream, found)

    def _topic(self, frame: bytes, seq: int) -> Topic | None:
        topic = parse_topic(frame)
        if topic is not None or self.config.replica is None:
            return topic
        # vLLM's publisher names no epoch: a sequence number that goes back is a restart.
        stream = self._streams.get(self.config.replica)
        epoch = 0 if stream is None else stream.epoch + (seq <= stream.last_seq)
        return Topic(self.config.replica, epoch)

    def _deliver(
        self, topic: Topic, stream: _Stream, found: list[tuple[int, bytes]]
    ) -> list[Delivery]:
        out: list[Delivery] = []
        missed = 0
        for seq, payload in found:
            missed += seq - stream.last_seq - 1
            stream.last_seq = seq
            try:
                batch = self._codec.decode(payload)
            except MalformedEventError:
                self._counts["malformed"] += 1
                missed += 1
                continue
            out.append(Delivery(topic.replica, topic.epoch, seq, batch, missed))
            self._counts["missed"] += missed
            self._counts["delivered"] += 1
            missed = 0
        self._counts["missed"] += missed
        return out

    def _replay(self, topic: bytes, start: int, until: int) -> list[tuple[int, bytes]]:
        """Batches ``start`` to ``until - 1`` that the publisher still holds, in order."""
        if self.config.replay_endpoint is None:
            return []
        dealer = self._open_dealer()
        dealer.send_multipart(encode_replay_request(start))
        deadline = time.monotonic() + self.config.replay_timeout_s
        found: dict[int, bytes] = {}
        while True:
            left_ms = int((deadline - time.monotonic()) * 1000)
            if left_ms <= 0 or not dealer.poll(left_ms):
                # Late answers to this request must not be read as answers to the next one.
                self._counts["replay_timeouts"] += 1
                self._reset_dealer()
                break
            frames = dealer.recv_multipart()
            body = frames[1:] if frames and frames[0] == b"" else frames
            if len(body) == 3 and body[1] == END_SEQ:
                break
            seq = decode_seq(body[1]) if len(body) == 3 else None
            if seq is None:
                self._counts["malformed"] += 1
            elif body[0] == topic and start <= seq < until:
                found[seq] = body[2]
        self._counts["replayed"] += len(found)
        return sorted(found.items())

    def _open_dealer(self) -> zmq.Socket:
        if self._dealer is None:
            assert self.config.replay_endpoint is not None, "only opened for a replay endpoint"
            self._dealer = self._ctx.socket(zmq.DEALER)
            self._dealer.setsockopt(zmq.LINGER, 0)
            self._dealer.setsockopt(zmq.MAXMSGSIZE, self.config.max_message_bytes)
            self._dealer.connect(self.config.replay_endpoint)
        return self._dealer

    def _reset_dealer(self) -> None:
        if self._dealer is not None:
            self._dealer.close(linger=0)
            self._dealer = None
