"""``TokenIndex``: which namespaces recently stored the same tokens, to tell a namespace mismatch.

A block key is chained from the namespace fingerprint, so an engine with another model, dtype,
block size, format or tenant misses every block another stored for the same prompt, and the
miss looks like ``never_stored``. The index keeps a second key of each stored block, chained
over its tokens only (``token_keys``), with the descriptor of the namespace that stored it;
a lookup that misses asks ``holder`` whether the same tokens are held under another namespace,
and ``NamespaceDescriptor.differs_from`` names the parts that differ.

Memory: the set-associative ``KeyTable`` of 8-byte fingerprints and 2-byte descriptor ids,
one byte a set of four: ``10 * n + n / 4`` bytes for ``n`` tracked keys, 10.25 MB at 1M (plus
the descriptors themselves, a few hundred bytes each, at most ``max_descriptors``). One token
key held under two namespaces takes two entries. A full set replaces its oldest entry; a key
is taken for another only when two keys of one set share all 64 fingerprint bits.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence

import numpy as np

from cachetier.misses.descriptor import NamespaceDescriptor
from cachetier.misses.table import SMALL_BATCH, WAYS, KeyTable
from cachetier.primitives.keys import HASH_BYTES, BlockHash, chain_keys
from cachetier.util.checks import positive_int

TOKEN_KEY_ROOT = b"cachetier/token-only-keys/v1".ljust(HASH_BYTES, b"\0")
"""What token-only keys are chained from, in place of a namespace fingerprint: a fixed domain
constant (no namespace digest can equal it), so they never equal a block key."""
MAX_DESCRIPTORS = 0xFFFF


def token_keys(
    token_ids: Sequence[int] | np.ndarray,
    record_tokens: int,
    *,
    extra_keys: Sequence[bytes] | None = None,
) -> list[BlockHash]:
    """Token-only keys of every full record of ``token_ids``: ``keys.chain_keys`` from
    ``TOKEN_KEY_ROOT`` instead of a namespace fingerprint, so the same tokens get the same keys
    under every model, layout and tenant.

    Args:
        token_ids: the token ids from the start of the sequence.
        record_tokens: tokens a record holds.
        extra_keys: per-record extra bytes (LoRA id, multimodal hash), as the block keys had.

    Returns:
        ``len(token_ids) // record_tokens`` keys, in order.
    """
    return chain_keys(TOKEN_KEY_ROOT, record_tokens, token_ids, extra_keys=extra_keys)


class TokenIndex:
    """Token-only keys recently stored, each with the descriptor that stored it; thread-safe.

    Args:
        tracked_keys: how many (token key, descriptor) entries it holds at most (rounded up
            to whole sets of four).
        max_descriptors: how many distinct descriptors it tells apart; keys of a descriptor
            past that many are not noted.
    """

    def __init__(self, tracked_keys: int, *, max_descriptors: int = 1024) -> None:
        positive_int("max_descriptors", max_descriptors)
        if max_descriptors > MAX_DESCRIPTORS:
            raise ValueError(f"max_descriptors must be <= {MAX_DESCRIPTORS}, got {max_descriptors}")
        self._table = KeyTable(tracked_keys)
        self._max_descriptors = max_descriptors
        self._descriptors: list[NamespaceDescriptor] = []  # id - 1 -> descriptor
        self._ids: dict[NamespaceDescriptor, int] = {}
        self._asking: NamespaceDescriptor | None = None  # the last asker, and its id
        self._asking_id = 0
        self._lock = threading.Lock()

    @property
    def tracked_keys(self) -> int:
        """How many entries it can hold."""
        return self._table.num_slots

    @property
    def nbytes(self) -> int:
        """Bytes of its arrays (the formula of the module docstring)."""
        return self._table.nbytes

    @property
    def descriptors(self) -> tuple[NamespaceDescriptor, ...]:
        """The descriptors it has seen, first seen first."""
        with self._lock:
            return tuple(self._descriptors)

    def __len__(self) -> int:
        """Entries held now (a scan: for tests and stats, not the serving path)."""
        with self._lock:
            return self._table.num_entries()

    def note(self, keys: Iterable[BlockHash], descriptor: NamespaceDescriptor) -> int:
        """Remember that ``descriptor``'s namespace stored the records of ``keys``.

        Args:
            keys: token-only keys (``token_keys``) of the records stored.
            descriptor: the namespace that stored them.

        Returns:
            How many keys were noted: all, or 0 when ``max_descriptors`` others are known.
        """
        if not isinstance(descriptor, NamespaceDescriptor):
            raise TypeError(
                f"descriptor must be a NamespaceDescriptor, got {type(descriptor).__name__}"
            )
        keys = keys if isinstance(keys, (list, tuple)) else list(keys)
        with self._lock:
            tag = self._register(descriptor)
            if not tag:
                return 0
            if len(keys) <= SMALL_BATCH:
                for row, fp in [self._table.place(key) for key in keys]:  # all checked first
                    self._table.put(row, fp, tag, match_tag=True)
                return len(keys)
            rows, fps = self._table.place_many(keys)
            tags = np.full(len(keys), tag, dtype=np.uint16)
            self._table.put_many(rows, fps, tags, match_tag=True)
            return len(keys)

    def holder(self, key: BlockHash, asking: NamespaceDescriptor) -> NamespaceDescriptor | None:
        """A namespace other than ``asking`` that stored the record of token-only ``key``.

        Args:
            key: a token-only key that missed under ``asking``.
            asking: the descriptor of the namespace that looked it up.

        Returns:
            The other namespace's descriptor, or ``None`` when none is remembered.
        """
        with self._lock:
            slot = self._table.find(key, self._id_of(asking))
            return None if slot < 0 else self._descriptors[self._table.tag(slot) - 1]

    def holders(
        self, keys: Sequence[BlockHash], asking: NamespaceDescriptor
    ) -> list[NamespaceDescriptor | None]:
        """``holder`` for each of ``keys``, in one pass under the lock."""
        with self._lock:
            mine = self._id_of(asking)
            by_id = (None, *self._descriptors)  # a tag is a descriptor's id, 0 is none
            if len(keys) <= SMALL_BATCH:
                slots = [self._table.find(key, mine) for key in keys]  # all checked first
                return [by_id[self._table.tag(s)] if s >= 0 else None for s in slots]
            found = self._table.find_many(*self._table.place_many(keys), mine)
            tags = np.where(found >= 0, self._table.tags[found], 0)  # -1 read a slot: masked
            return [by_id[t] for t in tags.tolist()]

    def entries(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, list[NamespaceDescriptor]]:
        """Its live entries, to keep them across a restart (``cachetier.misses.token_file``).

        Returns:
            Each entry's set (uint64) and fingerprint (uint64), its descriptor's index into
            the returned descriptors (uint16), and those descriptors.
        """
        with self._lock:
            slots = np.flatnonzero(self._table.tags)
            rows = (slots // WAYS).astype(np.uint64)
            ids = self._table.tags[slots].astype(np.uint16) - np.uint16(1)
            return rows, self._table.fps[slots].copy(), ids, list(self._descriptors)

    def merge(
        self,
        rows: np.ndarray,
        fps: np.ndarray,
        ids: np.ndarray,
        descriptors: Sequence[NamespaceDescriptor],
    ) -> int:
        """Add entries another index of the same size gave (``entries``); its descriptors
        are registered here (those past ``max_descriptors`` are dropped with their entries).

        Returns:
            How many entries were added.
        """
        if not len(rows) == len(fps) == len(ids):
            raise ValueError("rows, fps and ids must have one entry each")
        if len(rows) and (
            int(rows.max()) >= self._table.num_sets or int(ids.max()) >= len(descriptors)
        ):
            raise ValueError("entries of another table size or descriptor list")
        with self._lock:
            tags = np.zeros(len(descriptors) + 1, dtype=np.uint16)
            for i, descriptor in enumerate(descriptors):
                tags[i] = self._register(descriptor)
            mapped = tags[ids.astype(np.int64)]
            keep = mapped != 0
            self._table.put_many(
                rows[keep].astype(np.uint64), fps[keep].astype(np.uint64), mapped[keep], True
            )
            return int(np.count_nonzero(keep))

    def _register(self, descriptor: NamespaceDescriptor) -> int:
        # Called under the lock: the descriptor's id, 0 when max_descriptors are known.
        tag = self._ids.get(descriptor)
        if tag is None:
            if len(self._descriptors) >= self._max_descriptors:
                return 0
            self._descriptors.append(descriptor)
            tag = self._ids[descriptor] = len(self._descriptors)
            self._asking = None
        return tag

    def _id_of(self, asking: NamespaceDescriptor) -> int:
        # Called under the lock. 0: it stored nothing, so every holder is another. The last
        # asker is kept by identity (hashing a descriptor costs more than the search); a new
        # descriptor's registration clears it.
        if not isinstance(asking, NamespaceDescriptor):
            raise TypeError(f"asking must be a NamespaceDescriptor, got {type(asking).__name__}")
        if asking is self._asking:
            return self._asking_id
        self._asking, self._asking_id = asking, self._ids.get(asking, 0)
        return self._asking_id
