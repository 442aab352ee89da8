"""What the scheduler-side connector tells the worker each step, and what the worker reports back.

Everything here is plain picklable data (bytes, ints, strings), so scheduler and worker may live
in different processes: the worker needs nothing but this metadata and its own KV buffers.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)

from cachetier.primitives.keys import BlockHash
from cachetier.store.costmodel import TierRate


@dataclass(frozen=True, slots=True)
class BlockTransfer:
    """Whole vLLM blocks to copy from or to the tiers, for one request.

    Args:
        req_id: vLLM request id (for logs).
        namespace_id: storage namespace of the blocks (``Namespace.id``).
        fingerprint: namespace fingerprint the records must carry.
        keys: record keys, in sequence order: ``per_block`` of them per vLLM block.
        block_ids: vLLM block ids, in sequence order.
        verify_tiers: for a save, the tier whose record of each key a verified hit waits to
            compare with what vLLM computed (``""`` for none); empty when none does.
        generated: for a save, whether each record holds generated tokens (admission may
            treat those apart, ``cachetier.admission``); empty when all are prompt.
        token_ids: the records' tokens, the same number per key: for a load, always (the
            worker checks each record against its tokens, ``record_guard``); for a save, where
            vLLM publishes KV events (their ``BlockStored`` carry them,
            ``events.note_tokens``); else empty.
        parent: the key before ``keys[0]`` in the request's chain (``None`` for its first
            record), sent with ``token_ids``.
        first_position: the position in the request of ``keys[0]``'s first token.
        group: the KV cache group whose layers and block ids these are (``kv_groups``).
    """

    req_id: str
    namespace_id: str
    fingerprint: bytes
    keys: tuple[BlockHash, ...]
    block_ids: tuple[int, ...]
    verify_tiers: tuple[str, ...] = ()
    generated: tuple[bool, ...] = ()
    token_ids: tuple[int, ...] = ()
    parent: BlockHash | None = None
    first_position: int = 0
    group: int = 0

    def __post_init__(self) -> None:
        num_keys, num_blocks = len(self.keys), len(self.block_ids)
        if (num_keys == 0) != (num_blocks == 0) or (num_blocks and num_keys % num_blocks):
            raise ValueError(f"{num_keys} keys for {num_blocks} block ids")
        if self.verify_tiers and len(self.verify_tiers) != num_keys:
            raise ValueError(f"{len(self.verify_tiers)} verify tiers for {num_keys} keys")
        if self.generated and len(self.generated) != num_keys:
            raise ValueError(f"{len(self.generated)} generated flags for {num_keys} keys")
        if self.token_ids and (not num_keys or len(self.token_ids) % num_keys):
            raise ValueError(f"{len(self.token_ids)} token ids for {num_keys} keys")

    @property
    def per_block(self) -> int:
        """Records per vLLM block."""
        return len(self.keys) // len(self.block_ids) if self.block_ids else 1


@dataclass
class CacheTierConnectorMetadata(KVConnectorMetadata):
    """One step's work for the worker.

    Args:
        loads: blocks to restore before the forward (each request's first new blocks).
        async_loads: blocks to restore beside the forwards, for requests vLLM holds back until
            the worker reports them loaded (``get_finished``).
        saves: blocks whose every token was computed by this step's forward, to store after it.
        step_tokens: tokens this step computes, if it computes prompt tokens (else 0).
        step_attention: their attention work (``cachetier.store.costmodel.PrefillModel``).
    """

    loads: list[BlockTransfer] = field(default_factory=list)
    async_loads: list[BlockTransfer] = field(default_factory=list)
    saves: list[BlockTransfer] = field(default_factory=list)
    # A step that computes prompt tokens: its tokens and attention work (``PrefillModel``), so
    # the worker can report how long its forward took; 0 for a decode-only step.
    step_tokens: int = 0
    step_attention: float = 0.0


@dataclass
class StoredBlocks(KVConnectorWorkerMetadata):
    """Worker -> scheduler: keys the worker stored (or loaded: its CPU tier then holds them,
    just used) or failed to restore, by namespace id.

    The scheduler's view of the worker's in-process CPU tier needs the keys (disk and Redis the
    scheduler can ask itself); its cost model needs the step times and tier rates.
    """

    stored: dict[str, list[BlockHash]] = field(default_factory=dict)
    failed: dict[str, list[BlockHash]] = field(default_factory=dict)
    # What the cost model on the scheduler side learns from the worker: ``(tokens, attention,
    # forward seconds)`` of prefill steps, the worker's measured tier rates by tier name, and
    # ``(bytes, seconds)`` of its copies of restored records into vLLM's KV memory.
    steps: list[tuple[int, float, float]] = field(default_factory=list)
    rates: dict[str, TierRate] = field(default_factory=dict)
    copies: list[tuple[int, float]] = field(default_factory=list)
    # ``(tier, namespace id, reason)`` of quarantines the worker's guard began.
    # (tier, namespace id, reason, writer) of each writer quarantine the worker began
    quarantined: list[tuple[str, str, str, str]] = field(default_factory=list)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> StoredBlocks:
        if not isinstance(other, StoredBlocks):
            raise TypeError(f"cannot aggregate StoredBlocks with {type(other).__name__}")
        out = StoredBlocks(
            {ns: list(keys) for ns, keys in self.stored.items()},
            {ns: list(keys) for ns, keys in self.failed.items()},
        )
        for ns, keys in other.stored.items():
            out.stored.setdefault(ns, []).extend(keys)
        for ns, keys in other.failed.items():
            out.failed.setdefault(ns, []).extend(keys)
        out.steps = [*self.steps, *other.steps]
        out.copies = [*self.copies, *other.copies]
        out.rates = {**self.rates, **other.rates}
        out.quarantined = [*self.quarantined, *other.quarantined]
        return out
