"""The publisher on real sockets: frames and sequence numbers, replay, a full queue that
drops and counts instead of blocking, bad replay requests, heartbeats and a prompt close."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator

import pytest
import zmq

from cachetier.kvevents import (
    BatchCodec,
    BlockRemoved,
    BlockStored,
    KVEventPublisher,
    KVEventSubscriber,
    Topic,
)
from cachetier.kvevents.framing import END_SEQ, MAX_SEQ, encode_seq
from tests.cachetier.kvevents.streams import (
    WAIT_S,
    HeldClock,
    collect,
    random_keys,
    wait_connected,
    wait_sent,
    with_events,
)

MakePublisher = Callable[..., KVEventPublisher]
MakeSubscriber = Callable[..., KVEventSubscriber]


@pytest.fixture
def context() -> Iterator[zmq.Context]:
    """A ZMQ context for the tests' own raw sockets (each closed by the test)."""
    ctx = zmq.Context()
    yield ctx
    ctx.term()


def _replay(ctx: zmq.Context, endpoint: str, request: list[bytes]) -> list[list[bytes]]:
    """What a DEALER is answered to ``request``, up to and with the end marker."""
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(endpoint)
    try:
        dealer.send_multipart(request)
        answers: list[list[bytes]] = []
        while not answers or answers[-1][2] != END_SEQ:
            assert dealer.poll(int(WAIT_S * 1000)), f"no end marker after {answers}"
            answers.append(dealer.recv_multipart())
        return answers
    finally:
        dealer.close()


def test_live_frames_are_topic_sequence_payload_with_sequence_numbers_from_zero(
    make_publisher: MakePublisher, context: zmq.Context
) -> None:
    publisher = make_publisher("pod-a", epoch=0x1234, data_parallel_rank=3, model="org/m-1")
    assert publisher.topic == Topic("pod-a", "org/m-1")
    sub = context.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv@pod-a@")
    sub.connect(publisher.endpoint)
    try:
        seqs: list[int] = []
        while len(seqs) < 5:  # heartbeats, every 50 ms
            assert sub.poll(int(WAIT_S * 1000))
            topic, seq, payload = sub.recv_multipart()
            assert topic == b"kv@pod-a@org/m-1"  # llm-d's kv@<pod-id>@<model-name>
            seqs.append(int.from_bytes(seq, "big"))
            batch = BatchCodec().decode(payload)
            assert (batch.data_parallel_rank, batch.epoch) == (3, 0x1234)
    finally:
        sub.close()
    assert seqs == list(range(seqs[0], seqs[0] + 5)), "one stream, counting up by one"


def test_replay_answers_the_buffered_batches_from_the_asked_number_then_the_end_marker(
    make_publisher: MakePublisher, context: zmq.Context
) -> None:
    publisher = make_publisher(heartbeat_s=None)
    keys = random_keys(5)
    for key in keys:
        assert publisher.publish([BlockRemoved((key,), "disk")])
        wait_sent(publisher, keys.index(key) + 1)  # one batch each, not coalesced
    assert publisher.replay_endpoint is not None
    answers = _replay(context, publisher.replay_endpoint, [b"", encode_seq(2)])
    assert [a[2] for a in answers] == [encode_seq(s) for s in (2, 3, 4)] + [END_SEQ]
    assert all(a[0] == b"" and a[1] == publisher.topic.encode() for a in answers[:-1])
    assert answers[-1] == [b"", b"", END_SEQ, b""]
    codec = BatchCodec()
    assert [codec.decode(a[3]).events for a in answers[:-1]] == [
        (BlockRemoved((k,), "disk"),) for k in keys[2:]
    ]


def test_a_full_queue_drops_and_counts_instead_of_blocking_and_the_loss_is_seen(
    make_publisher: MakePublisher, make_subscriber: MakeSubscriber
) -> None:
    clock = HeldClock()
    publisher = make_publisher(heartbeat_s=None, max_queue_batches=2, clock=clock)
    subscriber = make_subscriber(publisher)
    last = wait_connected(publisher, subscriber)
    keys = random_keys(6)
    clock.hold()
    assert publisher.publish([BlockStored((keys[0],), None, (), 0, "disk")])
    clock.wait_held()
    start = time.monotonic()
    queued = [publisher.publish([BlockRemoved((k,), "disk")]) for k in keys[1:]]
    assert time.monotonic() - start < 0.5, "publish waited for the thread"
    assert queued == [True, True, False, False, False]
    assert publisher.stats().num_dropped_events == 3
    clock.release()
    got = with_events(collect(subscriber, lambda got: len(with_events(got)) == 2))
    # The held batch, then the two queued ones together, one sequence number skipped between
    # them: the subscriber knows one batch's worth was lost, though none was replayable.
    assert [d.seq for d in got] == [last + 1, last + 3]
    assert [d.num_missed for d in got] == [0, 1]
    assert got[1].batch.events == tuple(BlockRemoved((k,), "disk") for k in keys[1:3])
    assert subscriber.stats().num_missed == 1


@pytest.mark.parametrize(
    "request_frames,malformed",
    [
        ([b"", b"garbage"], True),
        ([b"", encode_seq(MAX_SEQ)], False),
        ([b"", END_SEQ], False),  # 2**64 - 1 read unsigned, as vLLM reads it: past everything
        ([b"", encode_seq(0), b"extra"], True),
        ([b"", b""], True),
    ],
    ids=["garbage", "huge", "end-marker", "extra-frame", "empty"],
)
def test_a_bad_or_hopeless_replay_request_gets_the_end_marker_and_serving_goes_on(
    make_publisher: MakePublisher,
    make_subscriber: MakeSubscriber,
    context: zmq.Context,
    request_frames: list[bytes],
    malformed: bool,
) -> None:
    publisher = make_publisher()
    publisher.publish([BlockRemoved((), "disk")])
    wait_sent(publisher, 1)  # the buffer is not empty
    assert publisher.replay_endpoint is not None
    assert _replay(context, publisher.replay_endpoint, request_frames) == [[b"", b"", END_SEQ, b""]]
    assert publisher.stats().num_bad_replay_requests == int(malformed)
    # The same publisher still replays and still publishes.
    assert len(_replay(context, publisher.replay_endpoint, [b"", encode_seq(0)])) >= 2
    later = BlockRemoved(tuple(random_keys(1)), "disk")
    publisher.publish([later])
    subscriber = make_subscriber(publisher)
    collect(subscriber, lambda got: any(d.batch.events == (later,) for d in got))


def test_an_oversized_replay_request_loses_its_connection_not_the_publisher(
    make_publisher: MakePublisher, context: zmq.Context
) -> None:
    publisher = make_publisher()
    assert publisher.replay_endpoint is not None
    dealer = context.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(publisher.replay_endpoint)
    try:
        dealer.send_multipart([b"", b"x" * (1 << 20)])
        assert not dealer.poll(200), "no answer to a request ZMQ refused"
    finally:
        dealer.close()
    assert _replay(context, publisher.replay_endpoint, [b"", encode_seq(0)])[-1][2] == END_SEQ
    assert publisher.stats().num_replay_requests == 1


def test_an_idle_publisher_beats(
    make_publisher: MakePublisher, make_subscriber: MakeSubscriber
) -> None:
    publisher = make_publisher(heartbeat_s=0.05)
    subscriber = make_subscriber(publisher)
    got = collect(subscriber, lambda got: len(got) >= 3)
    assert all(d.batch.events == () for d in got)


def test_close_is_prompt_sends_what_was_queued_and_joins_its_thread(
    make_publisher: MakePublisher, make_subscriber: MakeSubscriber
) -> None:
    publisher = make_publisher("closing", heartbeat_s=None)
    subscriber = make_subscriber(publisher)
    wait_connected(publisher, subscriber)
    keys = random_keys(200)
    for key in keys:
        publisher.publish([BlockRemoved((key,), "disk")])
    start = time.monotonic()
    publisher.close()
    assert time.monotonic() - start < 1.0
    assert "cachetier-kvevents-closing" not in {t.name for t in threading.enumerate()}
    assert publisher.stats().num_events >= len(keys)
    assert not publisher.publish([BlockRemoved((keys[0],), "disk")])
    publisher.close()  # twice is harmless


def test_an_endpoint_in_use_is_refused_with_what_to_change(make_publisher: MakePublisher) -> None:
    first = make_publisher()
    with pytest.raises(ValueError, match="port 0"):
        make_publisher("other", endpoint=first.endpoint)
    threads = {t.name for t in threading.enumerate()}
    assert "cachetier-kvevents-other" not in threads, "a refused publisher starts no thread"


def test_publish_refuses_what_is_not_an_event(make_publisher: MakePublisher) -> None:
    publisher = make_publisher()
    with pytest.raises(TypeError, match="not a KV event"):
        publisher.publish([("stored", "disk", [])])  # type: ignore[list-item]
    assert publisher.publish([])


def test_events_from_many_threads_all_go_out_without_a_timer_to_push_them(
    make_publisher: MakePublisher, make_subscriber: MakeSubscriber
) -> None:
    publisher = make_publisher(heartbeat_s=None)  # only the wake-ups move the thread
    subscriber = make_subscriber(publisher)
    wait_connected(publisher, subscriber)
    before = publisher.stats().num_events
    keys = random_keys(4 * 300)

    def publish(part: list[bytes]) -> None:
        for key in part:
            assert publisher.publish([BlockRemoved((key,), "disk")])

    threads = [threading.Thread(target=publish, args=(keys[i::4],)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    wait_sent(publisher, before + len(keys))
    got = collect(subscriber, lambda got: sum(len(d.batch.events) for d in got) == len(keys))
    assert {e.block_hashes[0] for d in got for e in d.batch.events} == set(keys)
    assert all(d.num_missed == 0 for d in got) and publisher.stats().num_dropped_events == 0


def test_one_answer_fits_a_clients_queue_and_clients_past_the_cap_get_the_end_marker(
    make_publisher: MakePublisher, context: zmq.Context
) -> None:
    publisher = make_publisher(heartbeat_s=None, replay_hwm=4, max_replay_clients=1)
    for i, key in enumerate(random_keys(5)):
        assert publisher.publish([BlockRemoved((key,), "disk")])
        wait_sent(publisher, i + 1)
    assert publisher.replay_endpoint is not None
    first = _replay(context, publisher.replay_endpoint, [b"", encode_seq(0)])
    assert [a[2] for a in first] == [encode_seq(0), encode_seq(1), END_SEQ]
    other = _replay(context, publisher.replay_endpoint, [b"", encode_seq(0)])
    assert other == [[b"", b"", END_SEQ, b""]], "a second client, past max_replay_clients"
    assert publisher.stats().num_replay_clients_refused == 1


def test_hashes_only_batches_carry_no_token_ids(
    make_publisher: MakePublisher, make_subscriber: MakeSubscriber
) -> None:
    publisher = make_publisher(publish_token_ids=False)
    keys = random_keys(2)
    assert publisher.publish([BlockStored(tuple(keys), None, tuple(range(32)), 16, "GPU")])
    subscriber = make_subscriber(publisher)
    got = with_events(collect(subscriber, lambda got: len(with_events(got)) == 1))
    assert got[0].batch.events == (BlockStored(tuple(keys), None, (), 16, "GPU"),)
