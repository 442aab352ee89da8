"""The ZMQ frames of KV events, as vLLM's ``ZmqEventPublisher`` sends and answers them.

- Live, on a PUB socket: ``[topic, seq, payload]``; ``seq`` is 8 bytes big-endian, counting
  from 0 in each process.
- Replay, on a ROUTER socket: a client (REQ, or DEALER sending an empty delimiter first)
  asks with ``[seq]``, the first sequence number it lacks; the answer is one
  ``[topic, seq, payload]`` message per buffered batch from there on, then the end marker
  ``[b"", END_SEQ, b""]`` (``END_SEQ`` is -1 as 8 signed bytes).

Our topic is ``kv@<replica>@<model>``, as llm-d's KV-cache indexer splits it (pod id, then the
model it files the blocks under), so neither name may hold an ``@``. The process's epoch is in
the payload (``EventBatch.epoch``, an element after ``data_parallel_rank`` that vLLM's and
llm-d's decoders skip); a SUB socket filters on ``kv@<replica>@`` to follow one replica across
restarts.

Sans-IO: frames in, frames out.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

SEQ_BYTES = 8
END_SEQ = (-1).to_bytes(SEQ_BYTES, "big", signed=True)
MAX_SEQ = (1 << 64) - 2
"""The largest sequence number; ``2**64 - 1`` is the end marker's bit pattern."""
TOPIC_PREFIX = "kv@"
# A replica is a pod or host name, or kvindex's SHARED ("*"): no "@", which splits the topic.
_REPLICA_RE = re.compile(r"[A-Za-z0-9._:*/-]{1,128}")


@dataclass(frozen=True, slots=True)
class Topic:
    """Whose events a message carries: ``replica``'s blocks of ``model``."""

    replica: str
    model: str = "*"

    def __post_init__(self) -> None:
        check_replica(self.replica)
        check_replica(self.model, "model")

    def encode(self) -> bytes:
        """``kv@<replica>@<model>``, as the topic frame."""
        return f"{TOPIC_PREFIX}{self.replica}@{self.model}".encode("ascii")


def check_replica(replica: str, what: str = "replica") -> str:
    """Validate a replica (or model) name for a topic.

    Args:
        replica: 1-128 characters of ``[A-Za-z0-9._:*/-]``.
        what: the name's role, for the message.

    Returns:
        ``replica`` unchanged.

    Raises:
        ValueError: it does not qualify; the message says what to change.
    """
    if not isinstance(replica, str) or not _REPLICA_RE.fullmatch(replica):
        raise ValueError(
            f"{what} {str(replica)[:100]!r} must be 1-128 characters of [A-Za-z0-9._:*/-]"
        )
    return replica


def parse_topic(frame: bytes) -> Topic | None:
    """The ``Topic`` of a topic frame, ``None`` when it is not ours (vLLM's default is empty).

    Args:
        frame: the first frame of a live or replayed message.
    """
    try:
        parts = frame.decode("ascii").split("@")
    except UnicodeDecodeError:
        return None
    # Exactly three parts, as llm-d's parseTopic takes them.
    if len(parts) != 3 or f"{parts[0]}@" != TOPIC_PREFIX:
        return None
    try:
        return Topic(parts[1], parts[2])
    except ValueError:
        return None


def encode_seq(seq: int) -> bytes:
    """``seq`` as its 8-byte big-endian frame.

    Raises:
        ValueError: ``seq`` is outside ``[0, MAX_SEQ]``.
    """
    if not 0 <= seq <= MAX_SEQ:
        raise ValueError(f"sequence number must be in [0, {MAX_SEQ}], got {seq}")
    return seq.to_bytes(SEQ_BYTES, "big")


def decode_seq(frame: bytes) -> int | None:
    """The sequence number of a frame; ``None`` for the end marker or a frame of the wrong
    length."""
    if len(frame) != SEQ_BYTES or frame == END_SEQ:
        return None
    return int.from_bytes(frame, "big")


@dataclass(frozen=True, slots=True)
class ReplayRequest:
    """A replay request as a ROUTER socket received it.

    ``envelope`` is what every answer starts with (the client's identity, and the empty
    delimiter when the client sent one); ``start`` is the first sequence number wanted, or
    ``None`` when the request is malformed (it is answered with the end marker alone).
    """

    envelope: tuple[bytes, ...]
    start: int | None


def parse_replay_request(frames: Sequence[bytes]) -> ReplayRequest | None:
    """Split a ROUTER message into its envelope and its starting sequence number.

    Args:
        frames: ``[identity, b"", seq]`` from REQ or a DEALER that sends the delimiter,
            ``[identity, seq]`` from a bare DEALER.

    Returns:
        The request, ``None`` when there is not even an identity to answer.
    """
    if not frames:
        return None
    delimited = len(frames) >= 2 and frames[1] == b""
    envelope = tuple(frames[:2]) if delimited else tuple(frames[:1])
    body = frames[len(envelope) :]
    # Unsigned, as vLLM reads it: a start past every buffered batch gets the end marker alone.
    start = int.from_bytes(body[0], "big") if len(body) == 1 and len(body[0]) == SEQ_BYTES else None
    return ReplayRequest(envelope, start)


def encode_replay_request(start: int) -> list[bytes]:
    """What a DEALER client sends to ask for batches from ``start`` on (REQ's framing)."""
    return [b"", encode_seq(start)]


def replay_answer(envelope: Sequence[bytes], topic: bytes, seq: int, payload: bytes) -> list[bytes]:
    """One replayed batch, addressed to the client of ``envelope``."""
    return [*envelope, topic, encode_seq(seq), payload]


def replay_end(envelope: Sequence[bytes]) -> list[bytes]:
    """The end marker that closes a replay answer."""
    return [*envelope, b"", END_SEQ, b""]
