"""Settings of the remote tier (no I/O, no aiohttp: safe to build anywhere)."""

from __future__ import annotations

from dataclasses import dataclass, field
from urllib.parse import urlsplit

from cachetier.backoff import ExponentialBackoff
from cachetier.tiers.remote.batching import RequestLimits

MiB = 1 << 20


@dataclass(frozen=True, slots=True)
class RemoteTierConfig:
    """Args:
    url: base URL of a cachetier server, ``http://host:port`` (a path prefix is kept).
    token: bearer token (it names the tenant); ``None`` for a server in open mode.
    tenant: if set, sent as ``X-Cachetier-Tenant``: a token of another tenant is then refused
        (403) instead of silently writing to that tenant.
    timeout_s: longest one HTTP attempt may take, connect to last byte, in seconds.
    connect_timeout_s: longest wait for a TCP connection, in seconds.
    max_connections: connections kept in the pool.
    retries: extra attempts after a failed one (connection refused or reset, timeout, 5xx).
    failure_threshold: failed calls in a row that open the circuit breaker.
    backoff_base_s: wait before the first retry, and before the first trial once the breaker
        is open, in seconds.
    backoff_cap_s: longest such wait, in seconds.
    max_batch_blocks: most blocks per request; larger calls are split. The tier also asks
        the server for its limits (``/v1/limits``) and keeps to the stricter of the two.
    max_batch_bytes: most record bytes per put request; larger puts are split.
    max_keys: most keys per lookup, exists or delete request.
    max_record_bytes: largest record accepted from the server.
    transfer: move block batches over the server's block transfer port when it has one
        (``/v1/limits`` says; plain TCP to the url's host, so only for ``http://`` urls):
        gets and puts then run on the calling thread without HTTP. ``False`` keeps to HTTP.
    transfer_socket: when the server also names a Unix socket and that path exists here (same
        host, or a folder shared with the server's pod), transfer over it instead of TCP
        (the server's hello id confirms it is the same server).
    """

    url: str
    token: str | None = field(default=None, repr=False)
    tenant: str | None = None
    timeout_s: float = 2.0
    connect_timeout_s: float = 0.5
    max_connections: int = 16
    retries: int = 2
    failure_threshold: int = 3
    backoff_base_s: float = 0.008
    backoff_cap_s: float = 0.512
    max_batch_blocks: int = 256
    max_batch_bytes: int = 256 * MiB
    max_keys: int = 4096
    max_record_bytes: int = 1024 * MiB
    transfer: bool = True
    transfer_socket: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.url, str):
            raise TypeError(f"url must be a str, got {type(self.url).__name__}")
        parts = urlsplit(self.url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"url {self.url!r} must be http(s)://host:port of a cachetier server")
        try:
            parts.port  # noqa: B018 -- raises ValueError on a bad port
        except ValueError:
            raise ValueError(f"url {self.url!r} has a bad port") from None
        if parts.query or parts.fragment:
            raise ValueError(f"url {self.url!r} must not have a query or fragment")
        if self.token is not None and (not self.token or any(c.isspace() for c in self.token)):
            raise ValueError("token must be a non-empty string without spaces, or None")
        for name in ("timeout_s", "connect_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)!r}")
        for name in (
            "max_connections",
            "failure_threshold",
            "max_batch_blocks",
            "max_batch_bytes",
            "max_keys",
            "max_record_bytes",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if isinstance(self.retries, bool) or not isinstance(self.retries, int) or self.retries < 0:
            raise ValueError(f"retries must be an int >= 0, got {self.retries!r}")
        ExponentialBackoff(self.backoff_base_s, self.backoff_cap_s)  # raises if invalid

    @property
    def transfer_host(self) -> str | None:
        """The host to reach the transfer port on; ``None`` when transfers are off (by the
        setting, or because the url is https: the port has no TLS)."""
        parts = urlsplit(self.url)
        return parts.hostname if self.transfer and parts.scheme == "http" else None

    @property
    def base_url(self) -> str:
        """``url`` without a trailing slash."""
        return self.url.rstrip("/")

    @property
    def limits(self) -> RequestLimits:
        """The request limits of this config (before the server's are known)."""
        return RequestLimits(
            max_block_bytes=self.max_batch_bytes,
            max_batch_bytes=self.max_batch_bytes,
            max_batch_blocks=self.max_batch_blocks,
            max_keys=self.max_keys,
        )

    @property
    def call_budget_s(self) -> float:
        """Longest a whole call may take: every attempt and every wait between them."""
        backoff = ExponentialBackoff(self.backoff_base_s, self.backoff_cap_s)
        waits = sum(backoff.delay_s(i) for i in range(self.retries))
        return (self.retries + 1) * self.timeout_s + waits
