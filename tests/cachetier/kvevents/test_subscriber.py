"""The subscriber on real sockets: a late joiner replays from the start, what the buffer no
longer holds is counted missed, a process that is gone is fenced by its epoch, and a replay
nobody answers times out."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import zmq

from cachetier.kvevents import BlockRemoved, KVEventPublisher, KVEventSubscriber
from tests.cachetier.kvevents.streams import (
    WAIT_S,
    collect,
    random_keys,
    wait_sent,
    with_events,
)

MakePublisher = Callable[..., KVEventPublisher]
MakeSubscriber = Callable[..., KVEventSubscriber]


def _publish_each(publisher: KVEventPublisher, count: int) -> list[BlockRemoved]:
    """``count`` one-event batches, each sent before the next is queued."""
    events = [BlockRemoved((key,), "disk") for key in random_keys(count)]
    for i, event in enumerate(events):
        publisher.publish([event])
        wait_sent(publisher, i + 1)
    return events


def test_a_late_subscriber_replays_from_the_first_batch_in_order(
    make_publisher: MakePublisher, make_subscriber: MakeSubscriber
) -> None:
    publisher = make_publisher()
    events = _publish_each(publisher, 5)
    subscriber = make_subscriber(publisher)
    got = collect(subscriber, lambda got: len(with_events(got)) == 5)
    assert [d.batch.events[0] for d in with_events(got)] == events
    assert [d.seq for d in got] == list(range(len(got))), "every batch, in order, once"
    assert all(d.num_missed == 0 for d in got)
    assert all((d.replica, d.epoch) == ("r0", 1) for d in got)
    stats = subscriber.stats()
    assert stats.num_replayed >= 5 and stats.num_missed == 0 and stats.num_duplicates == 0


def test_what_the_replay_buffer_no_longer_holds_is_counted_missed(
    make_publisher: MakePublisher, make_subscriber: MakeSubscriber
) -> None:
    publisher = make_publisher(buffer_batches=3)
    _publish_each(publisher, 6)
    subscriber = make_subscriber(publisher)
    got = collect(subscriber, lambda got: len(got) >= 4)
    first = got[0]
    assert first.seq >= 3 and first.num_missed == first.seq
    assert all(d.num_missed == 0 for d in got[1:])
    assert subscriber.stats().num_missed == first.seq


def test_without_a_replay_endpoint_a_gap_is_missed_at_once(
    make_publisher: MakePublisher, make_subscriber: MakeSubscriber
) -> None:
    publisher = make_publisher(replay_endpoint=None)
    assert publisher.replay_endpoint is None
    _publish_each(publisher, 3)
    subscriber = make_subscriber(publisher)
    got = collect(subscriber, lambda got: bool(got))
    assert got[0].seq >= 3 and got[0].num_missed == got[0].seq
    assert subscriber.stats().num_replayed == 0


def test_a_replay_nobody_answers_times_out_and_the_stream_goes_on(
    make_publisher: MakePublisher, make_subscriber: MakeSubscriber
) -> None:
    ctx = zmq.Context()
    silent = ctx.socket(zmq.ROUTER)  # takes requests, answers none
    silent.setsockopt(zmq.LINGER, 0)
    silent.bind("tcp://127.0.0.1:0")
    try:
        publisher = make_publisher()
        _publish_each(publisher, 2)
        subscriber = make_subscriber(
            publisher,
            replay_endpoint=silent.getsockopt_string(zmq.LAST_ENDPOINT),
            replay_timeout_s=0.2,
        )
        got = collect(subscriber, lambda got: len(got) >= 3)
    finally:
        silent.close()
        ctx.term()
    assert got[0].num_missed == got[0].seq >= 2
    assert [d.seq for d in got] == list(range(got[0].seq, got[0].seq + len(got)))
    assert subscriber.stats().num_replay_timeouts == 1


def test_epochs_fence_a_process_that_is_gone_and_a_restart_starts_a_new_stream(
    make_publisher: MakePublisher, make_subscriber: MakeSubscriber, tmp_path: Path
) -> None:
    endpoint = f"ipc://{tmp_path}/events"
    first = make_publisher("pod", epoch=5, endpoint=endpoint, replay_endpoint=None)
    subscriber = make_subscriber(first)
    collect(subscriber, lambda got: bool(got))
    first.close()
    # An older process at the same endpoint (a clock set back, a zombie): fenced.
    older = make_publisher("pod", epoch=4, endpoint=endpoint, replay_endpoint=None)
    assert collect(subscriber, lambda got: subscriber.stats().num_stale >= 2) == []
    older.close()
    newer = make_publisher("pod", epoch=6, endpoint=endpoint, replay_endpoint=None)
    got = collect(subscriber, lambda got: bool(got), timeout_s=WAIT_S)
    assert got[0].epoch == 6 and got[0].replica == "pod"
    assert got[0].num_missed == got[0].seq, "counted from the new epoch's sequence number 0"
    newer.close()


def test_a_replay_longer_than_one_answer_is_asked_for_in_turns(
    make_publisher: MakePublisher, make_subscriber: MakeSubscriber
) -> None:
    publisher = make_publisher(replay_hwm=4)  # two batches an answer
    events = _publish_each(publisher, 9)
    subscriber = make_subscriber(publisher)
    got = collect(subscriber, lambda got: len(with_events(got)) == 9)
    assert [d.batch.events[0] for d in with_events(got)] == events
    assert all(d.num_missed == 0 for d in got)
    assert publisher.stats().num_replay_requests >= 5
