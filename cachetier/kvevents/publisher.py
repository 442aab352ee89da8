"""``KVEventPublisher``: a process's KV events on a ZMQ PUB socket, with replay.

The caller's ``publish`` only queues: a background thread owns the sockets, coalesces what
is queued into batches, numbers them, sends them and keeps them for replay. A full queue
drops the call's events and counts them; the next batch then skips a sequence number, so
every subscriber sees a gap that no replay fills and knows its view is incomplete.
"""

from __future__ import annotations

import logging
import queue
import socket
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace

import zmq
from zmq.auth.thread import ThreadAuthenticator

from cachetier.kvevents.config import PublisherConfig
from cachetier.kvevents.curve import make_server, start_authenticator
from cachetier.kvevents.events import (
    AllBlocksCleared,
    BatchCodec,
    BlockRemoved,
    BlockStored,
    EventBatch,
    KVEvent,
    check_keys,
    check_medium,
    count_blocks,
)
from cachetier.kvevents.framing import (
    Topic,
    encode_seq,
    parse_replay_request,
    replay_answer,
    replay_end,
)
from cachetier.kvevents.replay import ReplayBuffer
from cachetier.primitives.keys import BlockHash

logger = logging.getLogger("cachetier.kvevents")

MAX_REPLAYS_PER_TURN = 16
"""Replay requests answered before the thread sends queued batches again: a client asking
in a loop must not starve the live stream."""
_MAX_REQUEST_BYTES = 1024
# A replay request is an 8-byte number: ZMQ disconnects a peer that sends a larger frame
# before anything is allocated for it.
_EVENT_TYPES = (BlockStored, BlockRemoved, AllBlocksCleared)
REPLAY_CLIENT_TTL_S = 10.0
"""How long a replay client counts against ``max_replay_clients`` after its last request."""


@dataclass(frozen=True, slots=True)
class PublisherStats:
    """Counters of one publisher since it started."""

    num_batches: int
    num_events: int
    num_dropped_events: int
    num_replay_requests: int
    num_bad_replay_requests: int
    num_errors: int
    buffered_batches: int
    next_seq: int
    num_replay_clients_refused: int = 0
    num_replay_answers_cut: int = 0


class KVEventPublisher:
    """Publishes KV events on a PUB socket and answers replay requests on a ROUTER socket.

    Args:
        config: endpoints, bounds and the replica name.
        epoch: this process's epoch, in every batch; larger means started later (a consumer
            drops an older one's events). Defaults to the start time in nanoseconds.
        clock: Unix seconds, stamped on each batch.

    Raises:
        ValueError: an endpoint cannot be bound (in use, or a bad address), or a CURVE key
            file cannot be read.
    """

    def __init__(
        self,
        config: PublisherConfig,
        *,
        epoch: int | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.config = config
        self.topic = Topic(config.replica, config.model)
        self.epoch = time.time_ns() if epoch is None else epoch
        if isinstance(self.epoch, bool) or not isinstance(self.epoch, int) or self.epoch < 0:
            raise ValueError(f"epoch must be an int >= 0, got {self.epoch!r}")
        self._topic_bytes = self.topic.encode()
        self._clock = clock
        self._queue: queue.Queue[tuple[KVEvent, ...]] = queue.Queue(config.max_queue_batches)
        self._buffer = ReplayBuffer(config.buffer_batches, config.buffer_bytes)
        self._codec = BatchCodec(config.encoding)
        self._replay_clients: OrderedDict[bytes, float] = OrderedDict()
        self._lock = threading.Lock()
        self._closed = False
        self._seq = 0
        self._num_dropped = 0
        self._dropped_seen = 0
        self._counts = dict.fromkeys(
            ("batches", "events", "requests", "bad", "errors", "refused", "cut"), 0
        )
        # Wakes the thread when events are queued or close() is called, so it sleeps in
        # poll() rather than waking on a timer to look at the queue.
        self._wake_r, self._wake_w = socket.socketpair()
        self._ctx = zmq.Context()
        self._pub: zmq.Socket | None = None
        self._replay: zmq.Socket | None = None
        self._auth: ThreadAuthenticator | None = None
        try:
            self._open_sockets()
        except BaseException:
            self._close_sockets()
            if self._auth is not None:
                self._auth.stop()
            self._wake_w.close()
            self._ctx.term()
            raise
        self._wake_pending = False
        self._thread = threading.Thread(
            target=self._run, name=f"cachetier-kvevents-{config.replica}", daemon=True
        )
        self._thread.start()

    def _open_sockets(self) -> None:
        config = self.config
        self._wake_w.setblocking(False)
        if config.curve_public_keys_dir is not None:
            self._auth = start_authenticator(self._ctx, config.curve_public_keys_dir)
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.SNDHWM, config.send_hwm)
        self._pub.setsockopt(zmq.LINGER, 0)
        if config.curve_secret_key_file is not None:
            make_server(self._pub, config.curve_secret_key_file)
        self.endpoint = _bind(self._pub, config.endpoint)
        self.replay_endpoint: str | None = None
        if config.replay_endpoint is not None:
            self._replay = self._ctx.socket(zmq.ROUTER)
            self._replay.setsockopt(zmq.MAXMSGSIZE, _MAX_REQUEST_BYTES)
            # A client that does not read fills its queue at replay_hwm messages; past it a
            # send fails at once (ROUTER_MANDATORY) rather than queueing more for it.
            self._replay.setsockopt(zmq.SNDHWM, config.replay_hwm)
            self._replay.setsockopt(zmq.ROUTER_MANDATORY, 1)
            self._replay.setsockopt(zmq.LINGER, 0)
            # Payloads go out by reference to the buffer's bytes, not copied per client.
            self._replay.copy_threshold = 0
            if config.curve_secret_key_file is not None:
                make_server(self._replay, config.curve_secret_key_file)
            self.replay_endpoint = _bind(self._replay, config.replay_endpoint)

    def publish(self, events: Sequence[KVEvent]) -> bool:
        """Queue ``events`` to go out together in one batch; never blocks.

        Args:
            events: ``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared``, in order.

        Returns:
            False when they were dropped (the queue is full, or the publisher is closed).

        Raises:
            TypeError: an item is not a KV event.
        """
        for event in events:
            if not isinstance(event, _EVENT_TYPES):
                raise TypeError(f"not a KV event: {type(event).__name__}")
        if not events:
            return True
        if self._closed:
            return False
        try:
            self._queue.put_nowait(tuple(events))
        except queue.Full:
            with self._lock:
                self._num_dropped += len(events)
            return False
        self._wake()
        return True

    def announce_snapshot(
        self, medium: str, blocks: Iterable[BlockHash], *, block_size: int = 0
    ) -> int:
        """Publish what a persistent tier holds, as ``BlockStored`` events, so its blocks are
        routable as soon as the process starts.

        The events carry no tokens and no parents (a disk record keeps neither): consumers
        match by key, and our keys are chained over the tokens.

        Args:
            medium: the tier's medium name (``"disk"``).
            blocks: every key it holds; read once, in chunks of ``max_batch_blocks``.
            block_size: tokens per block, where the tier knows it (0 when it does not).

        Returns:
            How many keys were queued (fewer than given when the queue was full).

        Raises:
            ValueError: ``medium`` is not a medium name, or a key is not a 32-byte key.
        """
        check_medium(medium)
        queued = 0
        chunk: list[BlockHash] = []
        for key in blocks:
            chunk.append(key)
            if len(chunk) == self.config.max_batch_blocks:
                queued += self._publish_chunk(medium, chunk, block_size)
                chunk = []
        if chunk:
            queued += self._publish_chunk(medium, chunk, block_size)
        return queued

    def _publish_chunk(self, medium: str, keys: list[BlockHash], block_size: int) -> int:
        event = BlockStored(check_keys(keys), None, (), block_size, medium)
        return len(keys) if self.publish([event]) else 0

    def stats(self) -> PublisherStats:
        """The counters now."""
        counts = self._counts
        with self._lock:
            dropped = self._num_dropped
        return PublisherStats(
            num_batches=counts["batches"],
            num_events=counts["events"],
            num_dropped_events=dropped,
            num_replay_requests=counts["requests"],
            num_bad_replay_requests=counts["bad"],
            num_errors=counts["errors"],
            buffered_batches=len(self._buffer),
            next_seq=self._seq,
            num_replay_clients_refused=counts["refused"],
            num_replay_answers_cut=counts["cut"],
        )

    def close(self, timeout_s: float = 2.0) -> None:
        """Send what is queued, close the sockets and join the thread (waiting at most
        ``timeout_s``). Later ``publish`` calls return False."""
        self._closed = True
        self._wake(force=True)
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            # Terminating the context would block on the thread's sockets: leave both.
            logger.warning("KV event publisher thread did not stop within %.1f s", timeout_s)
            return
        if self._auth is not None:
            self._auth.stop()
            self._auth = None
        if not self._ctx.closed:
            self._ctx.term()
            self._wake_w.close()

    def __enter__(self) -> KVEventPublisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _wake(self, force: bool = False) -> None:
        # One byte per wake, not one per call. The thread clears the flag after reading the
        # bytes and before draining the queue, so a call that finds it set has its events
        # drained by that pass, and one that finds it clear writes a byte of its own.
        if self._wake_pending and not force:
            return
        self._wake_pending = True
        try:
            self._wake_w.send(b"\0")
        except OSError:  # full (a wake is pending anyway) or closed
            pass

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._wake_r, zmq.POLLIN)
        if self._replay is not None:
            poller.register(self._replay, zmq.POLLIN)
        last_sent = time.monotonic()
        try:
            while not self._closed:
                ready = dict(poller.poll(self._poll_timeout_ms(last_sent)))
                if self._wake_r.fileno() in ready:
                    # Read the bytes, then clear the flag, then drain the queue: a call that
                    # saw the flag set queued its events before this drain.
                    self._wake_r.recv(4096)
                    self._wake_pending = False
                if self._replay is not None and self._replay in ready:
                    self._serve_replays()
                if self._send_queued():
                    last_sent = time.monotonic()
                elif self._heartbeat_due(last_sent):
                    self._send(())
                    last_sent = time.monotonic()
            self._send_queued()  # what was queued before close()
        except Exception:  # noqa: BLE001 - log it: nothing else would see the thread die
            logger.exception("KV event publisher thread failed")
        finally:
            self._close_sockets()

    def _poll_timeout_ms(self, last_sent: float) -> int | None:
        if self.config.heartbeat_s is None:
            return None
        left = self.config.heartbeat_s - (time.monotonic() - last_sent)
        return max(0, int(left * 1000) + 1)

    def _heartbeat_due(self, last_sent: float) -> bool:
        beat = self.config.heartbeat_s
        return beat is not None and time.monotonic() - last_sent >= beat

    def _send_queued(self) -> bool:
        """Send every queued call, coalesced into batches of at most ``max_batch_blocks``."""
        sent = False
        pending: list[KVEvent] = []
        num_blocks = 0
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                break
            size = count_blocks(item)
            if pending and num_blocks + size > self.config.max_batch_blocks:
                self._send(pending)
                sent, pending, num_blocks = True, [], 0
            pending.extend(item)
            num_blocks += size
        if pending:
            self._send(pending)
            sent = True
        return sent

    def _send(self, events: Sequence[KVEvent]) -> None:
        assert self._pub is not None, "sockets are open while the thread runs"
        with self._lock:
            dropped = self._num_dropped
        if dropped != self._dropped_seen:
            # Burn a sequence number: subscribers see a gap that no replay can fill.
            self._dropped_seen = dropped
            self._seq += 1
        seq = self._seq
        if not self.config.publish_token_ids:
            events = [_without_tokens(e) for e in events]
        try:
            batch = EventBatch(
                self._clock(), tuple(events), self.config.data_parallel_rank, self.epoch
            )
            payload = self._codec.encode(batch)
            self._pub.send_multipart([self._topic_bytes, encode_seq(seq), payload])
        except (zmq.ZMQError, TypeError, ValueError):
            self._counts["errors"] += 1
            logger.exception("KV event batch %d not sent", seq)
            return
        finally:
            self._seq = seq + 1
        self._buffer.append(seq, payload)
        self._counts["batches"] += 1
        self._counts["events"] += len(events)

    def _serve_replays(self) -> None:
        assert self._replay is not None, "only called with a replay socket"
        for _ in range(MAX_REPLAYS_PER_TURN):
            try:
                frames = self._replay.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            self._counts["requests"] += 1
            request = parse_replay_request(frames)
            if request is None or request.start is None:
                self._counts["bad"] += 1
            if request is None:
                continue
            start = request.start if self._admit(request.envelope[0]) else None
            try:
                self._answer(request.envelope, start)
            except zmq.ZMQError:
                # Its queue is full (it has not read its last answer) or it is gone: it gets
                # no more of this answer, and nothing is queued for it beyond replay_hwm.
                self._counts["cut"] += 1

    def _admit(self, identity: bytes) -> bool:
        """Whether a request of ``identity`` is answered: at most ``max_replay_clients``
        distinct clients within ``REPLAY_CLIENT_TTL_S``."""
        now = time.monotonic()
        clients = self._replay_clients
        while clients and next(iter(clients.values())) < now - REPLAY_CLIENT_TTL_S:
            clients.popitem(last=False)
        if identity not in clients and len(clients) >= self.config.max_replay_clients:
            self._counts["refused"] += 1
            return False
        clients[identity] = now
        clients.move_to_end(identity)
        return True

    def _answer(self, envelope: tuple[bytes, ...], start: int | None) -> None:
        assert self._replay is not None, "only called with a replay socket"
        if start is not None:
            # Half a queue an answer: ZMQ learns what a peer took in steps of half its HWM,
            # so an answer after one the client has read always fits. The client asks again
            # from where this one stopped: one request never queues a whole buffer.
            batches = self._buffer.since(start)[: self.config.replay_hwm // 2]
            # Reading ZMQ_EVENTS takes in the peers' acknowledgements now (a send does so at
            # most once a millisecond), so a client that has read is not taken for one that
            # has not.
            self._replay.getsockopt(zmq.EVENTS)
            for seq, payload in batches:
                answer = replay_answer(envelope, self._topic_bytes, seq, payload)
                self._replay.send_multipart(answer, zmq.NOBLOCK, copy=False)
        # A malformed or refused request gets the end marker alone: the client stops waiting.
        self._replay.send_multipart(replay_end(envelope), zmq.NOBLOCK)

    def _close_sockets(self) -> None:
        for sock in (self._pub, self._replay):
            if sock is not None:
                sock.close(linger=0)
        self._wake_r.close()


def _without_tokens(event: KVEvent) -> KVEvent:
    if isinstance(event, BlockStored) and event.token_ids:
        return replace(event, token_ids=())
    return event


def _bind(sock: zmq.Socket, endpoint: str) -> str:
    """Bind ``sock``; returns the endpoint bound (port 0 resolved to the port taken)."""
    try:
        sock.bind(endpoint)
    except zmq.ZMQError as exc:
        raise ValueError(f"cannot bind {endpoint!r} ({exc}): name a free port, or port 0") from exc
    return sock.getsockopt_string(zmq.LAST_ENDPOINT)
