"""``HeldKeys``: what a publisher has said it holds, per medium, so that a consumer can check
its index against it.

Events can be lost between a publisher and an index: dropped from a full queue, sent before
the index subscribed, past the replay buffer. The publisher therefore keeps the set its events
describe and answers two questions about it (``/v1/fleet/state`` and ``/v1/fleet/blocks`` on
our engine server): the digest of each medium (``cachetier.kvindex.key_digest``: a count and
an XOR of key heads, cheap to compare on every poll), and, where the digests differ, the keys
themselves, which the index takes in place of its own (``PrefixIndex.resync``).

The set is kept as events are made, not as they are sent, so a dropped event shows up as a
digest mismatch rather than being forgotten by both sides.

Thread-safe: the engine's step thread and the store's writer threads add and remove while an
HTTP handler reads.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable

DigestPair = tuple[int, int]
"""``(count, XOR of each key's first 8 bytes, little-endian)``."""


def key_digest(keys: Iterable[bytes]) -> DigestPair:
    """``(count, XOR of each key's first 8 bytes)`` of a set of keys: equal digests mean two
    sides hold the same set (but for a 2^-64 chance)."""
    count = acc = 0
    for key in keys:
        count += 1
        acc ^= int.from_bytes(key[:8], "little")
    return count, acc


class HeldKeys:
    """Keys per medium, with their digests kept up to date as keys come and go."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._keys: dict[str, set[bytes]] = {}
        self._xor: dict[str, int] = {}

    def add(self, medium: str, keys: Iterable[bytes]) -> None:
        """``keys`` are now held in ``medium`` (those held already are not counted twice)."""
        with self._lock:
            held = self._keys.setdefault(medium, set())
            acc = self._xor.get(medium, 0)
            for key in keys:
                if key not in held:
                    held.add(key)
                    acc ^= int.from_bytes(key[:8], "little")
            self._xor[medium] = acc

    def remove(self, medium: str, keys: Iterable[bytes]) -> None:
        """``keys`` left ``medium`` (those not held are ignored)."""
        with self._lock:
            held = self._keys.get(medium)
            if held is None:
                return
            acc = self._xor[medium]
            for key in keys:
                if key in held:
                    held.discard(key)
                    acc ^= int.from_bytes(key[:8], "little")
            self._xor[medium] = acc

    def clear(self, medium: str) -> None:
        """``medium`` holds nothing now."""
        with self._lock:
            self._keys.pop(medium, None)
            self._xor.pop(medium, None)

    def digests(self) -> dict[str, DigestPair]:
        """Every medium's digest (media emptied since are reported as ``(0, 0)``)."""
        with self._lock:
            return {m: (len(keys), self._xor[m]) for m, keys in self._keys.items()}

    def keys(self, medium: str, limit: int | None = None) -> list[bytes]:
        """What ``medium`` holds, at most ``limit`` keys (in no particular order)."""
        with self._lock:
            held = self._keys.get(medium, set())
            if limit is None or limit >= len(held):
                return list(held)
            out: list[bytes] = []
            for key in held:
                if len(out) == limit:
                    break
                out.append(key)
            return out

    def media(self) -> list[str]:
        with self._lock:
            return sorted(self._keys)
