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

from cachetier.keys import BlockHash


@dataclass(frozen=True, slots=True)
class BlockTransfer:
    """Whole vLLM blocks to copy from or to the tiers, for one request.

    Args:
        req_id: vLLM request id (for logs).
        namespace_id: storage namespace of the blocks (``Namespace.id``).
        fingerprint: namespace fingerprint the records must carry.
        keys: block keys, in sequence order.
        block_ids: vLLM block ids, one per key.
    """

    req_id: str
    namespace_id: str
    fingerprint: bytes
    keys: tuple[BlockHash, ...]
    block_ids: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.keys) != len(self.block_ids):
            raise ValueError(f"{len(self.keys)} keys for {len(self.block_ids)} block ids")


@dataclass
class CacheTierConnectorMetadata(KVConnectorMetadata):
    """One step's work for the worker.

    Args:
        loads: blocks to restore before the forward (each request's first new blocks).
        saves: blocks whose every token was computed by this step's forward, to store after it.
    """

    loads: list[BlockTransfer] = field(default_factory=list)
    saves: list[BlockTransfer] = field(default_factory=list)


@dataclass
class StoredBlocks(KVConnectorWorkerMetadata):
    """Worker -> scheduler: keys the worker stored or failed to restore, by namespace id.

    Only the scheduler's view of the worker's in-process CPU tier needs it; disk and Redis the
    scheduler can ask itself.
    """

    stored: dict[str, list[BlockHash]] = field(default_factory=dict)
    failed: dict[str, list[BlockHash]] = field(default_factory=dict)

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
        return out
