"""Server-sent events as the router passes them on: whole events only, and the end of a stream.

A replica's stream is cut at event boundaries (a blank line) so that the client never gets
half an event: when the replica breaks mid-event, the half is dropped and an error event takes
its place. A stream is complete once its last event is ``data: [DONE]``, the OpenAI end
marker; one that ends any other way was cut. No I/O here: ``proxy`` feeds the bytes in.
"""

from __future__ import annotations

import json
import re

EVENT_STREAM = "text/event-stream"
BOUNDARIES = (b"\n\n", b"\r\n\r\n")
_BOUNDARY = re.compile(rb"\r?\n\r?\n")
MAX_HELD_BYTES = 8 << 20
"""An event not finished after this many bytes is passed on as it is: holding more would let
one stream take the router's memory."""
DONE = b"data: [DONE]\n\n"


def is_event_stream(content_type: str | None) -> bool:
    return (content_type or "").split(";")[0].strip().lower() == EVENT_STREAM


def _last_boundary(data: bytes) -> int:
    """The end of the last event boundary in ``data``, 0 if it has none."""
    return max((at + len(b) for b in BOUNDARIES if (at := data.rfind(b)) != -1), default=0)


def _is_done(event: bytes) -> bool:
    fields = [line.strip() for line in event.splitlines() if line.strip()]
    return (
        bool(fields)
        and all(f.startswith(b"data:") for f in fields)
        and (b"".join(f[5:].strip() for f in fields) == b"[DONE]")
    )


class EventFrames:
    """What of a stream can be passed on: its whole events, in order.

    ``take`` returns the bytes to send now; ``done`` says whether the last event sent was
    ``[DONE]``; ``open`` says whether the bytes sent end inside an event (only past
    ``MAX_HELD_BYTES``).
    """

    def __init__(self) -> None:
        self._held = b""
        self.done = False
        self.open = False

    @property
    def num_held_bytes(self) -> int:
        return len(self._held)

    @property
    def complete(self) -> bool:
        """The stream ended here would be whole: its last event ``[DONE]``, nothing after."""
        return self.done and not self._held.strip()

    def take(self, chunk: bytes) -> bytes:
        """Add ``chunk``; returns the whole events it completes (maybe ``b""``)."""
        data = self._held + chunk
        end = _last_boundary(data)
        if end == 0 and len(data) > MAX_HELD_BYTES:
            self._held, self.open, self.done = b"", True, False
            return data
        if end == 0:
            self._held = data
            return b""
        ready, self._held = data[:end], data[end:]
        pieces = _BOUNDARY.split(ready)
        if self.open:
            pieces = pieces[1:]  # the end of the event passed on open: not an event of its own
        events = [e for e in pieces if e.strip()]
        if events or self.open:
            self.done = bool(events) and _is_done(events[-1])
        self.open = False
        return ready


def error_event(message: str, kind: str = "server_error", code: str | None = None) -> bytes:
    """An OpenAI error as a stream's event: what OpenAI-compatible servers send when an answer
    fails after its first bytes (then ``DONE``)."""
    body = {"error": {"message": message, "type": kind, "param": None, "code": code}}
    return b"data: " + json.dumps(body).encode() + b"\n\n"
