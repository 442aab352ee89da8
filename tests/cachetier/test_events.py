"""The lookup event log: round trip, bad lines, size cap."""

from __future__ import annotations

import threading

import pytest

from cachetier.report.events import EventLog, LookupEvent, read_events


def _event(i: int, tenant: str = "a") -> LookupEvent:
    return LookupEvent(
        time_s=1000.0 + i,
        tenant=tenant,
        num_tokens=100,
        hit_tokens={"pool": 32, "disk": 16},
        block_size=16,
        num_alignment_lost_tokens=4,
        restore_s=0.25,
    )


def test_round_trip_in_order(tmp_path):
    path = tmp_path / "sub" / "events.jsonl"
    with EventLog(path) as events:
        for i in range(5):
            events.record(_event(i))
    back = list(read_events(path, strict=True))
    assert back == [_event(i) for i in range(5)]
    assert back[0].num_hit_tokens == 48


def test_concurrent_writers_never_interleave_lines(tmp_path):
    path = tmp_path / "events.jsonl"
    events = EventLog(path)
    threads = [
        threading.Thread(target=lambda t=t: [events.record(_event(i, f"t{t}")) for i in range(200)])
        for t in range(4)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    events.close()
    back = list(read_events(path, strict=True))
    assert len(back) == 800 and events.num_written == 800
    assert {e.tenant for e in back} == {"t0", "t1", "t2", "t3"}


def test_partial_last_line_is_skipped_or_named(tmp_path):
    path = tmp_path / "events.jsonl"
    with EventLog(path) as events:
        events.record(_event(0))
    with open(path, "a") as f:
        f.write('{"time_s": 3, "tenant"')  # a crash mid-line
    assert list(read_events(path)) == [_event(0)]
    with pytest.raises(ValueError, match=r"events.jsonl:2"):
        list(read_events(path, strict=True))


def test_size_cap_drops_and_counts(tmp_path):
    path = tmp_path / "events.jsonl"
    line = len(_event(0).to_json()) + 1
    with EventLog(path, max_bytes=3 * line) as events:
        for i in range(5):
            events.record(_event(i))
    assert events.num_written == 3 and events.num_dropped == 2
    assert len(list(read_events(path))) == 3


@pytest.mark.parametrize(
    "kwargs",
    [
        {"num_tokens": -1},
        {"hit_tokens": {"gpu": 1}},
        {"hit_tokens": {"cpu": 200}},
        {"hit_tokens": {"cpu": -1}},
        {"block_size": 0},
        {"recomputed_tokens": -1},
        {"recomputed_tokens": 101},
        {"est_saved_s": float("nan")},
        {"est_saved_s": -1.0},
    ],
)
def test_invalid_events_are_refused(kwargs):
    base = {"time_s": 0.0, "tenant": "", "num_tokens": 100}
    with pytest.raises(ValueError):
        LookupEvent(**{**base, **kwargs})


def test_a_torn_tail_is_forgiven_only_where_asked_and_only_at_the_end(tmp_path):
    path = tmp_path / "events.jsonl"
    with EventLog(path) as events:
        events.record(_event(0))
    with open(path, "a") as f:
        f.write('{"time_s": 3, "tenant"')  # a crash mid-line: no newline
    assert list(read_events(path, strict=True, allow_torn_tail=True)) == [_event(0)]
    # The same bad text as a whole line is not a torn write: strict still refuses it.
    with open(path, "a") as f:
        f.write("\n")
        f.write(_event(1).to_json() + "\n")
    with pytest.raises(ValueError, match=r"events.jsonl:2"):
        list(read_events(path, strict=True, allow_torn_tail=True))


def test_cost_model_fields_round_trip_and_stay_out_of_old_lines():
    chosen = LookupEvent(1.0, "t", 900, {"remote": 160}, recomputed_tokens=640, est_saved_s=1.25)
    assert LookupEvent.from_json(chosen.to_json()) == chosen
    plain = LookupEvent(1.0, "t", 900, {"disk": 800})
    assert "recomputed_tokens" not in plain.to_json() and "est_saved_s" not in plain.to_json()
    assert LookupEvent.from_json(plain.to_json()) == plain


def test_guard_fields_round_trip_and_stay_out_of_old_lines():
    guarded = LookupEvent(1.0, "t", 900, {"cpu": 160}, verified_tokens=320)
    lost = LookupEvent(1.0, "t", 900, {"pool": 16}, miss_tokens={"quarantined": 640})
    for event in (guarded, lost):
        assert LookupEvent.from_json(event.to_json()) == event
    plain = LookupEvent(1.0, "t", 900, {"disk": 800}).to_json()
    assert "verified_tokens" not in plain and "miss_tokens" not in plain


@pytest.mark.parametrize(
    "fields",
    [
        {"miss_tokens": {"lost": 1}},
        {"miss_tokens": {"quarantined": -1}},
        {"miss_tokens": {"quarantined": 901}},
        {"verified_tokens": 901},
    ],
)
def test_bad_guard_fields_are_refused(fields):
    with pytest.raises(ValueError):
        LookupEvent(1.0, "t", 900, {}, **fields)
