"""``PrefixIndex``: which replica holds which blocks of a prompt, in which medium.

Every publisher (an engine replica's pool and node-local tiers, a sidecar's shared tiers)
sends block stored / removed / cleared events (``cachetier.kvevents``); the index applies them
and answers, for a prompt's block keys, each replica's leading run of held blocks with the
fastest medium that holds each block: its pool, then its node-local tiers, then the shared
tiers every replica reads. That run is what a router weighs (``cachetier.fleet``).

Keys are cachetier block keys (``primitives.keys.block_keys``): chained over the tokens from
the namespace, so a publisher's keys equal the router's for the same model, layout and tenant,
and a disk tier's snapshot after a restart needs no token ids (its records carry none).

What keeps it right when events are lost:

- each publisher's events carry a sequence number and an epoch (one per process start): a gap
  is reported to the caller (``apply`` returns False), who replays or resyncs; events of an
  older epoch are dropped (a process that is gone), and a new epoch clears what the replica's
  previous process published;
- ``digest`` is what a publisher computes over what it holds (count and an XOR of key heads,
  ``cachetier.kvevents.HeldKeys``): equal digests mean the index agrees with it, and
  ``resync`` replaces a medium's holdings (``cachetier.router.reconcile`` does both on a
  timer);
- ``expire`` forgets replicas not heard from (events or ``touch``) within ``forget_after_s``.

Blocks a replica stores in a shared tier (Redis, the sidecar: ``SHARED_MEDIA``) are held for
every replica: they are kept under ``SHARED`` whoever published them, and outlive the
publisher's restart (the tier did not restart).

Thread-safe: a subscriber thread applies events while the router asks.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from cachetier.kvevents.held import key_digest
from cachetier.primitives.keys import BlockHash

POOL_MEDIA = frozenset({"gpu", "pool"})
"""Media an engine computes from: loaded for free."""
SHARED = "*"
"""The replica name of holdings every replica reads (a sidecar's, a Redis's)."""
SHARED_MEDIA = frozenset({"sidecar", "remote", "redis"})
"""Media every replica reads: a replica's events of them go under ``SHARED``."""
MEDIUM_ORDER = ("gpu", "pool", "cpu", "disk", "sidecar", "remote", "redis")
"""The order a replica prefers to read a block from (the first that holds it wins)."""


@dataclass(frozen=True, slots=True)
class Holding:
    """A replica's leading run of a prompt's blocks: ``media[i]`` holds block ``i``."""

    replica: str
    media: tuple[str, ...]

    @property
    def num_blocks(self) -> int:
        return len(self.media)

    def spans(self) -> list[tuple[str, int]]:
        """``(medium, blocks)`` runs in order, as a cost model weighs them."""
        out: list[tuple[str, int]] = []
        for medium in self.media:
            if out and out[-1][0] == medium:
                out[-1] = (medium, out[-1][1] + 1)
            else:
                out.append((medium, 1))
        return out

    def pool_blocks(self) -> int:
        """Leading blocks in the replica's pool (what a pool-only scorer sees)."""
        count = 0
        for medium in self.media:
            if medium not in POOL_MEDIA:
                break
            count += 1
        return count


@dataclass(slots=True)
class _Replica:
    epoch: int
    seq: int = -1
    heard: float = 0.0
    media: dict[str, set[bytes]] = field(default_factory=dict)


class PrefixIndex:
    """Holdings of every replica, by medium.

    Args:
        forget_after_s: a replica not heard from for this long is forgotten by ``expire``.
        clock: seconds now (monotonic).
    """

    def __init__(
        self, forget_after_s: float = 30.0, clock: Callable[[], float] = time.monotonic
    ) -> None:
        if not forget_after_s > 0:
            raise ValueError(f"forget_after_s must be positive, got {forget_after_s}")
        self.forget_after_s = forget_after_s
        self._clock = clock
        self._replicas: dict[str, _Replica] = {}
        self._lock = threading.Lock()
        self.num_stale_events = 0  # of an epoch older than the replica's current one
        self.num_gaps = 0

    @property
    def replicas(self) -> list[str]:
        """Replicas heard from (``SHARED`` included when a shared tier published)."""
        with self._lock:
            return sorted(self._replicas)

    def apply(
        self,
        replica: str,
        epoch: int,
        seq: int,
        changes: Sequence[tuple[str, str, Sequence[bytes]]],
    ) -> bool:
        """Apply one batch of a publisher's events.

        Args:
            replica: the publisher's replica name (``SHARED`` for shared tiers).
            epoch: the publishing process's epoch; a larger one replaces the replica's
                holdings (its previous process is gone), a smaller one is ignored.
            seq: the batch's sequence number in that epoch.
            changes: ``(kind, medium, keys)`` with kind ``stored``, ``removed`` or
                ``cleared`` (keys ignored).

        Returns:
            False when batches before this one were missed (``seq`` jumped): the caller
            replays them or resyncs; the batch itself is applied either way.
        """
        with self._lock:
            state = self._replicas.get(replica)
            if state is None or epoch > state.epoch:
                state = self._replicas[replica] = _Replica(epoch)
            elif epoch < state.epoch:
                self.num_stale_events += 1
                return True
            in_order = state.seq < 0 or seq <= state.seq + 1
            self.num_gaps += not in_order
            state.seq = max(state.seq, seq)
            state.heard = self._clock()
            for kind, medium, keys in changes:
                medium = medium.lower()
                if medium in SHARED_MEDIA and replica != SHARED:
                    shared = self._replicas.setdefault(SHARED, _Replica(0))
                    shared.heard = state.heard
                    _change(shared, kind, medium, keys)
                else:
                    _change(state, kind, medium, keys)
            return in_order

    def resync(self, replica: str, epoch: int, medium: str, keys: Iterable[bytes]) -> None:
        """Replace what ``replica`` holds in ``medium`` with ``keys`` (its snapshot)."""
        with self._lock:
            state = self._replicas.get(replica)
            if state is None or epoch > state.epoch:
                state = self._replicas[replica] = _Replica(epoch)
            elif epoch < state.epoch:
                return
            state.media[medium.lower()] = {bytes(k) for k in keys}
            state.heard = self._clock()

    def digest(self, replica: str, medium: str) -> tuple[int, int]:
        """``key_digest`` of what the index holds for ``replica`` in ``medium``."""
        with self._lock:
            state = self._replicas.get(replica)
            held = state.media.get(medium.lower(), set()) if state else set()
            return key_digest(held)

    def epoch(self, replica: str) -> int | None:
        """The epoch the index holds ``replica``'s blocks under; ``None`` if none."""
        with self._lock:
            state = self._replicas.get(replica)
            return None if state is None else state.epoch

    def digests(self, replica: str) -> dict[str, tuple[int, int]]:
        """``key_digest`` of each medium the index holds for ``replica``."""
        with self._lock:
            state = self._replicas.get(replica)
            media = dict(state.media) if state is not None else {}
            return {medium: key_digest(held) for medium, held in media.items()}

    def touch(self, replica: str) -> None:
        """A replica answered (a health check): it is not forgotten yet."""
        with self._lock:
            state = self._replicas.get(replica)
            if state is not None:
                state.heard = self._clock()

    def forget(self, replica: str) -> None:
        """Drop everything ``replica`` published."""
        with self._lock:
            self._replicas.pop(replica, None)

    def expire(self) -> list[str]:
        """Forget replicas not heard from within ``forget_after_s``; returns their names."""
        now = self._clock()
        with self._lock:
            gone = [r for r, s in self._replicas.items() if now - s.heard > self.forget_after_s]
            for replica in gone:
                del self._replicas[replica]
        return gone

    def holdings(self, keys: Sequence[BlockHash], replicas: Iterable[str]) -> list[Holding]:
        """Each of ``replicas``' leading run of ``keys``: the fastest medium (``MEDIUM_ORDER``)
        of the replica, or of the shared tiers, holding each block.

        Args:
            keys: a prompt's block keys, in order.
            replicas: the replicas to answer for (one that published nothing holds nothing of
                its own, but still reads the shared tiers).
        """
        with self._lock:
            shared = self._replicas.get(SHARED)
            out = []
            for replica in replicas:
                own = self._replicas.get(replica)
                sources = [s for s in (own, shared) if s is not None]
                out.append(Holding(replica, _run(sources, keys)))
            return out


def _change(state: _Replica, kind: str, medium: str, keys: Sequence[bytes]) -> None:
    if kind == "stored":
        state.media.setdefault(medium, set()).update(bytes(k) for k in keys)
    elif kind == "removed":
        held = state.media.get(medium)
        if held is not None:
            held.difference_update(bytes(k) for k in keys)
    elif kind == "cleared":
        state.media.pop(medium, None)
    else:
        raise ValueError(f"unknown event kind {kind!r}")


def _run(sources: list[_Replica], keys: Sequence[BlockHash]) -> tuple[str, ...]:
    media = sorted(
        ((medium, held) for s in sources for medium, held in s.media.items() if held),
        key=lambda m: MEDIUM_ORDER.index(m[0]) if m[0] in MEDIUM_ORDER else len(MEDIUM_ORDER),
    )
    run: list[str] = []
    for key in keys:
        raw = bytes(key)
        found = next((medium for medium, held in media if raw in held), None)
        if found is None:
            break
        run.append(found)
    return tuple(run)
