"""What the remote tier checks of a call's arguments before anything goes on the wire: a bad
namespace, key or block is the caller's error, raised here, never a request the server refuses."""

from __future__ import annotations

from collections.abc import Sequence

from cachetier.primitives.keys import HASH_BYTES, BlockHash
from cachetier.record import KVBlock
from cachetier.tiers.base import check_namespace


def check_keys(namespace: str, keys: Sequence[BlockHash]) -> None:
    """Raise ``ValueError`` for a bad namespace or a key of another length."""
    check_namespace(namespace)
    for key in keys:
        if not isinstance(key, (bytes, bytearray)) or len(key) != HASH_BYTES:
            raise ValueError(f"a key is {HASH_BYTES} bytes, got {key!r:.80}")


def check_blocks(namespace: str, blocks: Sequence[KVBlock]) -> None:
    """Raise for a bad namespace (``ValueError``) or anything but a ``KVBlock`` (``TypeError``)."""
    check_namespace(namespace)
    for block in blocks:
        if not isinstance(block, KVBlock):
            raise TypeError(f"blocks must be KVBlock, got {type(block).__name__}")
