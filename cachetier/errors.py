"""The one exception hierarchy of cachetier.

Callers catch :class:`CacheTierError` to handle anything the cache raises on purpose.
Bad arguments from a caller are plain ``ValueError`` / ``TypeError``; a miss is ``None``.
"""

from __future__ import annotations


class CacheTierError(Exception):
    """Base class of every error cachetier raises on purpose."""


class CorruptBlockError(CacheTierError):
    """A stored record failed a check (magic, version, length, checksum, key or fingerprint).

    Tiers turn this into a miss, delete the record and count it; it only reaches callers of
    the low-level record decoder.
    """


class TierUnavailableError(CacheTierError):
    """A tier's backing service (Redis, the sidecar, the disk) cannot be reached right now."""


class CapacityError(CacheTierError):
    """A block can never fit in a tier (it is larger than the tier's whole capacity)."""


class RequestRefusedError(CacheTierError):
    """A service refused a request (bad token, another tenant, over its limits): retrying the
    same request cannot help, unlike a ``TierUnavailableError``."""


class PinLimitError(RequestRefusedError):
    """A pin would pass a tier's bound on pinned bytes (``max_pinned_fraction``); nothing of
    the request was pinned."""


class PinsUnsupportedError(RequestRefusedError):
    """A tier that cannot keep blocks from eviction was asked to (``Tier.supports_pins`` is
    false: e.g. Redis without a capacity of ours, whose own maxmemory policy evicts)."""


class OverloadedError(CacheTierError):
    """A service has no room for a request right now (too many bytes in flight): unlike a
    ``RequestRefusedError``, the same request may succeed later."""


class QuarantineLimitError(CacheTierError):
    """A quarantine list is full: no new quarantine is taken until one is lifted."""


class QuarantineQuotaError(QuarantineLimitError):
    """One owner (a sidecar's tenant) holds as many quarantines as its quota allows: its next
    is refused until one of its own is lifted; the other owners' places are untouched."""
