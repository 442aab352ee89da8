"""Block keys: the one chained, cryptographic, process-independent block hash of cachetier.

Every other part of the project (engine, connectors, server, reports) calls this module;
a second hashing routine anywhere else is a bug.

    key(0) = sha256(namespace.fingerprint || tokens(0) || extra(0))
    key(i) = sha256(key(i-1)          || tokens(i) || extra(i))

Token ids are encoded as little-endian uint32, so the same tokens give the same key in every
process and on every machine (no ``hash()``, no ``PYTHONHASHSEED``). Only *full* blocks get a
key: a partial last block is always recomputed by the engine.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
from collections.abc import Callable, Container, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NewType

import numpy as np

from cachetier.primitives.kv_format import CANONICAL_ARRANGEMENT, canonical_shape, planes
from cachetier.util.checks import positive_int

if TYPE_CHECKING:
    import torch

BlockHash = NewType("BlockHash", bytes)
"""A 32-byte sha256 digest naming one full block of tokens under one namespace."""

HASH_BYTES = 32
# bytes.fromhex alone is not enough: it skips whitespace, so 64 characters with spaces in them
# would parse to a shorter key.
_HEX_KEY = re.compile(rf"[0-9a-fA-F]{{{2 * HASH_BYTES}}}")
_NAMESPACE_DOMAIN = b"cachetier/namespace/v1\0"
_FOREIGN_DOMAIN = b"cachetier/foreign-key/v1\0"

# Element sizes of the KV dtypes a layout may name (bytes). Each name is torch's own
# (``torch.<name>``), so ``torch_dtype`` and ``dtype_name`` need no second table.
DTYPE_BYTES: dict[str, int] = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "uint8": 1,
    "int8": 1,
}


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype a layout's dtype name stands for (``"bfloat16"`` -> ``torch.bfloat16``).

    torch is imported here, not with the module: the core and the sidecar run without it.

    Args:
        name: one of ``DTYPE_BYTES``.

    Returns:
        ``torch.<name>``.
    """
    if name not in DTYPE_BYTES:
        raise ValueError(f"dtype {name!r} is not one of {sorted(DTYPE_BYTES)}")
    import torch

    return getattr(torch, name)


def dtype_name(dtype: torch.dtype) -> str:
    """cachetier's name of a torch dtype (``torch.float32`` -> ``"float32"``).

    Args:
        dtype: a torch dtype.

    Returns:
        Its name in ``DTYPE_BYTES``.

    Raises:
        ValueError: cachetier stores no blocks of that dtype.
    """
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPE_BYTES:
        raise ValueError(f"dtype {dtype} is not one of {sorted(DTYPE_BYTES)}")
    return name


@dataclass(frozen=True, slots=True)
class KVLayout:
    """How one block of KV is laid out in memory; blocks of different layouts never share keys.

    Args:
        dtype: element type name, one of ``DTYPE_BYTES``.
        block_size: tokens per block.
        num_layers: attention layers whose KV a block holds.
        num_kv_heads: KV heads per layer.
        head_dim: elements per head.
        arrangement: the order of dimensions inside a block: one of the canonical names of
            ``cachetier.primitives.kv_format`` (K/V or MLA); every engine converts to it.
    """

    dtype: str
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    arrangement: str = CANONICAL_ARRANGEMENT

    def describe(self) -> str:
        """The layout in one line for a log."""
        return (
            f"{self.dtype} blocks of {self.block_size} tokens, {self.num_layers} layers x "
            f"{self.num_kv_heads} KV heads x {self.head_dim}, arrangement {self.arrangement}"
        )

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(f"dtype {self.dtype!r} is not one of {sorted(DTYPE_BYTES)}")
        for name in ("block_size", "num_layers", "num_kv_heads", "head_dim"):
            positive_int(name, getattr(self, name))
        canonical_shape(self.arrangement, 1, 1, 1, 1)  # raises for a name that is not canonical

    @property
    def payload_shape(self) -> tuple[int, int, int, int, int]:
        """Shape of one canonical payload (``cachetier.primitives.kv_format``)."""
        return canonical_shape(
            self.arrangement, self.num_layers, self.block_size, self.num_kv_heads, self.head_dim
        )

    @property
    def block_bytes(self) -> int:
        """Bytes of K and V (or the MLA latent) for one full block, all layers."""
        return (
            planes(self.arrangement)
            * self.num_layers
            * self.block_size
            * self.num_kv_heads
            * self.head_dim
            * DTYPE_BYTES[self.dtype]
        )


def records_per_block(block_size: int, record_tokens: int) -> int:
    """How many records of ``record_tokens`` tokens one engine block of ``block_size`` holds.

    Args:
        block_size: the engine's tokens per block (or per page).
        record_tokens: the deployment's tokens per record (``kv_format.DEFAULT_RECORD_TOKENS``).

    Returns:
        ``block_size // record_tokens``.

    Raises:
        ValueError: ``block_size`` is not a positive multiple of ``record_tokens``: such an
            engine cannot share the deployment's records, and says so at start rather than
            missing every lookup.
    """
    positive_int("block_size", block_size)
    positive_int("record_tokens", record_tokens)
    if block_size % record_tokens:
        raise ValueError(
            f"the engine's block size {block_size} is not a multiple of record_tokens "
            f"{record_tokens}: set record_tokens to a divisor of it (the same value in every "
            "engine that shares the cache)"
        )
    return block_size // record_tokens


def record_layout(layout: KVLayout, record_tokens: int) -> KVLayout:
    """The layout of one record cut from blocks of ``layout``: the same KV, ``record_tokens``
    tokens. Namespaces are built on it, so keys do not depend on an engine's block size.

    Args:
        layout: the engine's block layout.
        record_tokens: the deployment's tokens per record.

    Returns:
        ``layout`` with ``block_size`` set to ``record_tokens``.

    Raises:
        ValueError: ``layout.block_size`` is not a multiple of ``record_tokens``.
    """
    records_per_block(layout.block_size, record_tokens)
    return dataclasses.replace(layout, block_size=record_tokens)


@dataclass(frozen=True, slots=True)
class Namespace:
    """What must agree for two blocks of the same tokens to be interchangeable.

    Args:
        model_fingerprint: identity of the weights and config (e.g. a sha256 hex digest).
        layout: the KV layout of a block.
        tenant: tenant name or cache salt; different values never share blocks.
        layers: which of the model's layers a record holds, where it holds some only (vLLM's
            hybrid KV cache groups: ``"0,2"``); ``""`` for every layer, the keys of which are
            unchanged by this field.
    """

    model_fingerprint: str
    layout: KVLayout
    tenant: str = ""
    layers: str = ""
    fingerprint: bytes = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not self.model_fingerprint:
            raise ValueError("model_fingerprint must be a non-empty string")
        if not isinstance(self.layout, KVLayout):
            raise TypeError(f"layout must be a KVLayout, got {type(self.layout).__name__}")
        named: dict[str, object] = {"layers": self.layers} if self.layers else {}
        canonical = json.dumps(
            {
                **named,
                "model": self.model_fingerprint,
                "layout": [
                    self.layout.dtype,
                    self.layout.block_size,
                    self.layout.num_layers,
                    self.layout.num_kv_heads,
                    self.layout.head_dim,
                    self.layout.arrangement,
                ],
                "tenant": self.tenant,
            },
            sort_keys=True,
            separators=(",", ":"),
        ).encode()
        digest = hashlib.sha256(_NAMESPACE_DOMAIN + canonical).digest()
        object.__setattr__(self, "fingerprint", digest)

    @property
    def id(self) -> str:
        """Hex form of ``fingerprint``: the storage scope tiers file this namespace under."""
        return self.fingerprint.hex()

    @property
    def block_size(self) -> int:
        return self.layout.block_size

    def describe(self) -> str:
        """What the namespace's writers claim to be, in one line for a log: the parts of the
        fingerprint a reader of another model, engine version or layout differs in."""
        layers = f", layers {self.layers}" if self.layers else ""
        return (
            f"model {self.model_fingerprint[:16]}, {self.layout.describe()}, "
            f"tenant {self.tenant!r}{layers}"
        )


def token_bytes(token_ids: Sequence[int] | np.ndarray) -> bytes:
    """Encode token ids as little-endian uint32 bytes, the form every key is computed over.

    Args:
        token_ids: a 1-D sequence of ints in ``[0, 2**32)`` (list, numpy array or torch tensor).

    Returns:
        ``4 * len(token_ids)`` bytes.
    """
    try:
        arr = np.asarray(token_ids)
    except (TypeError, ValueError) as exc:
        raise TypeError(f"token_ids must be a sequence of ints: {exc}") from None
    if arr.ndim != 1:
        raise ValueError(f"token_ids must be 1-D, got shape {arr.shape}")
    if arr.size == 0:
        return b""
    if arr.dtype.kind not in "iu":
        raise TypeError(f"token_ids must be integers, got dtype {arr.dtype}")
    if arr.dtype.kind == "i" and int(arr.min()) < 0:
        raise ValueError("token_ids must be >= 0")
    if int(arr.max()) >= 2**32:
        raise ValueError("token_ids must be < 2**32")
    return arr.astype("<u4", copy=False).tobytes()


def hash_block(parent: bytes, block_token_ids: Sequence[int], extra: bytes = b"") -> BlockHash:
    """Key of one full block given its parent's key (or the namespace fingerprint for block 0).

    Args:
        parent: the previous block's key, or ``Namespace.fingerprint`` for the first block.
        block_token_ids: exactly one block of token ids.
        extra: extra key bytes for this block (LoRA id, multimodal hash), ``b""`` if none.

    Returns:
        The block's 32-byte key.
    """
    if len(parent) != HASH_BYTES:
        raise ValueError(f"parent must be {HASH_BYTES} bytes, got {len(parent)}")
    return BlockHash(hashlib.sha256(parent + token_bytes(block_token_ids) + extra).digest())


def block_keys(
    namespace: Namespace,
    token_ids: Sequence[int] | np.ndarray,
    *,
    extra_keys: Sequence[bytes] | None = None,
    parent: bytes | None = None,
) -> list[BlockHash]:
    """Keys of every *full* block of ``token_ids``; a partial last block gets none.

    Args:
        namespace: model, layout and tenant the blocks belong to.
        token_ids: the token ids from the start of the sequence (or from the block after
            ``parent``).
        extra_keys: optional per-block extra bytes, one entry per full block.
        parent: key of the block just before ``token_ids[0]``, to continue a chain;
            ``None`` starts at the namespace root.

    Returns:
        ``len(token_ids) // block_size`` keys, in order.
    """
    prev = namespace.fingerprint if parent is None else parent
    return chain_keys(prev, namespace.layout.block_size, token_ids, extra_keys=extra_keys)


def chain_keys(
    root: bytes,
    block_size: int,
    token_ids: Sequence[int] | np.ndarray,
    *,
    extra_keys: Sequence[bytes] | None = None,
) -> list[BlockHash]:
    """Keys of every *full* block of ``token_ids``, chained from ``root``: the one loop
    ``block_keys`` runs, for callers that know a namespace by its fingerprint alone (the
    sidecar pins a prefix of a ``Namespace.id`` it was never told the model of).

    Args:
        root: ``Namespace.fingerprint``, or the key of the block just before ``token_ids[0]``.
        block_size: tokens per block.
        token_ids: the token ids.
        extra_keys: optional per-block extra bytes, one entry per full block.

    Returns:
        ``len(token_ids) // block_size`` keys, in order.
    """
    positive_int("block_size", block_size)
    data = token_bytes(token_ids)
    step = block_size * 4
    num_blocks = len(data) // step
    if extra_keys is not None and len(extra_keys) < num_blocks:
        raise ValueError(f"extra_keys has {len(extra_keys)} entries for {num_blocks} blocks")
    prev = root
    if len(prev) != HASH_BYTES:
        raise ValueError(f"parent must be {HASH_BYTES} bytes, got {len(prev)}")
    sha256 = hashlib.sha256
    keys: list[BlockHash] = []
    append = keys.append
    # Hot loop: one concatenation and one digest per block, no per-block function call.
    if extra_keys is None:
        for start in range(0, num_blocks * step, step):
            prev = sha256(prev + data[start : start + step]).digest()
            append(BlockHash(prev))
    else:
        for i, start in enumerate(range(0, num_blocks * step, step)):
            prev = sha256(prev + data[start : start + step] + extra_keys[i]).digest()
            append(BlockHash(prev))
    return keys


def foreign_key(namespace: Namespace, engine: str, key: str | bytes) -> BlockHash:
    """Key of a block that an engine names by a hash of its own (SGLang's page hash, LMCache's
    chunk hash), filed under ``namespace``.

    The engine's hash already chains the tokens before the block; hashing it again with the
    namespace fingerprint keeps two models, layouts or tenants apart even when the engine
    names their blocks alike (SGLang's page hash does not include the model).

    Args:
        namespace: model, layout and tenant of the block.
        engine: the engine's name (``"sglang"``, ``"lmcache"``): each names blocks its own way.
        key: the engine's name for the block.

    Returns:
        The block's 32-byte key.
    """
    if not engine or "\0" in engine:
        raise ValueError(f"engine must be a non-empty name without NUL, got {engine!r}")
    raw = key.encode() if isinstance(key, str) else bytes(key)
    if not raw:
        raise ValueError("an engine's block key must not be empty")
    head = _FOREIGN_DOMAIN + engine.encode() + b"\0" + namespace.fingerprint
    return BlockHash(hashlib.sha256(head + raw).digest())


def num_leading_hits(
    keys: Iterable[BlockHash], present: Container[bytes] | Callable[[BlockHash], bool]
) -> int:
    """Length of the run of leading keys that are present (a prefix cache can only use those).

    Args:
        keys: block keys in sequence order.
        present: a container of stored keys, or a predicate on one key.

    Returns:
        How many keys from the first are present before the first absent one.
    """
    test = present if callable(present) else present.__contains__
    hits = 0
    for key in keys:
        if not test(key):
            break
        hits += 1
    return hits


def parse_key(text: str) -> BlockHash:
    """Parse the fixed-length hex form of a key (as used on disk, in Redis and over HTTP).

    Args:
        text: the key's hex form.

    Returns:
        The 32-byte key.

    Raises:
        ValueError: if ``text`` is not exactly 64 lower- or upper-case hex digits.
    """
    if len(text) != 2 * HASH_BYTES:
        raise ValueError(f"a key is {2 * HASH_BYTES} hex digits, got {len(text)} characters")
    if not _HEX_KEY.fullmatch(text):
        raise ValueError(f"key {text[:16]!r}... is not {2 * HASH_BYTES} hex digits")
    return BlockHash(bytes.fromhex(text))
