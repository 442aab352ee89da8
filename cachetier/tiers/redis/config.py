"""The Redis tier's settings, and the one place a redis-py client is made from them.

No I/O here: ``RedisTierConfig`` checks its values (the url and its query included, with the
password redacted from every message) and ``make_client`` builds a client that connects on
first use (a cluster's reads its slot map at once; see ``make_client``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qsl, urlsplit

import redis
from redis.backoff import NoBackoff
from redis.cluster import ClusterNode, RedisCluster
from redis.retry import Retry

from cachetier.tiers.redis.cluster import CLUSTER_SCHEMES, parse_cluster_url
from cachetier.util.backoff import ExponentialBackoff
from cachetier.util.checks import fraction, positive_int
from cachetier.util.redact import redact_url, redacted_repr

_PREFIX_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
_URL_SCHEMES = ("redis", "rediss", "unix")
_TLS_SCHEMES = ("rediss", "rediss+cluster")
# Query flags that ask redis-py for TLS (or tune it): redis-py alone would read them (the
# protocol client of ``resp`` would stay plaintext), and ``ssl=true`` makes it fail with a
# TypeError.
_TLS_QUERY_RE = re.compile(r"^(ssl|tls)(_.*)?$", re.IGNORECASE)
# The pure-Python RESP parser reads a socket in chunks of this size: redis-py's 32 KiB makes
# many more reads (and copies) of a record of hundreds of KB.
_SOCKET_READ_BYTES = 256 * 1024


@dataclass(frozen=True, slots=True)
class RedisTierConfig:
    """Settings of the Redis tier: where Redis is, capacity, timeouts, breaker and TLS.

    Args:
    url: ``redis://[user:password@]host:port/db``, ``rediss://...`` (TLS),
        ``unix:///path.sock?db=0``, or a Redis Cluster:
        ``redis+cluster://[user:password@]host:port[,host:port...]`` (``rediss+cluster://``
        for TLS), listing one or more of its nodes; the others are found from them.
    key_prefix: first part of every key (letters, digits, ``._-``); tiers with the same
        prefix share blocks and, with a capacity, one LRU.
    ttl_s: records expire this long after they were put (gets do not extend it); ``None``
        keeps them until evicted.
    capacity_bytes: most record bytes kept under ``key_prefix`` (exact LRU, single-node Redis
        only); ``None`` leaves the bound to Redis's ``maxmemory`` policy (each node's, on a
        cluster).
    compression: ``"none"`` or ``"lz4"`` for stored payloads.
    socket_timeout_s: longest wait for Redis to answer one read or write, in seconds.
    connect_timeout_s: longest wait for a TCP connection, in seconds.
    max_connections: connections in the pool (one pool per node on a cluster); a call waits
        up to ``socket_timeout_s`` for one.
    failure_threshold: failures in a row that open the circuit breaker (of each master, on a
        cluster).
    backoff_base_s: wait before the first trial call once the breaker is open, in seconds.
    backoff_cap_s: longest wait between trial calls, in seconds.
    bulk_streams: most connections one get or put of many blocks is spread over, one thread
        each (single node; see ``cachetier.tiers.redis.resp``).
    ssl_ca_certs: PEM bundle of the CAs Redis's certificate is checked against (``rediss``
        urls only); ``None`` trusts the system's CAs.
    ssl_certfile: PEM client certificate for a Redis that asks for one (``rediss`` only).
    ssl_keyfile: PEM private key of ``ssl_certfile`` (``None``: it is in ``ssl_certfile``).
    max_pinned_fraction: share of ``capacity_bytes`` pinned records may hold, in [0, 1) (0:
        nothing can be pinned); the rest is what the exact LRU evicts in. Pins need a capacity
        and a single node: without the tier's own LRU there is nothing to keep them from.
    """

    url: str = "redis://127.0.0.1:6379/0"
    key_prefix: str = "cachetier"
    ttl_s: float | None = None
    capacity_bytes: int | None = None
    compression: str = "none"
    socket_timeout_s: float = 0.5
    connect_timeout_s: float = 0.5
    max_connections: int = 32
    failure_threshold: int = 3
    backoff_base_s: float = 0.008
    backoff_cap_s: float = 0.512
    bulk_streams: int = 4
    ssl_ca_certs: str | None = None
    ssl_certfile: str | None = None
    ssl_keyfile: str | None = None
    max_pinned_fraction: float = 0.5

    def __repr__(self) -> str:
        return redacted_repr(self)

    def __post_init__(self) -> None:
        _check_url(self.url)
        for name in ("ssl_ca_certs", "ssl_certfile", "ssl_keyfile"):
            value = getattr(self, name)
            if value is None:
                continue
            if not isinstance(value, str) or not value:
                raise ValueError(f"{name} must be a file path or None, got {value!r}")
            if not self.tls:
                raise ValueError(
                    f"{name} is set but url {redact_url(self.url)!r} is not TLS: use rediss:// "
                    "(or rediss+cluster://)"
                )
        if self.ssl_keyfile is not None and self.ssl_certfile is None:
            raise ValueError("ssl_keyfile is set without ssl_certfile: name the certificate too")
        if not isinstance(self.key_prefix, str) or not _PREFIX_RE.match(self.key_prefix):
            raise ValueError(
                f"key_prefix {self.key_prefix!r} must be 1-64 characters of [A-Za-z0-9._-] "
                "starting with a letter or digit"
            )
        if self.ttl_s is not None and not self.ttl_s >= 0.001:
            raise ValueError(f"ttl_s must be None or at least 0.001 (1 ms), got {self.ttl_s!r}")
        if self.capacity_bytes is not None:
            positive_int("capacity_bytes", self.capacity_bytes)
            if self.cluster:
                raise ValueError(
                    "capacity_bytes must be None with a redis+cluster:// url: the exact LRU runs "
                    "Lua over keys in many slots, which a cluster refuses; bound each node with "
                    "maxmemory and maxmemory-policy allkeys-lru instead"
                )
        if self.compression not in ("none", "lz4"):
            raise ValueError(f"compression must be 'none' or 'lz4', got {self.compression!r}")
        fraction("max_pinned_fraction", self.max_pinned_fraction)
        for name in ("socket_timeout_s", "connect_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)!r}")
        positive_int("max_connections", self.max_connections)
        positive_int("failure_threshold", self.failure_threshold)
        positive_int("bulk_streams", self.bulk_streams)
        ExponentialBackoff(self.backoff_base_s, self.backoff_cap_s)  # raises if invalid

    @property
    def cluster(self) -> bool:
        """Whether ``url`` names a Redis Cluster."""
        return self.url.partition("://")[0] in CLUSTER_SCHEMES

    @property
    def tls(self) -> bool:
        """Whether ``url`` asks for TLS (``rediss://`` or ``rediss+cluster://``)."""
        return self.url.partition("://")[0] in _TLS_SCHEMES


def _check_url(url: str) -> None:
    """Raise ``ValueError`` for a url the tier cannot use (messages show it redacted)."""
    if not isinstance(url, str):
        raise TypeError(f"url must be a str, got {type(url).__name__}")
    shown = redact_url(url)
    if url.partition("://")[0] in CLUSTER_SCHEMES:
        parse_cluster_url(url)  # raises ValueError on a bad one
        return
    parts = urlsplit(url)
    if parts.scheme not in _URL_SCHEMES:
        raise ValueError(
            f"url {shown!r} must start with one of {_URL_SCHEMES + CLUSTER_SCHEMES}://"
        )
    flags = [name for name, _ in parse_qsl(parts.query) if _TLS_QUERY_RE.match(name)]
    if flags:
        raise ValueError(
            f"url {shown!r} sets {', '.join(sorted(set(flags)))} in its query: for TLS use a "
            "rediss:// url (rediss+cluster:// for a cluster), and the tier's ssl_ca_certs, "
            "ssl_certfile and ssl_keyfile settings"
        )
    if parts.scheme == "unix":
        if not parts.path:
            raise ValueError(f"url {shown!r} must name a socket path, e.g. unix:///run/redis.sock")
        return
    if not parts.hostname:
        raise ValueError(f"url {shown!r} must name a host, e.g. redis://127.0.0.1:6379/0")
    try:
        parts.port  # noqa: B018 -- raises ValueError on a bad port
    except ValueError:
        raise ValueError(f"url {shown!r} has a bad port") from None
    db = parts.path.lstrip("/")
    if db and not db.isdigit():
        raise ValueError(f"url {shown!r} must end with a database number, e.g. /0")


def make_client(config: RedisTierConfig) -> redis.Redis | RedisCluster:
    """The one place a Redis client is made.

    Args:
        config: the tier's settings.

    Returns:
        For a single node, a client over a blocking pool of ``max_connections`` connections;
        no I/O: connections are opened on first use and reopened after a failure. For a
        cluster, a ``RedisCluster``: it reads the slot map from the first startup node that
        answers (I/O; raises ``RedisClusterException`` when none does) and keeps such a pool
        per node. redis-py's own retries are off: the tier's circuit breakers are the one retry
        policy. So a call to a node that is down or silent fails after at most a wait for a
        free connection (``socket_timeout_s``), a connect (``connect_timeout_s``) and one
        unanswered read or write (``socket_timeout_s``).
    """
    options: dict[str, Any] = dict(
        max_connections=config.max_connections,
        timeout=config.socket_timeout_s,  # wait for a free connection
        socket_timeout=config.socket_timeout_s,
        socket_connect_timeout=config.connect_timeout_s,
        socket_keepalive=True,
        socket_read_size=_SOCKET_READ_BYTES,
        driver_info=None,  # no CLIENT SETINFO round trips on each new connection
    )
    if config.tls:
        # Verification as in the protocol client (cachetier.util.tls.client_context): chain, host
        # name.
        options.update(
            ssl_cert_reqs="required",
            ssl_check_hostname=True,
            ssl_ca_certs=config.ssl_ca_certs,
            ssl_certfile=config.ssl_certfile,
            ssl_keyfile=config.ssl_keyfile,
        )
    if config.cluster:
        address = parse_cluster_url(config.url)
        return RedisCluster(
            url=address.node_url,
            startup_nodes=[ClusterNode(host, port) for host, port in address.nodes[1:]],
            # A slot map with the slots of a lost master still counts: only they fail.
            require_full_coverage=False,
            # No retry (and no slot-map re-read per failed command): ``ClusterRouter`` decides.
            retry=Retry(NoBackoff(), 0),
            connection_pool_class=redis.BlockingConnectionPool,  # used for a url's nodes
            **options,
        )
    pool = redis.BlockingConnectionPool.from_url(
        config.url, retry=Retry(NoBackoff(), 0), health_check_interval=0, **options
    )
    return redis.Redis(connection_pool=pool)
