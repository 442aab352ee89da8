"""Settings of the remote tier (no I/O, no aiohttp: safe to build anywhere)."""

from __future__ import annotations

from dataclasses import dataclass, field
from urllib.parse import urlsplit

from cachetier.tiers.remote.batching import RequestLimits
from cachetier.util.backoff import ExponentialBackoff
from cachetier.util.checks import positive_int
from cachetier.util.redact import redact_url, redacted_repr

MiB = 1 << 20


@dataclass(frozen=True, slots=True)
class RemoteTierConfig:
    """Settings of a ``RemoteTier``: the server it calls, as whom, and how.

    Args:
        url: base URL of a cachetier server, ``http://host:port`` or ``https://host:port`` (TLS,
            to the HTTP API and the transfer port alike); a path prefix is kept.
        token: bearer token (it names the tenant); ``None`` for a server in open mode. Never in
            the repr.
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
            (``/v1/limits`` says, and whether the port speaks TLS): gets and puts then run on the
            calling thread without HTTP. With an ``https://`` url the port is used only if it
            speaks TLS (verified like HTTP), so the token never crosses the network in clear.
            ``False`` keeps to HTTP.
        transfer_socket: when the server also names a Unix socket and that path exists here (same
            host, or a folder shared with the server's pod), transfer over it instead of TCP
            (the server's hello id confirms it is the same server). The socket is plaintext: it
            is local and guarded by its folder's permissions.
        ca_file: PEM bundle of the CAs the server's certificate is checked against (``https://``
            only); ``None`` trusts the system's CAs.
        tls_verify: check the server's certificate chain and that it names the url's host. Turn
            it off only for a throwaway test certificate: anyone on the path could then pose as
            the server and collect the token.
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
    ca_file: str | None = None
    tls_verify: bool = True

    def __repr__(self) -> str:
        return redacted_repr(self)

    def __post_init__(self) -> None:
        if not isinstance(self.url, str):
            raise TypeError(f"url must be a str, got {type(self.url).__name__}")
        shown = redact_url(self.url)  # what error messages show: never a password
        parts = urlsplit(self.url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"url {shown!r} must be http(s)://host:port of a cachetier server")
        try:
            parts.port  # noqa: B018 -- raises ValueError on a bad port
        except ValueError:
            raise ValueError(f"url {shown!r} has a bad port") from None
        if parts.query or parts.fragment:
            raise ValueError(f"url {shown!r} must not have a query or fragment")
        if parts.username is not None or parts.password is not None:
            # The server takes a bearer token, not a user and password; aiohttp would send
            # them as basic auth (refusing the token beside them), the transfer port not at all.
            raise ValueError(f"url {shown!r} must not carry credentials: give them as token")
        if self.ca_file is not None:
            if not isinstance(self.ca_file, str) or not self.ca_file:
                raise ValueError(f"ca_file must be a file path or None, got {self.ca_file!r}")
            if parts.scheme != "https":
                raise ValueError(f"ca_file is set but url {shown!r} is not https://")
        if not isinstance(self.tls_verify, bool):
            raise TypeError(f"tls_verify must be a bool, got {self.tls_verify!r}")
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
            positive_int(name, getattr(self, name))
        if isinstance(self.retries, bool) or not isinstance(self.retries, int) or self.retries < 0:
            raise ValueError(f"retries must be an int >= 0, got {self.retries!r}")
        ExponentialBackoff(self.backoff_base_s, self.backoff_cap_s)  # raises if invalid

    @property
    def tls(self) -> bool:
        """Whether the url is ``https://``: HTTP and any TCP transfer speak TLS."""
        return urlsplit(self.url).scheme == "https"

    @property
    def transfer_host(self) -> str | None:
        """The host to reach the transfer port on (the url's; with TLS, the name its
        certificate must carry); ``None`` when transfers are off."""
        return urlsplit(self.url).hostname if self.transfer else None

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
