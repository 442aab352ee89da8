"""KV events and their msgpack encoding, as vLLM's KV-event consumers read them.

The wire format is vLLM's (``vllm.distributed.kv_events``), written here without importing
vLLM, so that a tier or a sidecar publishes without it and a consumer built on vLLM's own
classes decodes what we send:

- a batch is a msgpack array ``[ts, events, data_parallel_rank, epoch]`` (trailing ``None``
  omitted); ``epoch`` is ours, and vLLM's and llm-d's decoders skip it;
- each event is tagged ``BlockStored``, ``BlockRemoved`` or ``AllBlocksCleared``: a msgpack map
  with a ``"type"`` key (``encoding="map"``, what vLLM's ``KVEventBatch`` here decodes), or an
  array whose first element is the tag (``encoding="array"``, what llm-d's vLLM adapter decodes,
  ``engineadapter/vllm_adapter.go``). ``decode`` takes either.

One addition of ours: ``AllBlocksCleared`` carries a ``medium`` key when a tier was cleared
(vLLM's has no fields, as only its GPU pool clears; its decoder ignores keys it does not
know). Block hashes are ``bytes`` (our ``BlockHash``); vLLM may send 64-bit ints instead
(``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``), which decode as ``int``.

Sans-IO: no sockets here, so the publisher, the subscriber and the tests share it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import msgspec

from cachetier.errors import CacheTierError
from cachetier.primitives.keys import HASH_BYTES, BlockHash

ExternalHash = bytes | int
"""A block hash on the wire: our 32-byte keys, or vLLM's 64-bit int hashes."""

MEDIUM_GPU = "GPU"
"""The medium vLLM names its own KV pool with; our engine's pool publishes under it too."""
MAX_MEDIUM_CHARS = 64


def check_medium(medium: str) -> str:
    """Validate a medium name (``"GPU"``, ``"cpu"``, ``"disk"``, ``"redis"``, ``"sidecar"``).

    Args:
        medium: 1-64 printable ASCII characters.

    Returns:
        ``medium`` unchanged.

    Raises:
        ValueError: it does not qualify.
    """
    if (
        not isinstance(medium, str)
        or not 0 < len(medium) <= MAX_MEDIUM_CHARS
        or not (medium.isascii() and medium.isprintable())
    ):
        raise ValueError(
            f"medium {str(medium)[:100]!r} must be 1-{MAX_MEDIUM_CHARS} printable ASCII "
            "characters naming a tier (e.g. 'disk')"
        )
    return medium


def check_keys(keys: Sequence[BlockHash]) -> tuple[bytes, ...]:
    """``keys`` as a tuple, each checked to be a 32-byte ``BlockHash``.

    Raises:
        ValueError: one is not; the message says what to pass.
    """
    for key in keys:
        if not isinstance(key, bytes) or len(key) != HASH_BYTES:
            raise ValueError(
                f"block keys must be {HASH_BYTES}-byte BlockHash values "
                f"(cachetier.primitives.keys), got {key!r:.80}"
            )
    return tuple(keys)


class MalformedEventError(CacheTierError):
    """A KV-event payload or frame is not what the format says (truncated, wrong types)."""


@dataclass(frozen=True, slots=True)
class BlockStored:
    """Blocks now held in ``medium``: ``block_hashes`` in chain order, each the child of the
    one before it, the first the child of ``parent_block_hash``.

    ``token_ids`` are the blocks' tokens (``block_size`` per block), or empty where the tier
    does not keep them (a disk tier's snapshot): our keys are chained over the tokens, so a
    consumer matches prompts by key alone.
    """

    block_hashes: tuple[ExternalHash, ...]
    parent_block_hash: ExternalHash | None
    token_ids: tuple[int, ...]
    block_size: int
    medium: str | None
    lora_id: int | None = None
    lora_name: str | None = None


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """Blocks no longer held in ``medium`` (evicted, deleted, found corrupt)."""

    block_hashes: tuple[ExternalHash, ...]
    medium: str | None


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """Everything ``medium`` held is gone; ``None`` (vLLM's own) means its GPU pool."""

    medium: str | None = None


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared

Change = tuple[str, str, tuple[bytes, ...]]
"""``(kind, medium, keys)`` with kind ``stored``, ``removed`` or ``cleared``: what
``cachetier.kvindex.PrefixIndex.apply`` takes."""


def hash_bytes(block_hash: ExternalHash) -> bytes:
    """A wire hash as bytes: ours as they are, vLLM's 64-bit ints as 8 bytes big-endian
    (so that a set of keys never mixes ``int`` and ``bytes``)."""
    if isinstance(block_hash, int):
        # msgpack ints span int64 to uint64: a negative one wraps, as vLLM's mask would.
        return (block_hash & 0xFFFF_FFFF_FFFF_FFFF).to_bytes(8, "big")
    return block_hash


@dataclass(frozen=True, slots=True)
class EventBatch:
    """Events published together; ``ts`` in Unix seconds when the batch was sent; ``epoch``
    the publishing process's start (``None`` from vLLM's publisher)."""

    ts: float
    events: tuple[KVEvent, ...]
    data_parallel_rank: int | None = None
    epoch: int | None = None

    def changes(self, default_medium: str = MEDIUM_GPU) -> list[Change]:
        """The batch as ``PrefixIndex.apply`` takes it.

        Args:
            default_medium: the medium of events that name none (vLLM's older publishers,
                and its ``AllBlocksCleared``, which only its GPU pool sends).

        Returns:
            One ``(kind, medium, keys)`` per event, in order; keys as ``hash_bytes``.
        """
        out: list[Change] = []
        for event in self.events:
            medium = event.medium if event.medium is not None else default_medium
            if isinstance(event, BlockStored):
                out.append(("stored", medium, tuple(map(hash_bytes, event.block_hashes))))
            elif isinstance(event, BlockRemoved):
                out.append(("removed", medium, tuple(map(hash_bytes, event.block_hashes))))
            else:
                out.append(("cleared", medium, ()))
        return out


# The wire structs. Fields without a default are always written: vLLM's decoder requires
# every one of them (lora_id, medium and lora_name included, even when None).
class _WireStored(msgspec.Struct, tag="BlockStored", omit_defaults=True, gc=False):
    block_hashes: list[ExternalHash]
    parent_block_hash: ExternalHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None


class _WireRemoved(msgspec.Struct, tag="BlockRemoved", omit_defaults=True, gc=False):
    block_hashes: list[ExternalHash]
    medium: str | None


class _WireCleared(msgspec.Struct, tag="AllBlocksCleared", omit_defaults=True, gc=False):
    medium: str | None = None


# The same events as llm-d's adapter reads them: positional, the tag first.
class _ArrayStored(_WireStored, tag="BlockStored", array_like=True):
    pass


class _ArrayRemoved(_WireRemoved, tag="BlockRemoved", array_like=True):
    pass


class _ArrayCleared(_WireCleared, tag="AllBlocksCleared", array_like=True):
    pass


class _WireBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[msgspec.Raw]
    data_parallel_rank: int | None = None
    epoch: int | None = None


_WireEvent = _WireStored | _WireRemoved | _WireCleared
_ENCODINGS = ("map", "array")
# msgpack's map markers: fixmap, map16, map32.
_MAP_FIRST_BYTES = frozenset([*range(0x80, 0x90), 0xDE, 0xDF])


class BatchCodec:
    """Encodes and decodes ``EventBatch`` payloads.

    Not thread-safe (msgspec's encoder keeps a buffer): one per thread.

    Args:
        encoding: ``"map"`` (events as vLLM's ``KVEventBatch`` decodes them) or ``"array"``
            (as llm-d's vLLM adapter decodes them); decoding takes either.
    """

    def __init__(self, encoding: str = "map") -> None:
        if encoding not in _ENCODINGS:
            raise ValueError(f"encoding must be one of {_ENCODINGS}, got {encoding!r}")
        self._array = encoding == "array"
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(type=_WireBatch)
        self._maps = msgspec.msgpack.Decoder(type=_WireEvent)
        self._arrays = msgspec.msgpack.Decoder(type=_ArrayStored | _ArrayRemoved | _ArrayCleared)

    def encode(self, batch: EventBatch) -> bytes:
        """The msgpack payload of ``batch``.

        Args:
            batch: the batch; its events' hashes must be ``bytes`` or ``int``.

        Returns:
            The payload vLLM's ``msgspec.msgpack.Decoder(type=KVEventBatch)`` decodes (map
            encoding), or llm-d's adapter does (array encoding).
        """
        events = [msgspec.Raw(self._encoder.encode(_to_wire(e, self._array))) for e in batch.events]
        wire = _WireBatch(batch.ts, events, batch.data_parallel_rank, batch.epoch)
        return self._encoder.encode(wire)

    def decode(self, payload: bytes) -> EventBatch:
        """The batch in ``payload`` (from our publisher or from vLLM's).

        Args:
            payload: one msgpack ``KVEventBatch``, its events maps or arrays.

        Returns:
            The batch, hashes as sent (``bytes`` or ``int``).

        Raises:
            MalformedEventError: ``payload`` is not a batch of known events.
        """
        try:
            wire = self._decoder.decode(payload)
            events = tuple(_from_wire(self._decode_event(bytes(e))) for e in wire.events)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise MalformedEventError(f"not a KV event batch: {exc}") from exc
        return EventBatch(wire.ts, events, wire.data_parallel_rank, wire.epoch)

    def _decode_event(self, raw: bytes) -> _WireEvent:
        if raw and raw[0] in _MAP_FIRST_BYTES:
            return self._maps.decode(raw)
        return self._arrays.decode(raw)


def _to_wire(event: KVEvent, array: bool) -> _WireEvent:
    if isinstance(event, BlockStored):
        return (_ArrayStored if array else _WireStored)(
            list(event.block_hashes),
            event.parent_block_hash,
            list(event.token_ids),
            event.block_size,
            event.lora_id,
            event.medium,
            event.lora_name,
        )
    if isinstance(event, BlockRemoved):
        return (_ArrayRemoved if array else _WireRemoved)(list(event.block_hashes), event.medium)
    if isinstance(event, AllBlocksCleared):
        return (_ArrayCleared if array else _WireCleared)(event.medium)
    raise TypeError(f"not a KV event: {type(event).__name__}")


def _from_wire(event: _WireEvent) -> KVEvent:
    if isinstance(event, _WireStored):
        return BlockStored(
            tuple(event.block_hashes),
            event.parent_block_hash,
            tuple(event.token_ids),
            event.block_size,
            event.medium,
            event.lora_id,
            event.lora_name,
        )
    if isinstance(event, _WireRemoved):
        return BlockRemoved(tuple(event.block_hashes), event.medium)
    return AllBlocksCleared(event.medium)


def count_blocks(events: Sequence[KVEvent]) -> int:
    """How many block hashes ``events`` name (a batch's size as a consumer applies it)."""
    return sum(len(e.block_hashes) for e in events if not isinstance(e, AllBlocksCleared))
