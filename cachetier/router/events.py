"""``EventFeed``: the replicas' KV events into the router's prefix index.

Each replica that publishes KV events says where in its ``/v1/fleet/state`` (``kv_events``).
One thread follows every such publisher (ZMQ sockets belong to the thread that uses them): it
opens a ``KVEventSubscriber`` per replica, applies each delivered batch to the index under the
router's name for that replica, and reopens a subscriber when the replica reports another
endpoint or epoch (a restart). A publisher bound to every address (``0.0.0.0``) is reached at
the host the router reaches the replica at. A sidecar's events (``shared``) are followed as
replica ``*``: what every replica can load. A replica whose events are configured
(``RouterConfig.replica_events``: ``vllm serve`` says nowhere where they are) is followed in
vLLM's framing (no topic of ours), filed under the router's name for it. Where the publishers
take CURVE clients only, every subscriber connects with the router's certificate and the
publishers' public one (``curve``).
"""

from __future__ import annotations

import logging
import threading
from urllib.parse import urlsplit

from cachetier.kvevents import KVEventSubscriber, SubscriberConfig
from cachetier.kvindex import SHARED, PrefixIndex
from cachetier.router.replicas import Replica, ReplicaSet

log = logging.getLogger("cachetier.router")
RECEIVE_S = 0.05
"""How long one pass waits on each subscriber: the index is at most this stale per replica."""


class EventFeed:
    """Follows the replicas' KV events on a thread of its own.

    Args:
        replicas: the router's replicas (their reported ``kv_events`` are read each pass).
        index: where the events go.
        shared: a sidecar's PUB endpoint and replay endpoint (or ``None``), whose events
            are every replica's; ``None`` for none.
        fixed: replica name -> its (vLLM) publisher's endpoint and replay endpoint.
        curve: the router's CURVE certificate file (with its secret key) and the publishers'
            public certificate file; ``None`` to connect without CURVE.
    """

    def __init__(
        self,
        replicas: ReplicaSet,
        index: PrefixIndex,
        shared: tuple[str, str | None] | None = None,
        fixed: dict[str, tuple[str, str | None]] | None = None,
        curve: tuple[str, str] | None = None,
    ) -> None:
        self.replicas = replicas
        self.index = index
        self._shared = shared
        self._fixed = dict(fixed or {})
        self._curve = curve
        self.num_batches = 0
        self.num_missed = 0
        self._subs: dict[str, tuple[_Where, KVEventSubscriber]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="router-kv-events", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=10)

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self._sync()
                if not self._subs:
                    self._stop.wait(RECEIVE_S)
                for name, (_, sub) in list(self._subs.items()):
                    for delivery in sub.receive(timeout_s=RECEIVE_S / max(len(self._subs), 1)):
                        self.num_batches += 1
                        self.num_missed += delivery.num_missed
                        self.index.apply(
                            name, delivery.epoch, delivery.seq, delivery.batch.changes()
                        )
        finally:
            for _, sub in self._subs.values():
                sub.close()

    def _sync(self) -> None:
        """Open, reopen or close subscribers to match what the replicas report."""
        wanted = {r.name: _where(r) for r in self.replicas.replicas}
        for name, (endpoint, replay) in self._fixed.items():
            wanted[name] = (endpoint, replay, 0, "")
        if self._shared is not None:
            wanted[SHARED] = (*self._shared, 0, "kv@")
        for name, (where, sub) in list(self._subs.items()):
            if wanted.get(name) != where:
                sub.close()
                del self._subs[name]
        for name, where in wanted.items():
            if where is None or name in self._subs:
                continue
            endpoint, replay, _, topic = where
            # vLLM's frames name no replica: the subscriber files them under this one's name.
            secret, server = self._curve if self._curve is not None else (None, None)
            config = SubscriberConfig(
                endpoint,
                replay,
                topic,
                name if not topic else None,
                curve_secret_key_file=secret,
                curve_server_key_file=server,
            )
            try:
                sub = KVEventSubscriber(config)
            except (ValueError, OSError) as exc:  # zmq's errors are OSErrors
                log.warning("replica %s's KV events at %s: %s", name, endpoint, exc)
                continue
            self._subs[name] = (where, sub)


_Where = tuple[str, str | None, int, str]
"""(endpoint, replay endpoint, epoch, topic prefix) of one replica's publisher."""


def _where(replica: Replica) -> _Where | None:
    raw = replica.state.get("kv_events")
    if not isinstance(raw, dict) or not isinstance(raw.get("endpoint"), str):
        return None
    host = urlsplit(replica.url).hostname or "127.0.0.1"
    replay = raw.get("replay_endpoint")
    return (
        _reachable(raw["endpoint"], host),
        _reachable(replay, host) if isinstance(replay, str) else None,
        int(raw.get("epoch") or 0),
        "kv@",
    )


def _reachable(endpoint: str, host: str) -> str:
    for wildcard in ("0.0.0.0", "[::]", "*"):
        if f"//{wildcard}:" in endpoint:
            return endpoint.replace(wildcard, host, 1)
    return endpoint
