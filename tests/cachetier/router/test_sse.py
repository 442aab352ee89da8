"""The router's SSE framing: whole events pass on, however the bytes are split; a stream is
complete only when its last event is [DONE]; an event past the hold limit passes on as it is."""

from __future__ import annotations

import json

from cachetier.router.sse import MAX_HELD_BYTES, EventFrames, error_event, is_event_stream

STREAM = b'data: {"a": 1}\n\ndata: {"b": 2}\r\n\r\ndata: [DONE]\n\n'


def test_whole_events_pass_on_at_any_split_and_done_is_seen_last() -> None:
    for size in (1, 2, 5, 13, len(STREAM)):
        frames, out = EventFrames(), b""
        for at in range(0, len(STREAM), size):
            ready = frames.take(STREAM[at : at + size])
            assert not ready or ready.endswith((b"\n\n", b"\r\n\r\n")), ready
            assert not frames.done or out + ready == STREAM
            out += ready
        assert out == STREAM and frames.complete and frames.num_held_bytes == 0
    frames = EventFrames()
    frames.take(STREAM + b"\n")  # a blank line after [DONE] ends nothing
    assert frames.complete


def test_a_stream_cut_anywhere_before_its_end_is_not_done() -> None:
    for end in range(len(STREAM) - 1):
        frames = EventFrames()
        frames.take(STREAM[:end])
        assert not frames.complete, end
    frames = EventFrames()
    frames.take(b"data: [DONE]\n\ndata: {}\n\n")  # [DONE], then more: not the end
    assert not frames.done


def test_an_event_past_the_hold_limit_passes_on_open() -> None:
    frames = EventFrames()
    big = b"data: " + b"x" * MAX_HELD_BYTES
    assert frames.take(big) == big and frames.open and frames.num_held_bytes == 0
    assert frames.take(b"\n\ndata: [DONE]\n\n") == b"\n\ndata: [DONE]\n\n"
    assert frames.done and not frames.open


def test_the_error_event_is_an_openai_error_body() -> None:
    event = error_event("replica r0 failed", code="replica_failed")
    assert event.startswith(b"data: ") and event.endswith(b"\n\n")
    body = json.loads(event[6:])
    assert body == {
        "error": {
            "message": "replica r0 failed",
            "type": "server_error",
            "param": None,
            "code": "replica_failed",
        }
    }
    assert is_event_stream("text/event-stream; charset=utf-8")
    assert not is_event_stream("application/json") and not is_event_stream(None)
