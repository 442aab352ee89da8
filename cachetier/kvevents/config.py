"""Settings of the KV-event publisher and subscriber (checked here; no sockets, no I/O)."""

from __future__ import annotations

from dataclasses import dataclass

from cachetier.kvevents.framing import check_replica
from cachetier.util.checks import positive_int

_SCHEMES = ("tcp://", "ipc://")
_LOOPBACK_HOSTS = ("localhost", "[::1]", "::1")
_ENCODINGS = ("map", "array")


def is_loopback(endpoint: str) -> bool:
    """Whether ``endpoint`` is reachable from this host only (a loopback address, or ipc)."""
    if endpoint.startswith("ipc://"):
        return True
    host = endpoint.removeprefix("tcp://").rpartition(":")[0]
    return host in _LOOPBACK_HOSTS or host.startswith("127.")


def _check_curve_pair(first: tuple[str, object], second: tuple[str, object]) -> bool:
    """Both key settings or neither; returns whether both are set."""
    for name, value in (first, second):
        if value is not None and (not isinstance(value, str) or not value):
            raise ValueError(f"{name} must be a file or folder path, got {value!r}")
    if (first[1] is None) != (second[1] is None):
        raise ValueError(f"{first[0]} and {second[0]} go together: set both, or neither")
    return first[1] is not None


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
        model: the model name in the topic (``kv@<replica>@<model>``), what llm-d's indexer
            files the blocks under; ``"*"`` where the blocks are of many models (a sidecar).
        encoding: ``"map"`` (events as vLLM's decoder reads them) or ``"array"`` (as llm-d's
            vLLM adapter reads them); our subscriber reads either.
        publish_token_ids: ``False`` sends block hashes only (``token_ids`` empty): a reader
            learns which blocks are held, never the prompt's tokens.
        curve_secret_key_file: this publisher's CURVE certificate with its secret key (as
            ``zmq.auth.create_certificates`` writes it); with ``curve_public_keys_dir``, both
            sockets take only clients whose public key is there.
        curve_public_keys_dir: the folder of the public certificates (``*.key``) allowed to
            read.
        allow_unauthenticated_remote: bind a non-loopback address without CURVE (a network
            policy must then keep everyone else off); without it such a bind is refused.
        replay_hwm: messages queued for one replay client at most; an answer is half as
            many batches and the end marker (the client asks again from there), and a client
            that has not read its answers gets no more once its queue is full.
        max_replay_clients: distinct replay clients answered within 10 s; the others get
            the end marker alone.
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
    model: str = "*"
    encoding: str = "map"
    publish_token_ids: bool = True
    curve_secret_key_file: str | None = None
    curve_public_keys_dir: str | None = None
    allow_unauthenticated_remote: bool = False
    replay_hwm: int = 16
    max_replay_clients: int = 16

    def __post_init__(self) -> None:
        check_replica(self.replica)
        check_replica(self.model, "model")
        if self.encoding not in _ENCODINGS:
            raise ValueError(f"encoding must be one of {_ENCODINGS}, got {self.encoding!r}")
        check_endpoint("endpoint", self.endpoint)
        if self.replay_endpoint is not None:
            check_endpoint("replay_endpoint", self.replay_endpoint)
        self._check_exposure()
        for name in (
            "buffer_batches",
            "buffer_bytes",
            "max_queue_batches",
            "max_batch_blocks",
            "send_hwm",
            "max_replay_clients",
        ):
            positive_int(name, getattr(self, name))
        if self.heartbeat_s is not None:
            _positive_seconds("heartbeat_s", self.heartbeat_s)
        rank = self.data_parallel_rank
        if rank is not None and (isinstance(rank, bool) or not isinstance(rank, int) or rank < 0):
            raise ValueError(f"data_parallel_rank must be None or an int >= 0, got {rank!r}")
        if positive_int("replay_hwm", self.replay_hwm) < 2:
            raise ValueError(
                f"replay_hwm must be >= 2 (a batch and the end marker), got {self.replay_hwm}"
            )

    @property
    def curve(self) -> bool:
        """Whether the sockets take CURVE-authenticated clients only."""
        return self.curve_secret_key_file is not None

    def _check_exposure(self) -> None:
        curve = _check_curve_pair(
            ("curve_secret_key_file", self.curve_secret_key_file),
            ("curve_public_keys_dir", self.curve_public_keys_dir),
        )
        if curve or self.allow_unauthenticated_remote:
            return
        for endpoint in (self.endpoint, self.replay_endpoint):
            if endpoint is not None and not is_loopback(endpoint):
                raise ValueError(
                    f"KV events carry prompts' token ids: binding {endpoint!r} beyond loopback "
                    "needs curve_secret_key_file and curve_public_keys_dir (or, where a network "
                    "policy keeps everyone else off, allow_unauthenticated_remote=True)"
                )


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
        curve_secret_key_file: this reader's CURVE certificate with its secret key, for a
            publisher that takes CURVE clients only; with ``curve_server_key_file``.
        curve_server_key_file: the publisher's public certificate.
    """

    endpoint: str
    replay_endpoint: str | None = None
    topic: str = "kv@"
    replica: str | None = None
    replay_timeout_s: float = 1.0
    max_message_bytes: int = 64 << 20
    curve_secret_key_file: str | None = None
    curve_server_key_file: str | None = None

    def __post_init__(self) -> None:
        _check_curve_pair(
            ("curve_secret_key_file", self.curve_secret_key_file),
            ("curve_server_key_file", self.curve_server_key_file),
        )
        check_endpoint("endpoint", self.endpoint)
        if self.replay_endpoint is not None:
            check_endpoint("replay_endpoint", self.replay_endpoint)
        if not isinstance(self.topic, str):
            raise TypeError(f"topic must be a str, got {type(self.topic).__name__}")
        if self.replica is not None:
            check_replica(self.replica)
        _positive_seconds("replay_timeout_s", self.replay_timeout_s)
        positive_int("max_message_bytes", self.max_message_bytes)
