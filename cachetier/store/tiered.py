"""``TieredStore``: an ordered stack of tiers (e.g. CPU -> disk -> Redis) behind one interface.

- A lookup finds the longest prefix of keys present in *any* tier (block i may sit in CPU and
  block i+1 on disk).
- A hit in a lower tier is promoted: written to the first tier at once and to the tiers in
  between in the background.
- A put goes to the first tier at once and is written through to the lower tiers by one
  background writer per tier, each with a bounded queue; what does not fit in a queue is
  dropped and counted, so a slow Redis never stalls the serving loop. With write-through the
  lower tiers already hold what an upper tier evicts, so nothing needs to spill on eviction.
- ``flush()`` waits until every queued write has been applied.
- ``pin_prefix()`` keeps a prefix's blocks from every tier's eviction (``store_pins``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

from cachetier.admission import AdmissionPolicy
from cachetier.admission.live_curve import LiveCurve, admission_choices
from cachetier.guard import QuarantineList
from cachetier.misses import MissCause, MissLedger, why_missed
from cachetier.pins.registry import PinRegistry
from cachetier.pins.store import StorePins
from cachetier.primitives.keys import BlockHash
from cachetier.record import KVBlock
from cachetier.store.admit import admitted
from cachetier.store.costmodel import TierRates
from cachetier.store.events import BlockEvents, tell_cleared
from cachetier.store.namespace_watch import NamespaceWatch
from cachetier.store.pinning import StorePinning
from cachetier.store.rates_file import RatesFile
from cachetier.store.verify import Verdict, Verifier
from cachetier.store.writer import TierWriter
from cachetier.tiers.base import Tier, check_namespace
from cachetier.tiers.prefix import PrefixHit, RestoredPrefix
from cachetier.util.landing import Destination
from cachetier.util.parallel import BACKGROUND_NICE


class TieredStore(StorePinning, Tier):
    """Tiers searched in order, written to the first at once and to the rest in the background.

    Args:
        tiers: the tiers, fastest first. The store owns them and closes them on ``close()``.
        write_queue_blocks: most blocks queued per lower tier before puts are dropped.
        write_queue_bytes: most bytes queued per lower tier before puts are dropped; ``None``
            for no limit but ``write_queue_blocks``.
        promote: copy hits from lower tiers into the tiers above them.
        writer_nice: CPU priority of the lower tiers' writer threads, 0 (the process's) to 19
            (the lowest, the default: they use the cores the engine leaves idle; see
            ``cachetier.util.parallel.BACKGROUND_NICE``).
        pin_registry: where pins are kept across restarts (they are applied to the tiers
            now); ``None`` keeps pins in memory only.
        rates_file: where one tier's measured rate is kept across restarts
            (``cachetier.store.rates_file``): the store starts from it and keeps it up to date.
        admission: which blocks the lower tiers write (``cachetier.admission``); ``None``
            writes every block without counting.
        miss_tracked_keys: keys the why-miss ledger and token index remember at most.
        namespaces: where tokens stored under other namespaces are told (kept across
            restarts where it has files); ``None``: one in memory.
        live_curve: fed every ``lookup`` (``cachetier.admission.live_curve``); ``None``: none.
    """

    name = "tiered"

    def __init__(
        self,
        tiers: Sequence[Tier],
        *,
        write_queue_blocks: int = 4096,
        write_queue_bytes: int | None = None,
        promote: bool = True,
        writer_nice: int = BACKGROUND_NICE,
        pin_registry: PinRegistry | None = None,
        rates_file: RatesFile | None = None,
        admission: AdmissionPolicy | None = None,
        miss_tracked_keys: int = 1 << 20,
        namespaces: NamespaceWatch | None = None,
        live_curve: LiveCurve | None = None,
    ) -> None:
        super().__init__()
        if not tiers:
            raise ValueError("a TieredStore needs at least one tier")
        if not 0 <= writer_nice <= 19:
            raise ValueError(f"writer_nice must be in [0, 19], got {writer_nice}")
        if write_queue_blocks <= 0:
            raise ValueError(f"write_queue_blocks must be positive, got {write_queue_blocks}")
        if write_queue_bytes is not None and write_queue_bytes <= 0:
            raise ValueError(f"write_queue_bytes must be positive, got {write_queue_bytes}")
        self._tiers = list(tiers)
        self._promote = promote
        self._names = tuple(tier.name for tier in self._tiers)
        # Which tier took or let go of which keys (``publish_store`` makes KV events of it).
        self.block_events = BlockEvents()
        self._writers = [
            TierWriter(t, write_queue_blocks, write_queue_bytes, self._stats, writer_nice)
            for t in self._tiers[1:]
        ]
        for writer in self._writers:
            writer.on_written = self._stored_in(writer.tier.name)
        self._closed = False
        # Every tier's measured latency and read speed, from the lookups and gets below: what
        # a cost model weighs a load against a recompute with.
        self.rates = TierRates()
        self._rates_file = (
            rates_file if rates_file is not None and rates_file.tier in self._names else None
        )
        self._rates_measured = False  # whether this process has read the kept tier itself
        if self._rates_file is not None:
            kept = self._rates_file.load()
            if kept is not None:
                self.rates.adopt(self._rates_file.tier, kept)
        self._pins = StorePins(self._tiers, pin_registry)
        self._admission = admission
        self.live_curve = live_curve
        # Keys let go (evicted, refused, dropped, corrupt): a later miss of one names its
        # cause; the same tokens under another namespace are told by ``namespaces``.
        self.misses = MissLedger(miss_tracked_keys)
        self.namespaces = namespaces or NamespaceWatch(miss_tracked_keys)
        for tier in self._tiers:
            tier.listen_evictions(self._evicted_by(tier.name))
            tier.corrupt_listener = self._lost_by(tier.name, "corrupt")
        # Namespaces a tier may no longer serve (``cachetier.store.verify``): lookups pass
        # over a quarantined tier as if it held nothing.
        self.quarantines = QuarantineList()
        self.guard = Verifier(self.quarantines)
        # A sidecar's store refuses the records of writers its clients reported bad as it
        # reads them (it has no tokens to check them by); an engine's checks each record
        # itself (``record_guard``), with the cause.
        self.refuse_quarantined_writers = False

    @property
    def tiers(self) -> tuple[Tier, ...]:
        return tuple(self._tiers)

    @property
    def capacity_bytes(self) -> int | None:
        caps = [tier.capacity_bytes for tier in self._tiers]
        return None if any(c is None for c in caps) else sum(c for c in caps if c is not None)

    @property
    def used_bytes(self) -> int:
        return sum(tier.used_bytes for tier in self._tiers)

    def put_many(
        self,
        namespace: str,
        blocks: Sequence[KVBlock],
        *,
        generated: Sequence[bool] | None = None,
    ) -> int:
        """Store ``blocks`` in the first tier now and queue them for the lower tiers that
        admit them (``cachetier.admission``; every tier takes every block under ``all``).

        Args:
            namespace: storage namespace.
            blocks: the blocks, those of one request.
            generated: per block, whether it holds generated tokens (admission may treat
                those apart); ``None``: prompt blocks.

        Returns:
            Blocks the first tier stored.
        """
        check_namespace(namespace)
        if not blocks:
            return 0
        blocks = list(blocks)
        stored = self._tiers[0].put_many(namespace, blocks)
        self.block_events.tell("stored", self._names[0], namespace, [b.key for b in blocks])
        if self.live_curve is not None:
            self.live_curve.stored([b.key for b in blocks], blocks[0].nbytes)
        policy = self._admission
        if policy is not None:
            policy.record(b.key for b in blocks)
        self.misses.forget(b.key for b in blocks)
        for writer in self._writers:
            chosen = blocks
            if policy is not None:
                chosen = admitted(
                    policy, writer.tier.name, namespace, blocks, generated, self._pins
                )
                if len(chosen) < len(blocks):  # remembered: a later miss says why
                    kept = {id(b) for b in chosen}
                    refused = (b.key for b in blocks if id(b) not in kept)
                    self.misses.note(refused, "not_admitted", writer.tier.name)
            if chosen and not writer.submit(namespace, chosen):
                self.misses.note((b.key for b in chosen), "write_dropped", writer.tier.name)
        self._stats.add(puts=len(blocks))
        return stored

    def lookup(
        self, namespace: str, keys: Sequence[BlockHash], *, observed: bool = True
    ) -> PrefixHit:
        """Find the leading run of ``keys`` stored in any tier, without reading blocks.

        Args:
            namespace: storage namespace.
            keys: block keys in sequence order.
            observed: a request's lookup, which the live curve counts (not a probe).

        Returns:
            The run's length and which tier holds which part of it.
        """
        check_namespace(namespace)
        if observed and self.live_curve is not None:
            self.live_curve.observe(keys)
        spans: list[tuple[int, int, int]] = []
        held: list[Tier] = []  # tiers the namespace is quarantined in
        down: list[str] = []  # tiers whose lookup failed
        pos = 0
        while pos < len(keys):
            for index, tier in enumerate(self._tiers):
                if self.quarantines.holds(tier.name, namespace):
                    if pos == 0:  # counted once per lookup, where the run would begin
                        self.guard.count_quarantined_lookup(tier.name)
                        held.append(tier)
                    continue
                errors = tier.num_errors
                start = time.perf_counter()
                found = tier.contains_prefix(namespace, keys[pos:])
                if tier.num_errors == errors:
                    self.rates.observe_latency(tier.name, time.perf_counter() - start)
                else:
                    down.append(tier.name)
                if found:
                    spans.append((index, pos, pos + found))
                    pos += found
                    break
            else:
                break
        # What the quarantined tiers would have added is asked only where there are any (a
        # quarantine is rare): those blocks are misses of cause ``quarantined``.
        lost = max((_held_prefix(t, namespace, keys[pos:]) for t in held), default=0)
        miss = MissCause("never_stored")
        if pos < len(keys):
            miss = why_missed(self.misses, keys[pos], held[0].name if lost else None, down)
        return PrefixHit(
            pos,
            tuple(spans),
            self._names,
            quarantined_blocks=lost,
            miss_cause=miss.cause if pos < len(keys) else "",
            miss_tier=miss.tier,
            miss_detail=miss.in_words(),
        )

    def _evicted_by(self, tier: str) -> Callable[[str, BlockHash, float | None], None]:
        def evicted(namespace: str, key: BlockHash, stamp: float | None) -> None:
            self.misses.note([key], "evicted", tier, stored_at=stamp)
            self.block_events.tell("removed", tier, namespace, [key])

        return evicted

    def _lost_by(self, tier: str, cause: str) -> Callable[[BlockHash], None]:
        def lost(key: BlockHash) -> None:
            self.misses.note([key], cause, tier)
            self.block_events.tell("removed", tier, "", [key])

        return lost

    def _stored_in(self, tier: str) -> Callable[[str, Sequence[BlockHash]], None]:
        return lambda namespace, keys: self.block_events.tell("stored", tier, namespace, keys)

    def contains_prefix(self, namespace: str, keys: Sequence[BlockHash]) -> int:
        return self.lookup(namespace, keys, observed=False).num_blocks

    def verify(
        self, namespace: str, tier_name: str, computed: Sequence[KVBlock], writer: str = ""
    ) -> Verdict:
        """Compare the records ``tier_name`` holds for ``computed``'s keys with ``computed``,
        and quarantine the namespace in that tier if they differ (``Verifier.verify``).

        Args:
            namespace: storage namespace.
            tier_name: the tier the verified hit was found in.
            computed: records the engine computed for those keys.
            writer: what the namespace's writers claim to be, for the log line.

        Returns:
            What was compared and found.
        """
        check_namespace(namespace)
        return self.guard.verify(self._tier(tier_name), namespace, computed, writer, self._names)

    def restore_prefix(
        self,
        namespace: str,
        keys: Sequence[BlockHash],
        *,
        fingerprint: bytes | None = None,
        dests: Sequence[Destination] | None = None,
        hit: PrefixHit | None = None,
    ) -> RestoredPrefix:
        """Fetch the leading run of stored blocks for ``keys``.

        Args:
            namespace: storage namespace.
            keys: block keys in sequence order.
            fingerprint: namespace fingerprint the blocks must carry; others count as misses.
            dests: optional caller memory, one buffer per key, that payloads are read into
                (see ``Tier.get_into``). Blocks read this way are not promoted: the caller
                holds them, and promoting would cost the copy this saves.
            hit: the caller's own ``lookup`` of these keys, just made: not asked again (a
                remote tier would pay a round trip for it).

        Returns:
            The blocks of the longest leading run that could actually be read (a block that
            vanished or failed its checks between lookup and read ends the run there).
        """
        if hit is None:
            hit = self.lookup(namespace, keys, observed=False)
        n = min(hit.num_blocks, len(keys))
        found, sources = self._fetch(
            namespace, keys[:n], fingerprint, None if dests is None else dests[:n]
        )
        blocks: list[KVBlock] = []
        names: list[str] = []
        for block, source in zip(found, sources):
            if block is None:
                break
            blocks.append(block)
            names.append(self._names[source])
        return RestoredPrefix(tuple(blocks), tuple(names))

    def get_many(self, namespace: str, keys: Sequence[BlockHash]) -> list[KVBlock | None]:
        check_namespace(namespace)
        found, _ = self._fetch(namespace, keys, None, None)
        return found

    def get_into(
        self, namespace: str, keys: Sequence[BlockHash], dests: Sequence[Destination]
    ) -> list[KVBlock | None]:
        # Each tier asked for what the faster ones missed, reading straight into ``dests``
        # where it can (no lookup first: a get of blocks the caller expects pays no stats).
        check_namespace(namespace)
        if len(dests) != len(keys):
            raise ValueError(f"{len(dests)} destinations for {len(keys)} keys")
        found, _ = self._fetch(namespace, keys, None, dests)
        return found

    def _fetch(
        self,
        namespace: str,
        keys: Sequence[BlockHash],
        fingerprint: bytes | None,
        dests: Sequence[Destination] | None,
    ) -> tuple[list[KVBlock | None], list[int]]:
        start = time.perf_counter()
        found: list[KVBlock | None] = [None] * len(keys)
        sources = [-1] * len(keys)
        missing = list(range(len(keys)))
        foreign = 0
        for index, tier in enumerate(self._tiers):
            if not missing:
                break
            wanted = [keys[i] for i in missing]
            errors = tier.num_errors
            tier_start = time.perf_counter()
            if dests is None:
                got = tier.get_many(namespace, wanted)
            else:
                got = tier.get_into(namespace, wanted, [dests[i] for i in missing])
            if tier.num_errors == errors:
                nbytes = sum(b.nbytes for b in got if b is not None)
                self.rates.observe_read(tier.name, nbytes, time.perf_counter() - tier_start)
                kept = self._rates_file
                if kept is not None and nbytes and tier.name == kept.tier:
                    self._rates_measured = True
                    kept.save(self.rates.get(tier.name))
            still: list[int] = []
            promoted: list[KVBlock] = []
            refused: list[BlockHash] = []
            refuse = self.refuse_quarantined_writers and self.quarantines.has_writers
            for i, block in zip(missing, got):
                if block is None:
                    still.append(i)
                elif refuse and self.guard.refuses(tier.name, namespace, block):
                    refused.append(block.key)
                    still.append(i)
                elif block.key != keys[i] or (
                    fingerprint is not None and block.fingerprint != fingerprint
                ):
                    foreign += 1
                    still.append(i)
                else:
                    found[i] = block
                    sources[i] = index
                    promoted.append(block)
            if refused:  # gone, so the records computed again take their keys
                tier.delete(namespace, refused)
            if promoted and index > 0 and self._promote and dests is None:
                self._tiers[0].put_many(namespace, promoted)
                first = [b.key for b in promoted]
                self.block_events.tell("stored", self._names[0], namespace, first)
                for writer in self._writers[: index - 1]:
                    writer.submit(namespace, promoted)
            missing = still
        hits = len(keys) - len(missing)
        self._stats.add(hits=hits, misses=len(missing), corrupt=foreign)
        self._stats.observe(time.perf_counter() - start)
        return found, sources

    def delete(self, namespace: str, keys: Sequence[BlockHash]) -> int:
        self.flush()
        for name in self._names:
            self.block_events.tell("removed", name, namespace, keys)
        return max((tier.delete(namespace, keys) for tier in self._tiers), default=0)

    def delete_in(self, tier_name: str, namespace: str, keys: Sequence[BlockHash]) -> int:
        """Delete ``keys`` from one tier only (records found bad there: the same keys in other
        tiers may be another writer's, and good)."""
        self.block_events.tell("removed", tier_name, namespace, keys)
        return self._tier(tier_name).delete(namespace, keys)

    def _tier(self, name: str) -> Tier:
        for tier in self._tiers:
            if tier.name == name:
                return tier
        raise ValueError(f"no tier named {name!r}: the store has {list(self._names)}")

    @property
    def tier_names(self) -> tuple[str, ...]:
        return self._names

    def clear(self, namespace: str) -> int:
        self.flush()
        tell_cleared(self.block_events, self._tiers, namespace)
        return max((tier.clear(namespace) for tier in self._tiers), default=0)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued background write has been applied.

        Args:
            timeout: seconds to wait at most; ``None`` waits as long as it takes.

        Returns:
            ``True`` if everything was written, ``False`` on timeout.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        return all(writer.join(deadline) for writer in self._writers)

    def stats(self) -> dict[str, Any]:
        """Store-level counters (``rejected`` = blocks dropped from full write queues), queue
        depths, and each tier's own stats under ``tiers``."""
        out = super().stats()
        out["pending_writes"] = {w.tier.name: w.pending_blocks() for w in self._writers}
        out["tiers"] = {tier.name: tier.stats() for tier in self._tiers}
        out["rates"] = self.rates.snapshot()
        out["guard"] = self.guard.stats.as_dict()
        if self._admission is not None:
            out["admission"] = {
                "policy": self._admission.name,
                "tiers": {t: a.as_dict() for t, a in self._admission.stats().items()},
                "choices": admission_choices(self._admission, self._names),
            }
        if self.live_curve is not None:
            out["live_curve"] = self.live_curve.snapshot()
        return out

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._rates_file is not None and self._rates_measured:
            self._rates_file.save(self.rates.get(self._rates_file.tier), force=True)
        self.flush(timeout=30)
        self.namespaces.close()
        for writer in self._writers:
            writer.stop()
        for tier in self._tiers:
            tier.close()


def _held_prefix(tier: Tier, namespace: str, keys: Sequence[BlockHash]) -> int:
    """The leading blocks of ``keys`` a quarantined tier still holds (a tier's lookup counts
    its own errors and answers 0, as in ``lookup``)."""
    return tier.contains_prefix(namespace, keys) if keys else 0
