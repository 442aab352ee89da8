"""The router's settings (``cachetier route``)."""

from __future__ import annotations

from dataclasses import dataclass, field

from cachetier.fleet import POLICIES as FLEET_POLICIES
from cachetier.kvevents.config import check_endpoint
from cachetier.util.checks import positive_int
from cachetier.util.redact import redacted_repr

POLICIES = tuple(FLEET_POLICIES)


@dataclass(frozen=True, slots=True)
class RouterConfig:
    """Where the router listens, which replicas it fronts and how it chooses.

    Args:
        replicas: the replicas' base URLs (``http://host:port``), our engine servers or
            ``vllm serve`` with the connector.
        model: the model folder whose tokenizer and chat template the replicas use (``None``:
            text prompts are routed on load alone).
        policy: one of ``POLICIES`` (``cachetier.fleet``).
        max_imbalance: a replica whose load passes this multiple of the mean is passed over
            unless every replica is past it.
        host: address to listen on.
        port: port to listen on (0: any free port, reported at start).
        api_key: the key clients must send (``Authorization: Bearer``); ``None`` for none.
        replica_api_key: the key sent to every replica without one of its own (a fallback:
            one key for all lets any replica, or anything posing as one, call the others).
        replica_api_keys: each replica's own key, by its name (``r0`` for the first URL);
            a replica is sent its own key and no other.
        client_keys: (key, tenant) pairs of clients beside ``api_key`` (tenant ``""``):
            ``/v1/fleet/lookup`` answers each for its own tenant's replicas only.
        poll_interval_s: how often each replica's health and state are asked.
        reconcile_interval_s: how often the prefix index is checked against each replica's
            digests and resynced where they differ: the longest a lost KV event leaves it
            wrong.
        shared_events: a sidecar's KV-event endpoint (its ``kv_events``): blocks every
            replica can load; ``None`` for none.
        shared_events_replay: that sidecar's replay endpoint (its ``kv_events_replay``).
        replica_events: ``NAME=ENDPOINT[,REPLAY]`` for replicas that do not say where their
            events are (``vllm serve`` with its ``--kv-events-config``): replica ``NAME``
            (``r0`` for the first ``replicas`` URL) publishes there in vLLM's framing.
        events_curve_key: the router's CURVE certificate file (with its secret key), for
            publishers that take CURVE clients only; with ``events_curve_server_key``.
        events_curve_server_key: the publishers' public CURVE certificate file.
        max_body_bytes: the largest request body taken (413 past it); no larger than the
            replicas' own limit (the engine server's ``max_request_bytes``, 1 MiB), so that
            the router never does work for a body a replica refuses.
        num_prepare_threads: threads that parse, tokenize and weigh requests (off the event
            loop).
        max_queued_prepares: requests whose preparation may wait or run at once; more get 503.
        prepare_timeout_s: the longest a request's preparation may take, queueing included
            (503 past it).
        request_timeout_s: the longest a replica may take to send its answer's head.
    """

    replicas: tuple[str, ...]
    model: str | None = None
    policy: str = "tier_aware"
    max_imbalance: float = 1.3
    host: str = "127.0.0.1"
    port: int = 8480
    api_key: str | None = field(default=None, repr=False)
    replica_api_key: str | None = field(default=None, repr=False)
    replica_api_keys: tuple[tuple[str, str], ...] = field(default=(), repr=False)
    client_keys: tuple[tuple[str, str], ...] = field(default=(), repr=False)
    poll_interval_s: float = 1.0
    reconcile_interval_s: float = 5.0
    shared_events: str | None = None
    shared_events_replay: str | None = None
    replica_events: tuple[str, ...] = ()
    events_curve_key: str | None = None
    events_curve_server_key: str | None = None
    max_body_bytes: int = 1 << 20
    request_timeout_s: float = 600.0
    num_prepare_threads: int = 2
    max_queued_prepares: int = 8
    prepare_timeout_s: float = 10.0

    def __repr__(self) -> str:
        return redacted_repr(self)

    def __post_init__(self) -> None:
        if not self.replicas:
            raise ValueError("a router needs at least one replica URL")
        for url in self.replicas:
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"replica URL {url!r} must start with http:// or https://")
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {self.policy!r}")
        if not self.max_imbalance >= 1.0:
            raise ValueError(f"max_imbalance must be >= 1, got {self.max_imbalance}")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        positive_int("max_body_bytes", self.max_body_bytes)
        positive_int("num_prepare_threads", self.num_prepare_threads)
        if self.max_queued_prepares < self.num_prepare_threads:
            raise ValueError("max_queued_prepares must be at least num_prepare_threads")
        names = {f"r{i}" for i in range(len(self.replicas))}
        for name, key in self.replica_api_keys:
            if name not in names or not key:
                raise ValueError(f"replica_api_keys names {name!r}: one of {sorted(names)}")
        for key, tenant in self.client_keys:
            if not key or not isinstance(tenant, str):
                raise ValueError("client_keys must be (key, tenant) pairs with a key")
        self.events_of()  # checks each entry
        if (self.events_curve_key is None) != (self.events_curve_server_key is None):
            raise ValueError("events_curve_key and events_curve_server_key go together")
        if self.shared_events is not None:
            check_endpoint("shared_events", self.shared_events)
        if self.shared_events_replay is not None:
            check_endpoint("shared_events_replay", self.shared_events_replay)
        for name in (
            "poll_interval_s",
            "reconcile_interval_s",
            "request_timeout_s",
            "prepare_timeout_s",
        ):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")

    def key_of(self) -> dict[str, str]:
        """Each replica's base URL -> the key it is sent (its own, else the shared one)."""
        own = dict(self.replica_api_keys)
        out = {}
        for i, url in enumerate(self.replicas):
            key = own.get(f"r{i}", self.replica_api_key)
            if key:
                out[url.rstrip("/")] = key
        return out

    def events_of(self) -> dict[str, tuple[str, str | None]]:
        """``replica_events`` as replica name -> (endpoint, replay endpoint or ``None``).

        Raises:
            ValueError: an entry is not ``NAME=ENDPOINT[,REPLAY]`` naming a replica.
        """
        names = {f"r{i}" for i in range(len(self.replicas))}
        out: dict[str, tuple[str, str | None]] = {}
        for entry in self.replica_events:
            name, _, where = entry.partition("=")
            if name not in names or not where:
                raise ValueError(
                    f"replica_events entry {entry!r} must be NAME=ENDPOINT[,REPLAY] with NAME "
                    f"one of {sorted(names)}"
                )
            endpoint, _, replay = where.partition(",")
            check_endpoint("replica_events", endpoint)
            if replay:
                check_endpoint("replica_events", replay)
            out[name] = (endpoint, replay or None)
        return out
