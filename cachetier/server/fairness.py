"""What each tenant may take of the server's shared limits: its request rate and its upload
bytes in flight (transfer-port connections are ``admission``'s, by the same weights).

Every tenant has a weight (1 unless the config's ``tenant_weights`` says otherwise) and a
guaranteed share of each limit in proportion to it. A tenant may borrow what the others leave
idle, but never what another tenant needs to reach its own share:

- requests: one token bucket per tenant, refilled at its share of ``max_request_rate``; what
  an idle tenant's full bucket would overflow goes to one spare bucket that any tenant whose
  own bucket is empty may draw from. A busy tenant's own refill is never lent out.
- upload bytes: a tenant may always hold its share of ``max_inflight_bytes``; past it, only
  bytes that leave the unused share of every tenant active in the last ``ACTIVE_WINDOW_S``
  free (an upload is held for one request's time, so a tenant that turns active gets its
  share back within that).

Past its share a tenant is answered 429 with ``Retry-After`` (HTTP) or ``BUSY`` (transfer
port); the answer says how long to wait, never another tenant's refusal.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass

from cachetier.server.config import OPEN_TENANT, ServerConfig
from cachetier.util.backoff import Clock

BURST_S = 1.0  # a full bucket holds this many seconds of its tenant's rate
ACTIVE_WINDOW_S = 30.0  # a tenant that held upload bytes this recently keeps its share free
UPLOAD_RETRY_S = 1.0  # the wait a refused upload is told (uploads end at no known time)
MAX_HOLD_S = 1.0
"""Longest a request past its tenant's rate is held before its answer (HTTP) or before its
connection is read again (transfer port): a client that asks again at once would otherwise
make the server spend on refusals the CPU the other tenants need."""


@dataclass(frozen=True, slots=True)
class TenantWeights:
    """Each tenant's weight, and so its share of a limit.

    Args:
        weights: tenant -> weight (> 0), every tenant the server knows.
    """

    weights: Mapping[str, float]

    @classmethod
    def of(cls, config: ServerConfig) -> TenantWeights:
        """The weights of a server's tenants (``tenant_weights``, 1 for the others; the open
        tenant too in open mode)."""
        names = [*config.tenants, *([OPEN_TENANT] if config.open_mode else [])]
        return cls({name: float(config.tenant_weights.get(name, 1.0)) for name in names})

    @property
    def total(self) -> float:
        """Sum of the weights."""
        return sum(self.weights.values()) or 1.0

    def share(self, tenant: str, capacity: float) -> float:
        """``tenant``'s guaranteed part of ``capacity`` (weight 1 for one the config lacks)."""
        return capacity * self.weights.get(tenant, 1.0) / self.total


class RequestRates:
    """Weighted token buckets, one per tenant, and the spare bucket idle ones fill. Thread-safe.

    Args:
        rate_per_s: requests per second of all tenants together.
        weights: the tenants' weights.
        clock: time source in seconds.
    """

    def __init__(self, rate_per_s: float, weights: TenantWeights, clock: Clock) -> None:
        if not rate_per_s > 0:
            raise ValueError(f"rate_per_s must be positive, got {rate_per_s!r}")
        self._rate = rate_per_s
        self._weights = weights
        self._clock = clock
        self._lock = threading.Lock()
        self._tokens = {name: self._cap(name) for name in weights.weights}
        self._spare = 0.0
        self._last = clock()
        self.num_refused: dict[str, int] = {}

    def _cap(self, tenant: str) -> float:
        return max(1.0, self._weights.share(tenant, self._rate) * BURST_S)

    def try_take(self, tenant: str) -> float | None:
        """Admit one request of ``tenant``.

        Args:
            tenant: who sends it.

        Returns:
            ``None`` when admitted; else the seconds until its own bucket has a token again.
        """
        with self._lock:
            self._refill()
            if tenant not in self._tokens:
                self._tokens[tenant] = self._cap(tenant)
            if self._tokens[tenant] >= 1.0:
                self._tokens[tenant] -= 1.0
                return None
            if self._spare >= 1.0:  # borrowed from what idle tenants left
                self._spare -= 1.0
                return None
            self.num_refused[tenant] = self.num_refused.get(tenant, 0) + 1
            rate = self._weights.share(tenant, self._rate)
            return (1.0 - self._tokens[tenant]) / rate

    def _refill(self) -> None:
        now = self._clock()
        elapsed, self._last = max(0.0, now - self._last), now
        for tenant, tokens in self._tokens.items():
            tokens += elapsed * self._weights.share(tenant, self._rate)
            cap = self._cap(tenant)
            if tokens > cap:
                self._spare += tokens - cap
                tokens = cap
            self._tokens[tenant] = tokens
        self._spare = min(self._spare, self._rate * BURST_S)


class UploadShares:
    """Upload bytes each tenant holds, against its share of ``limit_bytes``. Thread-safe.

    The server's ``ByteBudget`` still bounds all of them together; this decides whose they may
    be.

    Args:
        limit_bytes: the server's bytes in flight (``max_inflight_bytes``).
        weights: the tenants' weights.
        clock: time source in seconds.
    """

    def __init__(self, limit_bytes: int, weights: TenantWeights, clock: Clock) -> None:
        self.limit_bytes = limit_bytes
        self._weights = weights
        self._clock = clock
        self._lock = threading.Lock()
        self._held: dict[str, int] = {}
        self._seen: dict[str, float] = {}  # tenant -> last time it took bytes

    def held_bytes(self, tenant: str) -> int:
        """Bytes ``tenant`` holds now."""
        with self._lock:
            return self._held.get(tenant, 0)

    def try_take(self, tenant: str, nbytes: int) -> bool:
        """Take ``nbytes`` for ``tenant`` if its share, or what others leave free, allows.

        Args:
            tenant: who uploads.
            nbytes: bytes to hold (>= 0).

        Returns:
            Whether they were taken (if not, nothing was).
        """
        if nbytes < 0:
            raise ValueError(f"nbytes must be >= 0, got {nbytes}")
        with self._lock:
            now = self._clock()
            self._seen[tenant] = now
            held = self._held.get(tenant, 0)
            if held + nbytes > self._weights.share(tenant, self.limit_bytes):
                # Borrowing: what the others hold, plus the unused share of each active one,
                # must stay free.
                all_held = sum(self._held.values())
                reserved = all_held - held
                for other, seen in self._seen.items():
                    if other != tenant and now - seen <= ACTIVE_WINDOW_S:
                        unused = self._weights.share(other, self.limit_bytes)
                        reserved += max(0.0, unused - self._held.get(other, 0))
                # Refused here only when the shares are why; a server full whatever the shares
                # is the ByteBudget's to answer (503, BUSY: busy for everyone).
                fits_server = all_held + nbytes <= self.limit_bytes
                if held + nbytes + reserved > self.limit_bytes and fits_server:
                    return False
            self._held[tenant] = held + nbytes
            return True

    def give(self, tenant: str, nbytes: int) -> None:
        """Give back bytes ``tenant`` took before."""
        with self._lock:
            held = self._held.get(tenant, 0)
            assert 0 <= nbytes <= held, f"{tenant} gave back {nbytes} of {held} held"
            self._held[tenant] = held - nbytes


class TenantShares:
    """A server's per-tenant shares of its request rate and upload bytes, and the weights its
    transfer port shares connections by.

    Args:
        config: the server's tenants, weights and limits.
        clock: time source in seconds.
    """

    def __init__(self, config: ServerConfig, clock: Clock = time.monotonic) -> None:
        self.weights = TenantWeights.of(config)
        rate = config.max_request_rate
        self.rates = None if rate is None else RequestRates(rate, self.weights, clock)
        self.uploads = UploadShares(config.max_inflight_bytes, self.weights, clock)

    def admit(self, tenant: str) -> float | None:
        """Admit one request of ``tenant`` (``RequestRates.try_take``); ``None`` when admitted,
        else the seconds to wait."""
        return None if self.rates is None else self.rates.try_take(tenant)


def retry_after_header(wait_s: float) -> str:
    """``Retry-After`` for a wait: whole seconds, at least 1 (RFC 9110 allows no fraction)."""
    return str(max(1, math.ceil(wait_s)))


def busy_message(what: str, wait_s: float) -> str:
    """The message of a refusal past a tenant's share; ends in the wait the client parses
    (``retry after <seconds> s``)."""
    return f"{what}; retry after {wait_s:.3f} s"
