"""llm-d's KV-cache indexer, as it reads a vLLM engine's KV events, re-implemented in Python.

Each step follows the Go source of github.com/llm-d/llm-d-kv-cache (files and functions named
at each step), so a test can feed it our publisher's real frames and see what llm-d would
index. Only the paths our events can take are written out; one they cannot take raises.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from typing import Any

import msgspec

DEFAULT_DEVICE_TIER = "gpu"  # pkg/kvevents/pool.go: defaultEventSourceDeviceTier
DEFAULT_BLOCK_SIZE = 16  # pkg/kvcache/kvblock/token_processor.go: defaultBlockSize
_FNV64_OFFSET = 0xCBF29CE484222325
_FNV64_PRIME = 0x100000001B3
_U64 = (1 << 64) - 1


class LlmdError(Exception):
    """Where llm-d's Go code returns an error (the message or batch is dropped)."""


def parse_topic(topic: str) -> tuple[str, str]:
    """engineadapter/common.go: parseTopic: split on "@"; exactly 3 parts give (pod, model),
    anything else the whole topic as the pod and no model."""
    parts = topic.split("@")
    if len(parts) == 3:
        return parts[1], parts[2]
    return topic, ""


def read_frames(frames: list[bytes]) -> tuple[str, int, bytes]:
    """zmq_subscriber.go: runSubscriber: 3 frames, a sequence frame of at least 8 bytes read
    big-endian, the topic as a string."""
    if len(frames) != 3:
        raise LlmdError(f"unexpected frame count {len(frames)}")
    if len(frames[1]) < 8:
        raise LlmdError("sequence frame too short")
    return frames[0].decode("utf-8", "replace"), int.from_bytes(frames[1][:8], "big"), frames[2]


def hash_as_uint64(raw: Any) -> int:
    """engineadapter/common.go: getHashAsUint64: bytes give their last 8 bytes big-endian
    (shorter ones left-padded). Go's decoder types small ints as int8..uint32, which it
    refuses; msgspec cannot tell those apart, and our hashes are always bytes."""
    if isinstance(raw, bytes):
        if not raw:
            raise LlmdError("hash byte slice is empty")
        return int.from_bytes(raw[-8:], "big")
    raise LlmdError(f"unsupported hash type {type(raw).__name__} (our hashes are bytes)")


def _to_int(raw: Any) -> int:
    # engineadapter/vllm_adapter.go: toInt accepts integers only.
    if isinstance(raw, bool) or not isinstance(raw, int):
        raise LlmdError(f"unsupported numeric type {type(raw).__name__}")
    return raw


def _field(fields: list[Any], i: int) -> Any:
    return fields[i] if i < len(fields) else None  # vllm_adapter.go: fieldAt


@dataclass
class StoredEvent:
    block_hashes: list[int]
    tokens: list[int]
    parent_hash: int
    block_size: int
    device_tier: str
    lora_name: str | None


@dataclass
class RemovedEvent:
    block_hashes: list[int]
    device_tier: str


@dataclass
class ClearedEvent:
    pass


def _stored(fields: list[Any]) -> StoredEvent:
    # vllm_adapter.go: convertBlockStoredEvent: positions 0-4 required.
    if len(fields) < 5:
        raise LlmdError(f"BlockStored: need at least 5 fields, got {len(fields)}")
    if not isinstance(fields[1], list):
        raise LlmdError("BlockStored: block_hashes is not an array")
    hashes = [hash_as_uint64(h) for h in fields[1]]
    parent = hash_as_uint64(fields[2]) if fields[2] is not None else 0
    if not isinstance(fields[3], list):
        raise LlmdError("token_ids is not an array")
    tokens = [_to_int(t) & 0xFFFF_FFFF for t in fields[3]]  # toUint32Slice
    block_size = _to_int(fields[4])
    medium = _field(fields, 6)
    if medium is not None and not isinstance(medium, str):
        raise LlmdError("BlockStored: medium is not a string")
    lora_name = _field(fields, 7)
    if lora_name is not None and not isinstance(lora_name, str):
        raise LlmdError("BlockStored: lora_name is not a string")
    if _field(fields, 8) is not None:
        raise LlmdError("extra_keys: not sent by cachetier, not re-implemented")
    return StoredEvent(hashes, tokens, parent, block_size, medium or "", lora_name)


def _removed(fields: list[Any]) -> RemovedEvent:
    # vllm_adapter.go: convertBlockRemovedEvent.
    if len(fields) < 2:
        raise LlmdError(f"BlockRemoved: need at least 2 fields, got {len(fields)}")
    if not isinstance(fields[1], list):
        raise LlmdError("BlockRemoved: block_hashes is not an array")
    medium = _field(fields, 2)
    if medium is not None and not isinstance(medium, str):
        raise LlmdError("BlockRemoved: medium is not a string")
    return RemovedEvent([hash_as_uint64(h) for h in fields[1]], medium or "")


_CONVERTERS = {"BlockStored": _stored, "BlockRemoved": _removed}


def parse_message(topic: str, payload: bytes) -> tuple[str, str, float, list[Any]]:
    """vllm_adapter.go: ParseMessage: the topic's pod and model, then the batch as an array
    ``[ts, events, data_parallel_rank]`` (extra elements skipped, as vmihailenco/msgpack's
    decodeStructValue does), each event decoded into ``[]any`` (a map is an error there)."""
    pod, model = parse_topic(topic)
    try:
        batch = msgspec.msgpack.decode(payload)
    except msgspec.DecodeError as exc:
        raise LlmdError(f"failed to decode vLLM event batch: {exc}") from exc
    if not isinstance(batch, list) or len(batch) < 2 or not isinstance(batch[1], list):
        raise LlmdError("failed to decode vLLM event batch: not [ts, events, ...]")
    events: list[Any] = []
    for fields in batch[1]:
        # decodeVLLMEvent: Unmarshal into []any, tag first.
        if not isinstance(fields, list):
            raise LlmdError(f"failed to decode tagged union: {type(fields).__name__}, not array")
        if not fields:
            raise LlmdError("malformed tagged union: no tag")
        tag = fields[0]
        if not isinstance(tag, str):
            raise LlmdError("event tag is not a string")
        if tag == "AllBlocksCleared":
            events.append(ClearedEvent())  # convertAllBlocksClearedEvent reads no field
        elif tag in _CONVERTERS:
            events.append(_CONVERTERS[tag](fields))
        else:
            raise LlmdError(f"unknown vLLM event tag: {tag}")
    return pod, model, float(batch[0]), events


def _cbor_head(major: int, n: int) -> bytes:
    # RFC 8949 shortest form, as fxamacker/cbor's CanonicalEncOptions writes it.
    if n < 24:
        return bytes([major << 5 | n])
    for code, fmt in ((24, ">B"), (25, ">H"), (26, ">I"), (27, ">Q")):
        if n < 1 << (8 * struct.calcsize(fmt)):
            return bytes([major << 5 | code]) + struct.pack(fmt, n)
    raise ValueError("too large for CBOR's head")


def _cbor(value: Any) -> bytes:
    if value is None:
        return b"\xf6"  # a nil slice or interface: null
    if isinstance(value, int):
        return _cbor_head(0, value)
    if isinstance(value, str):
        raw = value.encode("utf-8")
        return _cbor_head(3, len(raw)) + raw
    if isinstance(value, list):
        return _cbor_head(4, len(value)) + b"".join(_cbor(v) for v in value)
    raise TypeError(f"not re-implemented: {type(value).__name__}")


def fnv64a(data: bytes) -> int:
    h = _FNV64_OFFSET
    for byte in data:
        h = ((h ^ byte) * _FNV64_PRIME) & _U64
    return h


@dataclass
class TokenProcessor:
    """kvblock/token_processor.go: chunkedTokenDatabase."""

    block_size: int = DEFAULT_BLOCK_SIZE
    hash_seed: str = ""

    def _hash(self, parent: int, tokens: list[int] | None, extra: Any) -> int:
        # hash(): FNV-64a of the canonical CBOR of [parent, tokens, extra].
        return fnv64a(_cbor([parent, tokens, extra]))

    def init_hash(self, model: str) -> int:
        # getInitHash: hash(FNV-64a(seed), nil, model).
        return self._hash(fnv64a(self.hash_seed.encode()), None, model)

    def tokens_to_keys(self, parent_key: int, tokens: list[int], model: str) -> list[int]:
        """TokensToKVBlockKeys with no extra features: full blocks only, chained."""
        prefix = parent_key if parent_key != 0 else self.init_hash(model)
        keys = []
        for start in range(0, len(tokens) - self.block_size + 1, self.block_size):
            prefix = self._hash(prefix, tokens[start : start + self.block_size], None)
            keys.append(prefix)
        return keys


@dataclass
class Index:
    """kvblock/in_memory.go: InMemoryIndex, unbounded: request key -> pods, and the engine
    key -> request keys mapping."""

    data: dict[int, set[tuple[str, str]]] = field(default_factory=dict)
    engine_to_request: dict[int, list[int]] = field(default_factory=dict)

    def add(self, engine_keys: list[int], request_keys: list[int], entry: tuple[str, str]) -> None:
        # Add: spread the longer list over the shorter by index ratio.
        n = max(len(engine_keys), len(request_keys))
        for i in range(n):
            ek = engine_keys[i * len(engine_keys) // n]
            rk = request_keys[i * len(request_keys) // n]
            self.engine_to_request.setdefault(ek, []).append(rk)
        for rk in request_keys:
            self.data.setdefault(rk, set()).add(entry)

    def request_key(self, engine_key: int) -> int:
        # GetRequestKey: the last request key mapped from the engine key.
        rks = self.engine_to_request.get(engine_key)
        if not rks:
            raise LlmdError(f"engine key not found: {engine_key}")
        return rks[-1]

    def evict(self, engine_key: int, entry: tuple[str, str]) -> None:
        # Evict(EngineKey): drop the pod entry from every mapped request key.
        rks = self.engine_to_request.get(engine_key, [])
        for rk in rks:
            self.data.get(rk, set()).discard(entry)
        if all(not self.data.get(rk) for rk in rks):
            self.engine_to_request.pop(engine_key, None)

    def clear(self, pod: str) -> None:
        for entries in self.data.values():
            entries.difference_update({e for e in entries if e[0] == pod})

    def pods(self, request_keys: list[int]) -> list[set[str]]:
        """The pods holding each request key (what a scorer looks up)."""
        return [{pod for pod, _ in self.data.get(rk, set())} for rk in request_keys]


@dataclass
class Pool:
    """pool.go: Pool.processEventBatch for the vLLM adapter."""

    tokens: TokenProcessor = field(default_factory=TokenProcessor)
    index: Index = field(default_factory=Index)
    models: dict[str, str] = field(default_factory=dict)  # pod -> model, as seen on topics
    num_skipped: int = 0

    def feed(self, frames: list[bytes]) -> None:
        topic, _, payload = read_frames(frames)
        pod, model, _, events = parse_message(topic, payload)
        self.models[pod] = model
        for event in events:
            if isinstance(event, StoredEvent):
                self._stored(pod, model, event)
            elif isinstance(event, RemovedEvent):
                tier = event.device_tier.lower() or DEFAULT_DEVICE_TIER
                for ek in event.block_hashes:
                    self.index.evict(ek, (pod, tier))
            else:
                self.index.clear(pod)

    def _stored(self, pod: str, model: str, event: StoredEvent) -> None:
        tier = event.device_tier.lower() or DEFAULT_DEVICE_TIER
        effective_model = event.lora_name or model
        parent = 0
        if event.parent_hash != 0:
            try:
                parent = self.index.request_key(event.parent_hash)
            except LlmdError:
                self.num_skipped += 1  # the event is skipped ("continue")
                return
        keys = self.tokens.tokens_to_keys(parent, event.tokens, effective_model)
        if not keys:
            # handleDeviceTierUpdate: only engine keys already mapped can gain a tier.
            self.num_skipped += 1
            return
        self.index.add(event.block_hashes, keys, (pod, tier))
