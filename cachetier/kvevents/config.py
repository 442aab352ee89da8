"""Settings of the KV-event publisher and subscriber (checked here; no sockets, no I/O)."""

from __future__ import annotations

from dataclasses import dataclass

from cachetier.kvevents.framing import check_replica
from cachetier.util.checks import positive_int

_SCHEMES = ("tcp://", "ipc://")


def check_endpoint(name: str, endpoint: str) -> str:
    """Validate a ZMQ endpoint (``tcp://host:port`` or ``ipc://path``).

    Args:
        name: the setting's name, for the message.
        endpoint: its value.

    Returns:
        ``endpoint`` unchanged.

    Raises:
        ValueError: it is not a tcp or ipc endpoint.
    """
    if not isinstance(endpoint, str) or not endpoint.startswith(_SCHEMES):
        raise ValueError(f"{name} must be a tcp:// or ipc:// endpoint, got {endpoint!r}")
    return endpoint


def _positive_seconds(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")


@dataclass(frozen=True, slots=True)
class PublisherConfig:
    """How a process publishes its KV events.

    Args:
        replica: the name consumers know this process's holdings by (a pod or host name;
            ``cachetier.kvindex.SHARED``, ``"*"``, for a sidecar's tiers that every replica
            reads). One publisher per replica and process: its sequence numbers are one stream.
        endpoint: where the PUB socket binds; port 0 takes a free port, read back from
            ``KVEventPublisher.endpoint``.
        replay_endpoint: where the ROUTER socket that answers replay requests binds;
            ``None`` for no replay.
        buffer_batches: most batches kept for replay.
        buffer_bytes: most payload bytes kept for replay (a snapshot of a large tier is many
            batches of many keys).
        max_queue_batches: most ``publish`` calls waiting for the publisher's thread; past
            it a call's events are dropped and counted, never waited for.
        max_batch_blocks: most block hashes coalesced into one batch (one call's events are
            never split, and a snapshot comes in events of this many hashes).
        heartbeat_s: an empty batch goes out after this long without one, so a subscriber
            sees the stream is alive and notices a lost last batch; ``None`` for none.
        send_hwm: messages the PUB socket queues for a slow subscriber before that
            subscriber misses some (it sees the gap and replays).
        data_parallel_rank: written into every batch, as vLLM's data-parallel ranks do.
    """

    replica: str
    endpoint: str = "tcp://127.0.0.1:0"
    replay_endpoint: str | None = "tcp://127.0.0.1:0"
    buffer_batches: int = 10_000
    buffer_bytes: int = 64 << 20
    max_queue_batches: int = 10_000
    max_batch_blocks: int = 4096
    heartbeat_s: float | None = 5.0
    send_hwm: int = 100_000
    data_parallel_rank: int | None = None

    def __post_init__(self) -> None:
        check_replica(self.replica)
        check_endpoint("endpoint", self.endpoint)
        if self.replay_endpoint is not None:
            check_endpoint("replay_endpoint", self.replay_endpoint)
        for name in (
            "buffer_batches",
            "buffer_bytes",
            "max_queue_batches",
            "max_batch_blocks",
            "send_hwm",
        ):
            positive_int(name, getattr(self, name))
        if self.heartbeat_s is not None:
            _positive_seconds("heartbeat_s", self.heartbeat_s)
        rank = self.data_parallel_rank
        if rank is not None and (isinstance(rank, bool) or not isinstance(rank, int) or rank < 0):
            raise ValueError(f"data_parallel_rank must be None or an int >= 0, got {rank!r}")


@dataclass(frozen=True, slots=True)
class SubscriberConfig:
    """How a consumer follows one publisher.

    Args:
        endpoint: the publisher's PUB endpoint to connect to.
        replay_endpoint: its ROUTER endpoint; ``None`` when it keeps none (gaps are then
            counted as missed at once).
        topic: the topic prefix to receive (``"kv@"`` for every cachetier publisher, ``""``
            for vLLM's, whose topic is empty by default).
        replica: the replica name of messages whose topic is not ours (vLLM's publisher);
            ``None`` drops them.
        replay_timeout_s: how long a replay may take before the batches it did not bring
            are counted as missed.
        max_message_bytes: the largest frame accepted; a publisher sending more is
            disconnected by ZMQ before anything is allocated for it.
    """

    endpoint: str
    replay_endpoint: str | None = None
    topic: str = "kv@"
    replica: str | None = None
    replay_timeout_s: float = 1.0
    max_message_bytes: int = 64 << 20

    def __post_init__(self) -> None:
        check_endpoint("endpoint", self.endpoint)
        if self.replay_endpoint is not None:
            check_endpoint("replay_endpoint", self.replay_endpoint)
        if not isinstance(self.topic, str):
            raise TypeError(f"topic must be a str, got {type(self.topic).__name__}")
        if self.replica is not None:
            check_replica(self.replica)
        _positive_seconds("replay_timeout_s", self.replay_timeout_s)
        positive_int("max_message_bytes", self.max_message_bytes)
