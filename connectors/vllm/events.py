"""What cachetier's tiers hold, published through vLLM's own KV-event publisher.

vLLM publishes KV events (``--kv-events-config``) from its scheduler: its GPU pool's, and those
a connector yields from ``take_events``. Our tiers live in the worker's ``TieredStore``, so the
events travel as vLLM has connectors carry them:

- the worker's store tells its block changes (puts per tier, evictions, deletes) to
  ``cachetier.store.events.publish_store``, which announces what the CPU and disk tiers hold at
  start and makes ``cachetier.kvevents`` events of every change after, on whichever thread made
  it (the engine's, a tier writer's), into ``VllmEventSink``;
- ``get_kv_connector_kv_cache_events`` hands what the sink collected since the last step to
  vLLM as ``CacheTierKVEvents``, which vLLM carries to the scheduler in ``KVConnectorOutput``;
- the scheduler side takes them in ``update_connector_output`` (``SchedulerEvents``) and yields
  them from ``take_events``, and vLLM publishes them in the step's batch beside its own.

Each event names its tier as its medium (``cpu``, ``disk``, ``redis``, ``remote``) and carries
our record keys as 32-byte hashes (vLLM's own are 64-bit ints: consumers tell them apart by
medium), one record's tokens per block, and the block's tokens and parent where the connector
knew them (``note_tokens``), so that a consumer hashing tokens its own way can index them too.
"""

from __future__ import annotations

import threading
from collections import Counter, deque
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import msgspec
from vllm.distributed.kv_events import AllBlocksCleared as VllmAllBlocksCleared
from vllm.distributed.kv_events import BlockRemoved as VllmBlockRemoved
from vllm.distributed.kv_events import BlockStored as VllmBlockStored
from vllm.distributed.kv_events import KVCacheEvent, KVConnectorKVEvents
from vllm.logger import init_logger

from cachetier.connectors.vllm.metadata import BlockTransfer
from cachetier.kvevents import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
    TierEvents,
    check_medium,
)
from cachetier.kvevents.config import is_loopback
from cachetier.kvevents.tokens import KeyTokens
from cachetier.store.events import publish_store
from cachetier.store.tiered import TieredStore

if TYPE_CHECKING:
    from vllm.config import VllmConfig

logger = init_logger("vllm.cachetier.events")

DEFAULT_MAX_BLOCKS = 1 << 18
"""Block hashes the sink keeps for vLLM at most (tens of MiB with their tokens): a store's
announce at start, or an engine that stopped stepping, never grows it past that."""
OWNERSHIP = "cachetier"
"""vLLM's ``ownership`` field: the secondary tier that made the event."""
CLEARED_CHUNK = 1024


def kv_events_enabled(vllm_config: VllmConfig) -> bool:
    """Whether vLLM publishes KV events: only then does the connector collect any (nothing
    would take them otherwise). Warns when vLLM's publisher binds beyond loopback: it has no
    authentication, and the events of our tiers carry the prompts' token ids."""
    config = vllm_config.kv_events_config
    enabled = bool(
        config is not None and config.enable_kv_cache_events and config.publisher != "null"
    )
    if enabled and config is not None:
        exposed = [e for e in (config.endpoint, config.replay_endpoint) if e and not is_loopback(e)]
        if exposed:
            logger.warning(
                "cachetier: vLLM publishes KV events at %s without authentication, and the "
                "tiers' events carry prompts' token ids: bind tcp://127.0.0.1 or keep the "
                "port behind a network policy (docs/operations.md, who can read KV events)",
                exposed,
            )
    return enabled


class VllmEventSink:
    """Collects cachetier's KV events as vLLM's, until the worker hands them to vLLM.

    Thread-safe: the engine thread and the store's writer threads publish, the engine thread
    takes. Bounded: past ``max_blocks`` block hashes the oldest events are dropped and counted
    (the store's ``HeldKeys`` still says what is held, so a consumer comparing digests finds
    the loss).

    Args:
        locality: medium -> ``LOCAL`` or ``REMOTE`` (vLLM's ``locality``, relative to this
            engine); media not named go out without one.
        spec_kind: vLLM's ``kv_cache_spec_kind`` of the one KV group the connector serves.
        max_blocks: block hashes kept at most.
    """

    def __init__(
        self,
        locality: Mapping[str, str] | None = None,
        spec_kind: str | None = None,
        max_blocks: int = DEFAULT_MAX_BLOCKS,
    ) -> None:
        if isinstance(max_blocks, bool) or not isinstance(max_blocks, int) or max_blocks <= 0:
            raise ValueError(f"max_blocks must be a positive int, got {max_blocks!r}")
        self.max_blocks = max_blocks
        self._locality = dict(locality or {})
        self._spec_kind = spec_kind
        self._lock = threading.Lock()
        self._events: deque[tuple[KVCacheEvent, int]] = deque()
        self._num_blocks = 0
        self.num_dropped_events = 0
        self.num_dropped_blocks = 0

    @classmethod
    def for_store(cls, store: TieredStore, spec_kind: str | None = None) -> VllmEventSink:
        """A sink whose media are ``store``'s tiers, local unless read over a network."""
        locality = {t.name: "REMOTE" if t.over_network else "LOCAL" for t in store.tiers}
        return cls(locality, spec_kind)

    def publish(self, events: Sequence[KVEvent]) -> bool:
        """Keep ``events`` for vLLM (``cachetier.kvevents.EventSink``).

        Returns:
            True: they are kept (older ones may have been dropped to make room).

        Raises:
            ValueError: an event vLLM's format cannot carry (a tier's ``AllBlocksCleared``:
                ``ConnectorTierEvents`` sends removals instead).
        """
        converted = [self.to_vllm(event) for event in events]
        with self._lock:
            for event in converted:
                size = max(1, len(getattr(event, "block_hashes", ())))
                self._events.append((event, size))
                self._num_blocks += size
            dropped = 0
            while self._num_blocks > self.max_blocks and len(self._events) > 1:
                _, size = self._events.popleft()
                self._num_blocks -= size
                self.num_dropped_blocks += size
                dropped += 1
            first_drop = dropped and not self.num_dropped_events
            self.num_dropped_events += dropped
        if first_drop:
            logger.warning(
                "cachetier: KV events for more than %d blocks are waiting for vLLM to take "
                "them; the oldest are dropped (counted in num_dropped_events)",
                self.max_blocks,
            )
        return True

    def take(self) -> list[KVCacheEvent]:
        """The events kept since the last call, oldest first."""
        with self._lock:
            taken = [event for event, _ in self._events]
            self._events.clear()
            self._num_blocks = 0
        return taken

    def to_vllm(self, event: KVEvent) -> KVCacheEvent:
        """``event`` as vLLM's own event class, every field it requires spelt out.

        Raises:
            ValueError: a tier's ``AllBlocksCleared`` (vLLM's names no medium).
        """
        if isinstance(event, BlockStored):
            return VllmBlockStored(
                block_hashes=list(event.block_hashes),
                parent_block_hash=event.parent_block_hash,
                token_ids=list(event.token_ids),
                block_size=event.block_size,
                lora_id=event.lora_id,
                medium=event.medium,
                lora_name=event.lora_name,
                # Our keys chain over the namespace (model, layout, tenant and cache salt):
                # no key of a block is left for extra_keys to carry.
                extra_keys=None,
                group_idx=0,  # the connector serves one KV cache group
                kv_cache_spec_kind=self._spec_kind,
                locality=self._locality.get(event.medium or ""),
                ownership=OWNERSHIP,
            )
        if isinstance(event, BlockRemoved):
            return VllmBlockRemoved(
                block_hashes=list(event.block_hashes),
                medium=event.medium,
                group_idx=0,
                locality=self._locality.get(event.medium or ""),
                ownership=OWNERSHIP,
            )
        if isinstance(event, AllBlocksCleared) and event.medium is None:
            return VllmAllBlocksCleared()
        raise ValueError(
            f"vLLM's KV events cannot say {event!r:.100}: its AllBlocksCleared names no "
            "medium (consumers read it as the whole engine's); publish removals instead"
        )


class ConnectorTierEvents(TierEvents):
    """``TierEvents`` as vLLM's KV events can say them: a tier's clear goes out as the removal
    of every key that tier was said to hold, as vLLM's ``AllBlocksCleared`` has no medium and
    its consumers read it as the engine's own pool being emptied. (Every ``BlockStored`` names
    the record's tokens as its ``block_size``: ``publish_store`` passes it, the start-up
    announce included.)

    Args:
        sink: where the events go.
    """

    def cleared(self, medium: str) -> bool:
        keys = self.held.keys(check_medium(medium))
        sent = True
        for start in range(0, len(keys), CLEARED_CHUNK):
            sent &= self.removed(medium, keys[start : start + CLEARED_CHUNK])
        self.held.clear(medium)
        return sent


def watch_store(store: TieredStore, sink: VllmEventSink, record_tokens: int) -> TierEvents:
    """Publish ``store``'s block changes into ``sink`` from now on, after announcing what its
    CPU and disk tiers hold (a restarted engine's disk is routable from its first step).

    Args:
        store: the worker's store.
        sink: where the events go.
        record_tokens: tokens per record, the events' ``block_size``.

    Returns:
        The tier events, whose ``tokens`` the worker notes its blocks' tokens in.
    """
    tier_events = ConnectorTierEvents(sink)
    announced = publish_store(store.block_events, store.tiers, tier_events, record_tokens)
    logger.info(
        "cachetier: KV events on for tiers %s; %d stored records announced",
        [tier.name for tier in store.tiers],
        announced,
    )
    return tier_events


def note_tokens(tokens: KeyTokens, transfer: BlockTransfer) -> None:
    """Note the tokens and parent of each record of ``transfer`` (where the scheduler sent
    them), so that the events of its keys, in whichever tier, carry them."""
    if not transfer.token_ids:
        return
    size = len(transfer.token_ids) // len(transfer.keys)
    parent = transfer.parent
    for i, key in enumerate(transfer.keys):
        tokens.note(key, parent, transfer.token_ids[i * size : (i + 1) * size])
        parent = key


class CacheTierKVEvents(KVConnectorKVEvents):
    """The events of a step, as vLLM carries them from the workers to the scheduler.

    Picklable plain data (vLLM may send it between processes). Order is kept: a key stored,
    removed and stored again must reach consumers in that order, which a counting aggregate
    (vLLM's ``KVEventAggregator``) would not keep.

    Args:
        events: one worker's events, oldest first.
        num_workers: workers whose events are in ``events``.
    """

    def __init__(self, events: Sequence[KVCacheEvent] = (), num_workers: int = 1) -> None:
        self._events = list(events)
        self._num_workers = num_workers

    def __len__(self) -> int:
        return len(self._events)

    def add_events(self, events: list[KVCacheEvent]) -> None:
        self._events.extend(events)

    def aggregate(self) -> CacheTierKVEvents:
        """Keep what every worker published, each once, in first-seen order.

        With one worker (the connector serves TP = PP = 1) that is everything; with more,
        each worker's tiers are its own slice of the same blocks, so an event is true of the
        engine only where all of them published it.
        """
        if self._num_workers > 1:
            encode = msgspec.msgpack.encode
            seen = Counter(encode(event) for event in self._events)
            kept: Counter[bytes] = Counter()
            events = []
            for event in self._events:
                key = encode(event)
                if kept[key] < seen[key] // self._num_workers:
                    kept[key] += 1
                    events.append(event)
            self._events, self._num_workers = events, 1
        return self

    def increment_workers(self, count: int = 1) -> None:
        self._num_workers += count

    def get_all_events(self) -> list[KVCacheEvent]:
        return list(self._events)

    def get_number_of_workers(self) -> int:
        return self._num_workers

    def clear_events(self) -> None:
        self._events = []


class SchedulerEvents:
    """The scheduler side's events from the workers, until vLLM takes them (the same step)."""

    def __init__(self) -> None:
        self._events: list[KVCacheEvent] = []

    def add(self, kv_events: KVConnectorKVEvents | None) -> None:
        """Take a step's events from ``KVConnectorOutput.kv_cache_events``."""
        if isinstance(kv_events, CacheTierKVEvents) and len(kv_events):
            self._events.extend(kv_events.aggregate().get_all_events())

    def take(self) -> list[KVCacheEvent]:
        """Everything added since the last call, oldest first."""
        events, self._events = self._events, []
        return events
