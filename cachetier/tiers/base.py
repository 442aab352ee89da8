"""The interface every tier implements, and what the implementations share."""

from __future__ import annotations

import logging
import re
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import Any

from cachetier.errors import PinsUnsupportedError
from cachetier.pins.pinset import NO_PINS
from cachetier.primitives.keys import BlockHash
from cachetier.record import KVBlock, byte_view
from cachetier.tiers.stats import TierStats
from cachetier.util.backoff import Clock
from cachetier.util.landing import Destination, copy_pairs, flat
from cachetier.util.parallel import copy_into
from cachetier.util.throttle import LogThrottle

logger = logging.getLogger("cachetier.tiers")

CORRUPT_LOG_INTERVAL_S = 60.0
"""Least time between two warnings of corrupt records from one tier: a disk going bad, or a
tampered folder, can turn every read into one, and a line per record would bury the log."""

MAX_NAMESPACE_CHARS = 128
# One limit for every namespace, a sidecar client's included: every namespace a tier has stored
# was checked against 128 (the sidecar's "t.<tenant>.<namespace>" too), and a disk tier checks
# its folder names again when it opens, so a lower limit would strand blocks already on disk.
_NAMESPACE_RE = re.compile(rf"[A-Za-z0-9][A-Za-z0-9._-]{{0,{MAX_NAMESPACE_CHARS - 1}}}")

# Namespaces that passed the check with no prefix: a connector asks for a few blocks per call,
# and the regex was a sixth of a one-block CPU get. Bounded: cleared when it fills.
_CHECKED: set[str] = set()
_MAX_CHECKED = 4096

EvictCallback = Callable[[str, KVBlock], None]
"""Called with (namespace, block) for each block a tier evicts, so a store can spill it down."""

EvictionListener = Callable[[str, BlockHash, float | None], None]
"""Told (namespace, key, stamp) of each block a tier evicts, so a later miss can say why:
``stamp`` is when the block was stored (the CPU tier) or last stored or read (the disk tier, by
its file's mtime), in Unix seconds, ``None`` where the tier does not know."""


def check_namespace(namespace: str, *, prefix: str = "") -> str:
    """Validate a storage namespace (it becomes a folder name and a Redis key prefix).

    Args:
        namespace: 1-128 characters of ``[A-Za-z0-9._-]`` starting with a letter or digit;
            ``Namespace.id`` (64 hex digits) always qualifies.
        prefix: what the caller stores ``namespace`` under (the sidecar's ``t.<tenant>.``);
            the prefix and the namespace together must fit in the 128 characters.

    Returns:
        ``namespace`` unchanged.

    Raises:
        ValueError: if it does not qualify; the message says what to change.
    """
    if not prefix and type(namespace) is str and namespace in _CHECKED:
        return namespace
    # fullmatch, not match with "$": "$" also matches before a final newline, which would let
    # "ns\n" through into folder names and Redis keys.
    if not isinstance(namespace, str) or not _NAMESPACE_RE.fullmatch(namespace):
        raise ValueError(
            f"namespace {str(namespace)[:100]!r} must be 1-{MAX_NAMESPACE_CHARS} characters of "
            "[A-Za-z0-9._-] starting with a letter or digit"
        )
    if len(prefix) + len(namespace) > MAX_NAMESPACE_CHARS:
        raise ValueError(
            f"namespace {namespace[:100]!r} has {len(namespace)} characters; stored under "
            f"{prefix!r}, at most {MAX_NAMESPACE_CHARS - len(prefix)} fit"
        )
    if not prefix and type(namespace) is str:  # not a subclass, whose equality could differ
        if len(_CHECKED) >= _MAX_CHECKED:
            _CHECKED.clear()
        _CHECKED.add(namespace)
    return namespace


class Tier(ABC):
    """A store of KV blocks under (namespace, key), with a byte capacity.

    Every method is batched and thread-safe. A miss is ``None``; a backing service that fails
    is a miss plus a counted error, never an exception (bad arguments still raise).
    """

    name: str = "tier"
    supports_pins: bool = False
    """Whether ``pin`` keeps blocks from this tier's eviction (``TieredStore`` pins only in
    those that do)."""
    over_network: bool = False
    """Whether reads wait on a network (Redis, the sidecar): on a slow link they leave the
    host's cores mostly idle, so an engine can compute while one runs. Reads from memory or
    the page cache are the cores' own work, and run no faster beside a forward on a CPU
    (``benchmarks/overlap.py``)."""

    eviction_listener: EvictionListener | None = None
    """Told of each key this tier evicts (``listen_evictions``); tiers that evict by their own
    accounting (CPU, disk) tell it, a Redis evicting by its own policy cannot."""

    def __init__(self, *, clock: Clock = time.monotonic) -> None:
        self._stats = TierStats()
        self._corrupt_log = LogThrottle(CORRUPT_LOG_INTERVAL_S, clock)

    corrupt_listener: Callable[[BlockHash], None] | None = None
    """Told the key of each record this tier finds corrupt (and drops)."""

    def listen_evictions(self, listener: EvictionListener) -> None:
        """Tell ``listener`` (namespace, key) of each block this tier evicts from now on."""
        self.eviction_listener = listener

    @abstractmethod
    def put_many(self, namespace: str, blocks: Sequence[KVBlock]) -> int:
        """Store blocks; a key the tier already holds keeps its record (counted in
        ``skipped_present``): a record under a key is the same KV whoever computed it, since
        the key chains the tokens under a namespace of model, layout and tenant. A record
        found corrupt was removed, and is written again by the next put.

        Args:
            namespace: storage namespace (see ``check_namespace``).
            blocks: the blocks; each is stored under its own ``key``.

        Returns:
            How many the tier holds now of those given (stored, or held already).
        """

    @abstractmethod
    def get_many(self, namespace: str, keys: Sequence[BlockHash]) -> list[KVBlock | None]:
        """Fetch blocks.

        Args:
            namespace: storage namespace.
            keys: keys to fetch.

        Returns:
            One entry per key: the checked block, or ``None`` on a miss.
        """

    def get_into(
        self, namespace: str, keys: Sequence[BlockHash], dests: Sequence[Destination]
    ) -> list[KVBlock | None]:
        """Fetch blocks with each payload landing in caller memory (e.g. a KV pool block).

        The default copies what ``get_many`` returns; tiers that can read straight into the
        destination (the disk tier) override it to save that copy.

        Args:
            namespace: storage namespace.
            keys: keys to fetch.
            dests: one destination per key, exactly the size of the payload expected: flat
                writable bytes, or ``Runs`` for memory that orders the payload's runs
                otherwise.

        Returns:
            One entry per key: the checked block (its ``data`` is the destination when the copy
            was made there), or ``None`` on a miss. A block whose payload is not the size of its
            destination is returned as it is, for the caller to reject.
        """
        if len(dests) != len(keys):
            raise ValueError(f"{len(dests)} destinations for {len(keys)} keys")
        return land_in(self.get_many(namespace, keys), dests)

    def held_keys(self) -> list[tuple[str, BlockHash]] | None:
        """Every ``(namespace, key)`` the tier holds, where it keeps them in memory (CPU,
        disk): what a KV-event publisher announces at start. ``None`` where listing them
        would scan a server (Redis, the sidecar)."""
        return None

    @abstractmethod
    def contains_prefix(self, namespace: str, keys: Sequence[BlockHash]) -> int:
        """How many leading keys are stored (without reading the blocks).

        Args:
            namespace: storage namespace.
            keys: keys in sequence order.

        Returns:
            Length of the leading run of stored keys.
        """

    def report_quarantine(self, namespace: str, reason: str, writer: str = "") -> None:
        """Hear that ``writer``'s records of ``namespace`` (all of them if empty) were
        quarantined in this tier (``cachetier.store.verify``): a tier shared through a server
        tells it, so that no other client is served the same records; a local tier has no
        one to tell."""

    @abstractmethod
    def delete(self, namespace: str, keys: Sequence[BlockHash]) -> int:
        """Remove blocks.

        Returns:
            How many were present and removed.
        """

    @abstractmethod
    def clear(self, namespace: str) -> int:
        """Remove every block of one namespace.

        Returns:
            How many were removed (best effort for shared remote stores).
        """

    @property
    @abstractmethod
    def capacity_bytes(self) -> int | None:
        """Capacity in bytes, ``None`` where the backing service enforces its own."""

    @property
    @abstractmethod
    def used_bytes(self) -> int:
        """Bytes this tier accounts for now."""

    def pin(self, namespace: str, keys: Sequence[BlockHash]) -> int:
        """Keep blocks from this tier's eviction, now or once they arrive
        (``cachetier.pins.pinset``).

        Args:
            namespace: storage namespace.
            keys: the keys to pin.

        Returns:
            How many of them are stored and protected now.

        Raises:
            PinLimitError: the stored ones would pass the tier's bound; nothing was pinned.
            PinsUnsupportedError: the tier cannot pin (``supports_pins`` is false).
        """
        raise PinsUnsupportedError(f"the {self.name} tier cannot pin blocks")

    def unpin(self, namespace: str, keys: Sequence[BlockHash]) -> int:
        """Let blocks be evicted again.

        Args:
            namespace: storage namespace.
            keys: the keys to unpin.

        Returns:
            How many of them were pinned.

        Raises:
            PinsUnsupportedError: the tier cannot pin (``supports_pins`` is false).
        """
        raise PinsUnsupportedError(f"the {self.name} tier cannot pin blocks")

    def pin_stats(self) -> dict[str, Any]:
        """``PinSet.snapshot`` of this tier (zeros for a tier that cannot pin)."""
        return dict(NO_PINS)

    def stats(self) -> dict[str, Any]:
        """Counters and latency of this tier (see ``TierStats``), plus capacity, use and
        pins (``pin_stats``)."""
        out = self._stats.snapshot()
        out["tier"] = self.name
        out["capacity_bytes"] = self.capacity_bytes
        out["used_bytes"] = self.used_bytes
        out.update(self.pin_stats())
        return out

    @property
    def num_errors(self) -> int:
        """Failed calls to the backing service so far. The store leaves a call that failed out
        of the tier's measured speed: a timeout against a Redis that is down says nothing about
        how fast it reads once it is back."""
        return self._stats.errors

    def _log_corrupt(self, key: BlockHash, why: str) -> None:
        """Say that this tier found the record of ``key`` corrupt (it is a miss, and is
        dropped): a WARNING, at most one per ``CORRUPT_LOG_INTERVAL_S``, which says how many
        more were found since the last one. The caller counts it in ``corrupt``."""
        if self.corrupt_listener is not None:
            self.corrupt_listener(key)
        count = self._corrupt_log.note()
        if count is None:
            return
        more = f"; {count - 1} more since the last such line" if count > 1 else ""
        logger.warning(
            "cachetier %s tier: record %s is corrupt (%s): a miss, dropped%s",
            self.name,
            bytes(key).hex()[:16],
            why,
            more,
        )

    def probe(self) -> None:
        """Reach the tier's service once, as a store starts: one that cannot be reached is
        said then (at ERROR, with its URL), not at the first request. A service that is down
        is a counted error, as for any call, never an exception. A tier of this host has
        nothing to reach."""

    def close(self) -> None:
        """Release resources; the tier must not be used afterwards."""

    def __enter__(self) -> Tier:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def first_miss(found: Sequence[Any]) -> int:
    """Index of the first ``None`` in ``found``, or its length."""
    for i, item in enumerate(found):
        if item is None:
            return i
    return len(found)


def land_in(found: list[KVBlock | None], dests: Sequence[Destination]) -> list[KVBlock | None]:
    """Copy each block whose payload is not already in its destination there, when sizes match.

    Args:
        found: blocks fetched for ``dests`` (some may already have been read into them).
        dests: one destination per block (flat bytes or ``Runs``).

    Returns:
        ``found`` with those blocks' payloads now in their destinations (``get_into``'s
        answer).
    """
    todo, pairs = [], []
    for i, (block, dest) in enumerate(zip(found, dests, strict=True)):
        if block is None:
            continue
        into = flat(dest)
        data = block.data
        if data is into:
            continue
        data = byte_view(data)
        if data.nbytes != into.nbytes:
            continue
        todo.append((i, into))
        pairs.extend(copy_pairs(dest, data))
    copy_into(pairs)  # a few threads for a large batch
    for i, into in todo:
        found[i] = found[i].landed_in(into)  # type: ignore[union-attr]
    return found
