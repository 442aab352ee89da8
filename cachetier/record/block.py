"""``KVBlock``, the value every tier stores and returns, and the buffers it holds."""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass, field
from typing import Any

from cachetier.primitives.keys import DTYPE_BYTES, HASH_BYTES, BlockHash

MAX_NDIM = 8  # dimensions a block (and a record's shape field) may have


Buffer = bytes | bytearray | memoryview


@dataclass(frozen=True, slots=True)
class KVBlock:
    """One full block of KV as the tiers see it: raw bytes plus what they claim to be.

    Args:
        key: the block's key (``cachetier.primitives.keys``).
        fingerprint: the namespace fingerprint the key was computed under.
        dtype: element type name of ``data``.
        shape: shape of ``data`` in elements; its product times the dtype size is its length.
        num_tokens: tokens the block covers (the layout's block size for a full block).
        data: the raw payload. May be a read-only buffer shared with a tier: copy it before
            writing to it.
        aux: small side data that travels with the payload (e.g. fp8 scales), ``b""`` if none.
        verified: set by the record readers only: ``(data, aux, checksum)`` of the
            uncompressed record this block was read from and checked against, so encoding it
            again (a server answering a get) need not hash the payload again. It counts only
            while ``data`` and ``aux`` are still those very objects.
        format_version: the record format version it was read from (``cachetier.record``), 0
            for a block made in memory; the restore guard names it when a record is wrong, as
            the first thing to suspect after an upgrade.
        writer: the id of the process that wrote its record (``cachetier.record.writer``);
            ``None`` for a block made in this process, whose record names this process.
    """

    key: BlockHash
    fingerprint: bytes
    dtype: str
    shape: tuple[int, ...]
    num_tokens: int
    data: Buffer
    aux: Buffer = b""
    verified: tuple[Buffer, Buffer, bytes] | None = field(default=None, compare=False, repr=False)
    format_version: int = field(default=0, compare=False, repr=False)
    writer: bytes | None = field(default=None, compare=False, repr=False)

    # Payload plus side data, counted once here: a connector's small gets read it per block.
    _nbytes: int = field(default=0, init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        if len(self.key) != HASH_BYTES or len(self.fingerprint) != HASH_BYTES:
            raise ValueError(f"key and fingerprint must be {HASH_BYTES} bytes each")
        itemsize = DTYPE_BYTES.get(self.dtype)
        if itemsize is None:
            raise ValueError(f"dtype {self.dtype!r} is not one of {sorted(DTYPE_BYTES)}")
        shape = self.shape
        if not 0 < len(shape) <= MAX_NDIM or min(shape) < 0:
            raise ValueError(f"shape {shape} must have 1..{MAX_NDIM} non-negative dims")
        size = memoryview(self.data).nbytes
        if size != math.prod(shape) * itemsize:
            raise ValueError(
                f"data has {size} bytes, shape {shape} of {self.dtype} needs "
                f"{math.prod(shape) * itemsize}"
            )
        if self.num_tokens <= 0:
            raise ValueError(f"num_tokens must be positive, got {self.num_tokens}")
        object.__setattr__(self, "_nbytes", size + len(self.aux))

    @property
    def nbytes(self) -> int:
        """Bytes of payload and side data (what capacities count for in-memory tiers)."""
        return self._nbytes

    def landed_in(self, data: memoryview) -> KVBlock:
        """This block with its payload in ``data``, which holds the same bytes (a copy landed
        there): its checks are not run again, only the length is compared.

        Raises:
            ValueError: ``data`` is not the payload's length.
        """
        if data.nbytes != self._nbytes - len(self.aux):
            raise ValueError(f"{data.nbytes} bytes for a payload of {self._nbytes - len(self.aux)}")
        block = object.__new__(KVBlock)
        # Every slot but these two is copied, so a field added later is not left unset.
        for slot, value in zip(_KEPT_SLOTS, _get_kept(self)):
            slot.__set__(block, value)
        _DATA_SLOT.__set__(block, data)
        _VERIFIED_SLOT.__set__(block, None)  # a checksum is kept only for its own data
        return block


# ``landed_in``'s copy of a block: the slot descriptors of every field but the two it replaces,
# read in one call (half the cost of a getattr/setattr pair per field, measured per block).
_REPLACED_SLOTS = ("data", "verified")
_KEPT_SLOTS = tuple(
    getattr(KVBlock, name) for name in KVBlock.__slots__ if name not in _REPLACED_SLOTS
)
_get_kept = operator.attrgetter(*(n for n in KVBlock.__slots__ if n not in _REPLACED_SLOTS))
_DATA_SLOT, _VERIFIED_SLOT = (getattr(KVBlock, name) for name in _REPLACED_SLOTS)
_SET_SLOTS = tuple(getattr(KVBlock, name).__set__ for name in KVBlock.__slots__)


def checked_block(*values: Any) -> KVBlock:
    """A ``KVBlock`` made without ``__post_init__``, for the record decoder (``codec._build``),
    which has checked all that it checks on the record's head. A frozen dataclass sets each
    field through ``object.__setattr__``, and the checks ran a second time, on every block a
    tier reads.

    Args:
        values: every slot, in ``KVBlock.__slots__`` order (``_nbytes`` last: payload plus
            aux bytes, after ``writer``).

    Returns:
        The block.
    """
    block = object.__new__(KVBlock)
    for set_slot, value in zip(_SET_SLOTS, values, strict=True):
        set_slot(block, value)
    return block


def byte_view(buffer: Buffer) -> memoryview:
    """``buffer`` as flat bytes; a view that already is one is returned itself, so a caller can
    tell by identity that its buffer was filled."""
    if type(buffer) is bytes:  # the common case, first: a connector's small get lands many
        return memoryview(buffer)
    view = memoryview(buffer) if not isinstance(buffer, memoryview) else buffer
    if view.format == "B" and view.ndim == 1:
        return view
    return view.cast("B")
