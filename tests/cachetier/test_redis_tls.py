"""RedisTier over TLS against a real redis-server with ``--tls-port`` (and no plaintext port),
with certificates this session made (``tests.certs``); and a Redis that refuses our password.

What is checked: ``rediss://`` round-trips blocks on the bulk path (``resp`` over TLS), reuses
its pooled TLS connections, and verifies the server (a client without the CA gets misses and
counted errors, never plaintext and never an exception); a Redis Cluster takes the CA and
client certificate too; ``?ssl=``-style flags are refused; NOAUTH / WRONGPASS are counted and
logged once per interval with the url redacted.
"""

from __future__ import annotations

import logging
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis

from cachetier.primitives.keys import KVLayout, Namespace
from cachetier.tiers.redis import AUTH_LOG_INTERVAL_S, RedisTier, RedisTierConfig
from cachetier.tiers.redis.transports import RespTransport
from tests.certs import TLSFiles
from tests.support import (
    SMALL_LAYOUT,
    FakeClock,
    PrivateRedis,
    end_process,
    make_blocks,
    opened_redis_tiers,
    start_on_a_free_port,
)

PASSWORD = "tls-redis-pw-7f3a9c"
STARTUP_S = 15.0
# 2 layers x K/V x 64 tokens x 2 heads x 64 dims, fp16: 64 KiB payloads, at the size where a
# read goes straight into the destination instead of through the connection's buffer.
BIG = KVLayout("float16", block_size=64, num_layers=2, num_kv_heads=2, head_dim=64)


class TLSRedis:
    """A redis-server of the test's own that speaks only TLS (``--port 0``; its TLS port is
    one of its own, ``start_on_a_free_port``) and asks clients
    for a certificate (``tls-auth-clients yes``, Redis's default).

    Args:
        folder: where it writes its log (and, as a cluster node, its nodes file).
        tls: the certificates.
        password: ``requirepass``, or ``None``.
        cluster: run as a one-node Redis Cluster holding every slot (TLS on the bus too).
    """

    def __init__(
        self, folder: Path, tls: TLSFiles, *, password: str | None = None, cluster: bool = False
    ) -> None:
        self.folder = folder
        self.tls = tls
        self.password = password
        self.cluster = cluster
        self.port = 0  # chosen by start()
        self.proc: subprocess.Popen[bytes] | None = None

    def url(self, *, password: str | None = None, scheme: str = "rediss") -> str:
        login = f":{password}@" if password else ""
        return f"{scheme}://{login}127.0.0.1:{self.port}" + ("" if self.cluster else "/0")

    def client(self) -> redis.Redis:
        """A redis-py client with the CA and the client certificate (for checks from outside)."""
        return redis.Redis(
            port=self.port,
            password=self.password,
            ssl=True,
            ssl_ca_certs=self.tls.ca,
            ssl_certfile=self.tls.client_cert,
            ssl_keyfile=self.tls.client_key,
            socket_timeout=2,
            socket_connect_timeout=2,
        )

    def start(self) -> TLSRedis:
        log = self.folder / "redis.log"
        self.port, self.proc = start_on_a_free_port(self._popen, log, timeout_s=STARTUP_S)
        client = self.client()
        try:
            self._wait(lambda: bool(client.ping()), client)
            if self.cluster:
                client.execute_command("CLUSTER", "ADDSLOTSRANGE", 0, 16383)
                self._wait(
                    lambda: b"cluster_state:ok" in client.execute_command("CLUSTER", "INFO"), client
                )
        finally:
            client.close()
        return self

    def _popen(self, port: int) -> subprocess.Popen[bytes]:
        args = ["redis-server", "--port", "0", "--tls-port", str(port)]
        args += ["--bind", "127.0.0.1", "--tls-cert-file", self.tls.cert]
        args += ["--tls-key-file", self.tls.key, "--tls-ca-cert-file", self.tls.ca]
        args += ["--tls-auth-clients", "yes", "--save", "", "--appendonly", "no"]
        args += ["--dir", str(self.folder), "--logfile", str(self.folder / "redis.log")]
        if self.password is not None:
            args += ["--requirepass", self.password]
        if self.cluster:
            args += ["--cluster-enabled", "yes", "--tls-cluster", "yes"]
            # Its bus port moves with its port: a try where either is taken is tried again.
            args += ["--cluster-port", str(port + 10000), "--cluster-config-file", "nodes.conf"]
        return subprocess.Popen(args)

    def _wait(self, ready: Callable[[], bool], client: redis.Redis) -> None:
        deadline = time.monotonic() + STARTUP_S
        while True:
            try:
                if ready():
                    return
            except redis.exceptions.ConnectionError:
                pass
            assert self.proc is not None and self.proc.poll() is None, (
                f"redis-server exited: {(self.folder / 'redis.log').read_text()[-2000:]}"
            )
            assert time.monotonic() < deadline, "redis-server with TLS did not come up"
            time.sleep(0.05)

    def num_connections_received(self) -> int:
        client = self.client()
        try:
            return int(client.info("stats")["total_connections_received"])
        finally:
            client.close()

    def stop(self) -> None:
        if self.proc is not None:
            end_process(self.proc, timeout_s=10)
            self.proc = None


@pytest.fixture
def start_tls_redis(tmp_path: Path, tls_files: TLSFiles) -> Iterator[Callable[..., TLSRedis]]:
    started: list[TLSRedis] = []

    def start(**options: object) -> TLSRedis:
        folder = tmp_path / f"redis{len(started)}"
        folder.mkdir()
        server = TLSRedis(folder, tls_files, **options)  # type: ignore[arg-type]
        started.append(server)
        return server.start()

    yield start
    for server in started:
        server.stop()


@pytest.fixture
def make_tier() -> Iterator[Callable[..., RedisTier]]:
    with opened_redis_tiers(key_prefix="tls-test") as make:
        yield make


def _with_client_cert(tls: TLSFiles) -> dict[str, str]:
    return {"ssl_ca_certs": tls.ca, "ssl_certfile": tls.client_cert, "ssl_keyfile": tls.client_key}


def test_rediss_round_trips_blocks_on_the_bulk_path(
    start_tls_redis: Callable[..., TLSRedis],
    make_tier: Callable[..., RedisTier],
    tls_files: TLSFiles,
) -> None:
    server = start_tls_redis(password=PASSWORD)
    tier = make_tier(url=server.url(password=PASSWORD), **_with_client_cert(tls_files))
    namespace = Namespace("tls-model", BIG)
    blocks = make_blocks(namespace, 12)
    # 12 blocks: spread over the tier's 4 bulk streams, each a TLS connection of its own.
    assert tier.put_many(namespace.id, blocks) == len(blocks)
    got = tier.get_many(namespace.id, [b.key for b in blocks])
    assert [bytes(g.data) for g in got if g is not None] == [bytes(b.data) for b in blocks]
    dests = [memoryview(bytearray(len(b.data))) for b in blocks]
    into = tier.get_into(namespace.id, [b.key for b in blocks], dests)
    assert all(g is not None for g in into)
    assert [bytes(d) for d in dests] == [bytes(b.data) for b in blocks]
    stats = tier.stats()
    assert (stats["puts"], stats["hits"], stats["errors"]) == (12, 24, 0)
    # The bulk path ran (its pool holds the connections it made): the one with no plaintext
    # port to fall back to, so every byte of it went over TLS.
    transport = tier._transport
    assert isinstance(transport, RespTransport) and transport.resp.endpoint.tls is not None
    assert transport.resp.num_idle >= 2
    # redis-py's path (a script) works over the same TLS settings.
    assert tier.contains_prefix(namespace.id, [b.key for b in blocks]) == len(blocks)


def test_idle_tls_connections_are_reused_not_dropped(
    start_tls_redis: Callable[..., TLSRedis],
    make_tier: Callable[..., RedisTier],
    tls_files: TLSFiles,
) -> None:
    # No password: the connection sends nothing before its first GET, so the TLS 1.3 session
    # tickets Redis sent after the handshake are still unread when it goes back to the pool.
    server = start_tls_redis()
    tier = make_tier(url=server.url(), bulk_streams=1, **_with_client_cert(tls_files))
    namespace = Namespace("tls-model", BIG)
    [block] = make_blocks(namespace, 1)
    assert tier.put_many(namespace.id, [block]) == 1
    before = server.num_connections_received()
    for _ in range(5):
        [got] = tier.get_many(namespace.id, [block.key])
        assert got is not None
    assert server.num_connections_received() - before <= 1  # ours, if any, plus the checker's


def test_a_client_without_the_ca_gets_misses_and_counted_errors(
    start_tls_redis: Callable[..., TLSRedis],
    make_tier: Callable[..., RedisTier],
    tls_files: TLSFiles,
    caplog: pytest.LogCaptureFixture,
) -> None:
    server = start_tls_redis(password=PASSWORD)
    # The system's CAs only: Redis's certificate does not verify.
    tier = make_tier(
        url=server.url(password=PASSWORD),
        ssl_certfile=tls_files.client_cert,
        ssl_keyfile=tls_files.client_key,
        failure_threshold=100,
    )
    namespace = Namespace("tls-model", BIG)
    blocks = make_blocks(namespace, 3)
    with caplog.at_level(logging.DEBUG):
        assert tier.put_many(namespace.id, blocks) == 0
        assert tier.get_many(namespace.id, [b.key for b in blocks]) == [None] * 3
        assert tier.contains_prefix(namespace.id, [b.key for b in blocks]) == 0
    stats = tier.stats()
    assert stats["errors"] == 3 and stats["misses"] == 3
    assert PASSWORD not in caplog.text


def test_a_wrong_host_name_fails_verification(
    tmp_path: Path,
    tls_files: TLSFiles,
    make_tier: Callable[..., RedisTier],
) -> None:
    # Signed by the trusted CA, but for another host: the chain is good, the name is not.
    wrong = TLSFiles(
        **{
            **{f: getattr(tls_files, f) for f in TLSFiles.__dataclass_fields__},
            "cert": tls_files.wrong_host_cert,
            "key": tls_files.wrong_host_key,
        }
    )
    server = TLSRedis(tmp_path, wrong)
    server.port, server.proc = start_on_a_free_port(
        lambda port: subprocess.Popen(
            ["redis-server", "--port", "0", "--tls-port", str(port), "--bind", "127.0.0.1"]
            + ["--tls-cert-file", wrong.cert, "--tls-key-file", wrong.key]
            + ["--tls-ca-cert-file", wrong.ca, "--tls-auth-clients", "no", "--save", ""]
            + ["--appendonly", "no", "--dir", str(tmp_path)]
            + ["--logfile", str(tmp_path / "redis.log")]
        ),
        tmp_path / "redis.log",
        timeout_s=STARTUP_S,
    )
    try:
        tier = make_tier(url=server.url(), ssl_ca_certs=tls_files.ca, failure_threshold=100)
        namespace = Namespace("tls-model", BIG)
        blocks = make_blocks(namespace, 2)
        deadline = time.monotonic() + STARTUP_S
        while "Ready to accept" not in _read(tmp_path / "redis.log"):
            assert time.monotonic() < deadline, "redis-server did not start"
            time.sleep(0.05)
        assert tier.put_many(namespace.id, blocks) == 0
        assert tier.get_many(namespace.id, [b.key for b in blocks]) == [None, None]
        assert tier.stats()["errors"] == 2
    finally:
        server.stop()


def test_a_tls_cluster_takes_the_ca_and_a_client_certificate(
    start_tls_redis: Callable[..., TLSRedis],
    make_tier: Callable[..., RedisTier],
    tls_files: TLSFiles,
) -> None:
    server = start_tls_redis(password=PASSWORD, cluster=True)
    url = server.url(password=PASSWORD, scheme="rediss+cluster")
    tier = make_tier(url=url, **_with_client_cert(tls_files))
    namespace = Namespace("tls-model", BIG)
    blocks = make_blocks(namespace, 4)
    assert tier.put_many(namespace.id, blocks) == 4
    got = tier.get_many(namespace.id, [b.key for b in blocks])
    assert [bytes(g.data) for g in got if g is not None] == [bytes(b.data) for b in blocks]
    assert tier.stats()["errors"] == 0
    # Without the client certificate this Redis (tls-auth-clients yes) refuses the handshake.
    bare = make_tier(url=url, ssl_ca_certs=tls_files.ca)
    assert bare.get_many(namespace.id, [blocks[0].key]) == [None]
    assert bare.stats()["errors"] >= 1
    assert PASSWORD not in repr(tier.config)


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("redis://127.0.0.1:6379/0?ssl=true", "rediss://"),
        ("redis://:pw-secret-1@127.0.0.1:6379/0?ssl_cert_reqs=none", "rediss://"),
        ("redis://127.0.0.1:6379/0?tls=1", "rediss://"),
        ("unix:///tmp/redis.sock?db=0&ssl=true", "rediss://"),
        ("rediss+cluster://127.0.0.1:7000?ssl=true", "rediss\\+cluster://"),
    ],
)
def test_tls_query_flags_are_refused(url: str, message: str) -> None:
    with pytest.raises(ValueError, match=message) as caught:
        RedisTierConfig(url=url)
    assert "pw-secret-1" not in str(caught.value)


def test_tls_files_need_a_rediss_url() -> None:
    with pytest.raises(ValueError, match="use rediss://"):
        RedisTierConfig(url="redis://127.0.0.1:6379/0", ssl_ca_certs="/etc/ssl/ca.pem")
    with pytest.raises(ValueError, match="ssl_certfile"):
        RedisTierConfig(url="rediss://127.0.0.1:6379/0", ssl_keyfile="/tmp/key.pem")


def test_a_missing_ca_file_fails_at_construction(tmp_path: Path) -> None:
    config = RedisTierConfig(url="rediss://127.0.0.1:6379/0", ssl_ca_certs=str(tmp_path / "no"))
    with pytest.raises(ValueError, match="CA bundle"):
        RedisTier(config)


# A Redis that refuses our credentials


@pytest.fixture
def locked_redis(tmp_path: Path) -> Iterator[PrivateRedis]:
    server = PrivateRedis(tmp_path, password=PASSWORD)
    server.start()
    yield server
    server.stop()


@pytest.mark.parametrize("password", [None, "not-the-password-42"])
def test_noauth_and_wrongpass_are_counted_and_logged_once_per_interval(
    locked_redis: PrivateRedis,
    make_tier: Callable[..., RedisTier],
    caplog: pytest.LogCaptureFixture,
    password: str | None,
) -> None:
    clock = FakeClock()
    login = f":{password}@" if password else ""
    url = f"redis://{login}127.0.0.1:{locked_redis.port}/0"
    # A high threshold: every call reaches Redis and is refused (no breaker skips).
    tier = make_tier(url=url, clock=clock, failure_threshold=1000)
    # Small records: Redis drops an unauthenticated client that sends a bulk string past 16 KiB
    # without answering NOAUTH (a put of large blocks then counts as an error, not an auth one;
    # the gets, always answered NOAUTH, still say what is wrong).
    namespace = Namespace("auth-model", SMALL_LAYOUT)
    blocks = make_blocks(namespace, 2)
    keys = [b.key for b in blocks]
    with caplog.at_level(logging.WARNING, logger="cachetier.tiers.redis.tier"):
        for _ in range(5):
            assert tier.put_many(namespace.id, blocks) == 0  # bulk path
            assert tier.get_many(namespace.id, keys) == [None, None]  # bulk path
            assert tier.contains_prefix(namespace.id, keys) == 0  # redis-py
        first = [r for r in caplog.records if "refuses the tier's credentials" in r.message]
        clock.advance(AUTH_LOG_INTERVAL_S + 1)
        tier.get_many(namespace.id, keys)
    warnings = [r for r in caplog.records if "refuses the tier's credentials" in r.message]
    assert len(first) == 1
    assert len(warnings) == 2
    assert "15 call(s)" in warnings[1].message  # every refusal since the first warning
    stats = tier.stats()
    assert stats["auth_failures"] == 16
    assert stats["errors"] == 16
    assert f"127.0.0.1:{locked_redis.port}" in caplog.text
    if password is not None:
        assert password not in caplog.text
        assert ":***@127.0.0.1" in caplog.text


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except FileNotFoundError:
        return ""
