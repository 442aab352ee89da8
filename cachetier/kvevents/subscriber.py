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
from cachetier.kvevents.curve import make_client
from cachetier.kvevents.events import BatchCodec, EventBatch, MalformedEventError
from cachetier.kvevents.framing import (
    END_SEQ,
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
        try:
            self._maybe_curve(self._sub)
            self._sub.connect(config.endpoint)
        except BaseException:
            self.close()
            raise

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
        topic = parse_topic(frames[0])
        replica = topic.replica if topic is not None else self.config.replica
        if replica is None:
            self._counts["foreign"] += 1
            return []
        try:
            batch = self._codec.decode(frames[2])
        except MalformedEventError:
            # Not delivered: the next batch finds the gap and counts it missed.
            self._counts["malformed"] += 1
            return []
        epoch = batch.epoch if batch.epoch is not None else self._vllm_epoch(replica, seq)
        stream = self._streams.get(replica)
        if stream is None or epoch > stream.epoch:
            stream = self._streams[replica] = _Stream(epoch)
        elif epoch < stream.epoch:
            self._counts["stale"] += 1  # a process that is gone
            return []
        expected = stream.last_seq + 1
        if seq < expected:
            self._counts["duplicates"] += 1
            return []
        found = self._replay(frames[0], batch.epoch, expected, seq) if seq > expected else []
        found.append((seq, batch))
        return self._deliver(replica, stream, found)

    def _vllm_epoch(self, replica: str, seq: int) -> int:
        # vLLM's publisher names no epoch: a sequence number that goes back is a restart.
        stream = self._streams.get(replica)
        return 0 if stream is None else stream.epoch + (seq <= stream.last_seq)

    def _deliver(
        self, replica: str, stream: _Stream, found: list[tuple[int, EventBatch]]
    ) -> list[Delivery]:
        out: list[Delivery] = []
        for seq, batch in found:
            missed = seq - stream.last_seq - 1
            stream.last_seq = seq
            out.append(Delivery(replica, stream.epoch, seq, batch, missed))
            self._counts["missed"] += missed
            self._counts["delivered"] += 1
        return out

    def _replay(
        self, topic: bytes, epoch: int | None, start: int, until: int
    ) -> list[tuple[int, EventBatch]]:
        """Batches ``start`` to ``until - 1`` of ``epoch`` that the publisher still holds, in
        order. The publisher answers a few batches a request: ask again from where the last
        answer stopped until it brings nothing new."""
        if self.config.replay_endpoint is None:
            return []
        deadline = time.monotonic() + self.config.replay_timeout_s
        found: dict[int, EventBatch] = {}
        while start < until:
            got = self._replay_once(topic, epoch, start, until, deadline)
            if got is None or not got:
                break
            found.update(got)
            start = max(got) + 1
        self._counts["replayed"] += len(found)
        return sorted(found.items())

    def _replay_once(
        self, topic: bytes, epoch: int | None, start: int, until: int, deadline: float
    ) -> dict[int, EventBatch] | None:
        """One request's answer; ``None`` when it timed out."""
        dealer = self._open_dealer()
        dealer.send_multipart(encode_replay_request(start))
        found: dict[int, EventBatch] = {}
        while True:
            left_ms = int((deadline - time.monotonic()) * 1000)
            if left_ms <= 0 or not dealer.poll(left_ms):
                # Late answers to this request must not be read as answers to the next one.
                self._counts["replay_timeouts"] += 1
                self._reset_dealer()
                return None
            frames = dealer.recv_multipart()
            body = frames[1:] if frames and frames[0] == b"" else frames
            if len(body) == 3 and body[1] == END_SEQ:
                return found
            seq = decode_seq(body[1]) if len(body) == 3 else None
            if seq is None or body[0] != topic or not start <= seq < until:
                self._counts["malformed"] += seq is None
                continue
            try:
                batch = self._codec.decode(body[2])
            except MalformedEventError:
                self._counts["malformed"] += 1
                continue
            if batch.epoch == epoch:  # a restarted process's batches are not this stream's
                found[seq] = batch

    def _open_dealer(self) -> zmq.Socket:
        if self._dealer is None:
            assert self.config.replay_endpoint is not None, "only opened for a replay endpoint"
            self._dealer = self._ctx.socket(zmq.DEALER)
            self._dealer.setsockopt(zmq.LINGER, 0)
            self._dealer.setsockopt(zmq.MAXMSGSIZE, self.config.max_message_bytes)
            self._maybe_curve(self._dealer)
            self._dealer.connect(self.config.replay_endpoint)
        return self._dealer

    def _reset_dealer(self) -> None:
        if self._dealer is not None:
            self._dealer.close(linger=0)
            self._dealer = None

    def _maybe_curve(self, sock: zmq.Socket) -> None:
        key, server = self.config.curve_secret_key_file, self.config.curve_server_key_file
        if key is not None and server is not None:
            make_client(sock, key, server)
