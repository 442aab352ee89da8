"""``RemoteTier`` against real servers: the blocking facade and the async API, a server that
is down, slow or restarting (misses and counted errors, never an exception), and the stores
the engine and the connectors build from ``StoreConfig``."""

from __future__ import annotations

import asyncio
import http.server
import logging
import threading
import time
from collections.abc import Callable, Iterator

import pytest

from cachetier.connectors.config import ConnectorConfig
from cachetier.primitives.keys import Namespace
from cachetier.protocol.http_batch import BATCH_MEDIA_TYPE, batch_parts
from cachetier.record import encode_parts
from cachetier.store.config import StoreConfig, build_store
from cachetier.tiers.remote import RemoteTier, RemoteTierConfig
from tests.server.batches import read_batch
from tests.server.live import TOKENS, ThreadServer, call
from tests.support import make_blocks, refusing_port
from tests.support import silent_port as hung_port

MakeRemote = Callable[..., RemoteTier]


def test_blocking_and_async_api_agree(
    shared_server: ThreadServer, make_remote: MakeRemote, own_namespace: Namespace
) -> None:
    tier = make_remote(shared_server.url)
    blocks = make_blocks(own_namespace, 6)
    keys = [b.key for b in blocks]
    assert tier.put_many(own_namespace.id, blocks[:3]) == 3

    async def from_another_loop() -> tuple[int, list, int]:
        stored = await tier.aput_many(own_namespace.id, blocks[3:5])
        # Many calls at once from this loop share the tier's one pooled session.
        got = await asyncio.gather(*[tier.aget_many(own_namespace.id, [k]) for k in keys])
        return stored, [g[0] for g in got], await tier.acontains_prefix(own_namespace.id, keys)

    stored, got, prefix = asyncio.run(from_another_loop())
    assert stored == 2 and prefix == 5
    assert [bytes(g.data) for g in got[:5]] == [bytes(b.data) for b in blocks[:5]]
    assert got[5] is None
    hit = tier.lookup(own_namespace.id, keys)
    assert hit.num_blocks == 5 and hit.blocks_per_tier() == {"cpu": 5}
    assert tier.delete(own_namespace.id, keys[:1]) == 1
    assert tier.clear(own_namespace.id) == 4
    stats = tier.stats()
    assert stats["errors"] == 0 and stats["hits"] == 5 and stats["misses"] == 1


def test_large_calls_are_split_into_batches(
    shared_server: ThreadServer, make_remote: MakeRemote, own_namespace: Namespace
) -> None:
    tier = make_remote(shared_server.url, max_batch_blocks=2, max_keys=3)
    blocks = make_blocks(own_namespace, 7)
    keys = [b.key for b in blocks]
    assert tier.put_many(own_namespace.id, blocks) == 7
    assert all(tier.get_many(own_namespace.id, keys))
    assert tier.contains_prefix(own_namespace.id, keys) == 7
    assert tier.delete(own_namespace.id, keys) == 7


def test_the_server_limits_are_kept_and_a_short_answer_is_continued(
    make_server: Callable[..., ThreadServer], make_remote: MakeRemote, own_namespace: Namespace
) -> None:
    # 2 KiB blocks: a put batch holds 3 of them, a get answer stops after 8 (one read step).
    server = make_server(max_block_bytes=4096, max_batch_bytes=8192, max_batch_blocks=16)
    tier = make_remote(server.url)
    blocks = make_blocks(own_namespace, 20)
    keys = [b.key for b in blocks]
    assert tier.put_many(own_namespace.id, blocks) == 20
    raw = get_batch_records(server.url, own_namespace.id, keys[:16])
    assert len(raw) == 8  # the leading keys only
    got = tier.get_many(own_namespace.id, keys)
    assert [bytes(g.data) for g in got if g] == [bytes(b.data) for b in blocks]
    assert tier.stats()["errors"] == 0


def test_a_server_that_is_down_gives_misses_then_recovers(
    make_server: Callable[..., ThreadServer], make_remote: MakeRemote, own_namespace: Namespace
) -> None:
    server = make_server()
    tier = make_remote(server.url, failure_threshold=2, backoff_base_s=0.05, backoff_cap_s=0.05)
    blocks = make_blocks(own_namespace, 3)
    keys = [b.key for b in blocks]
    tier.put_many(own_namespace.id, blocks)
    server.stop()
    for _ in range(4):
        assert tier.get_many(own_namespace.id, keys) == [None] * 3
        assert tier.put_many(own_namespace.id, blocks) == 0
        assert tier.contains_prefix(own_namespace.id, keys) == 0
    stats = tier.stats()
    assert stats["errors"] == 2 and stats["skipped"] >= 8 and stats["breaker"]["state"] == "open"
    assert stats["retries"] == 2 * tier.config.retries
    server.start()  # same port, same data folder
    time.sleep(0.06)  # the breaker's backoff
    assert all(tier.get_many(own_namespace.id, keys))
    assert tier.stats()["breaker"]["state"] == "closed"


def test_a_restart_between_put_and_get_loses_nothing(
    make_server: Callable[..., ThreadServer], make_remote: MakeRemote, own_namespace: Namespace
) -> None:
    server = make_server()
    tier = make_remote(server.url)
    blocks = make_blocks(own_namespace, 8)
    tier.put_many(own_namespace.id, blocks)
    server.restart()
    got = tier.get_many(own_namespace.id, [b.key for b in blocks])
    assert [bytes(g.data) for g in got if g] == [bytes(b.data) for b in blocks]


def get_batch_records(url: str, ns: str, keys: list[bytes]) -> list[memoryview | None]:
    body = b'{"keys": [%s]}' % b",".join(b'"%s"' % k.hex().encode() for k in keys)
    status, _, data = call(
        url,
        "POST",
        f"/v1/namespaces/{ns}/batch/get",
        body,
        token=TOKENS["alice"],
        content_type="application/json",
    )
    assert status == 200
    return read_batch(data)


@pytest.fixture
def silent_port() -> Iterator[int]:
    """A port that accepts connections and never answers (a hung server)."""
    with hung_port() as port:
        yield port


def test_a_slow_server_gives_misses_within_the_timeout(
    silent_port: int, make_remote: MakeRemote, own_namespace: Namespace
) -> None:
    tier = make_remote(f"http://127.0.0.1:{silent_port}", timeout_s=0.2, failure_threshold=1)
    keys = [b.key for b in make_blocks(own_namespace, 2)]
    start = time.monotonic()
    assert tier.get_many(own_namespace.id, keys) == [None, None]
    assert time.monotonic() - start < 1.0  # a timeout is not retried
    assert tier.contains_prefix(own_namespace.id, keys) == 0  # breaker open: no wait at all
    stats = tier.stats()
    assert (stats["errors"], stats["retries"], stats["skipped"]) == (1, 0, 1)


def test_a_wrong_token_is_a_counted_error_not_an_exception(
    shared_server: ThreadServer,
    make_remote: MakeRemote,
    own_namespace: Namespace,
    caplog: pytest.LogCaptureFixture,
) -> None:
    tier = RemoteTier(RemoteTierConfig(url=shared_server.url, token="not-a-token-0123456789"))
    claims_bob = make_remote(shared_server.url, token_of="alice", tenant="bob")
    blocks = make_blocks(own_namespace, 1)
    try:
        for t in (tier, claims_bob):
            assert t.put_many(own_namespace.id, blocks) == 0
            assert t.get_many(own_namespace.id, [blocks[0].key]) == [None]
            stats = t.stats()
            assert stats["errors"] == 2 and stats["breaker"]["state"] == "closed"
    finally:
        tier.close()
    assert any("401" in r.getMessage() for r in caplog.records)
    assert any("403" in r.getMessage() for r in caplog.records)


def test_a_record_that_fails_its_checks_is_a_corrupt_miss(
    make_remote: MakeRemote, own_namespace: Namespace
) -> None:
    good, tampered = make_blocks(own_namespace, 2)
    bad = bytearray(b"".join(bytes(memoryview(p)) for p in encode_parts(tampered)))
    bad[-1] ^= 0xFF
    parts, _ = batch_parts([encode_parts(good), [bytes(bad)]])
    answer = b"".join(bytes(memoryview(p)) for p in parts)

    class Tampering(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 - http.server's naming
            self.rfile.read(int(self.headers["Content-Length"]))
            self.send_response(200)
            self.send_header("Content-Type", BATCH_MEDIA_TYPE)
            self.send_header("Content-Length", str(len(answer)))
            self.end_headers()
            self.wfile.write(answer)

        def log_message(self, *args: object) -> None:
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Tampering)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        tier = make_remote(f"http://127.0.0.1:{httpd.server_port}")
        got = tier.get_many(own_namespace.id, [good.key, tampered.key])
    finally:
        httpd.shutdown()
    assert got[0] is not None and bytes(got[0].data) == bytes(good.data)
    assert got[1] is None and tier.stats()["corrupt"] == 1


def test_store_config_stacks_the_remote_tier(
    shared_server: ThreadServer, own_namespace: Namespace
) -> None:
    config = StoreConfig.from_env(
        {
            "CACHETIER_CPU_BYTES": str(1 << 20),
            "CACHETIER_REMOTE_URL": shared_server.url,
            "CACHETIER_REMOTE_TOKEN": TOKENS["alice"],
        }
    )
    assert TOKENS["alice"] not in repr(config)
    blocks = make_blocks(own_namespace, 4)
    keys = [b.key for b in blocks]
    with build_store(config) as engine_a:
        assert [t.name for t in engine_a.tiers] == ["cpu", "remote"]
        engine_a.put_many(own_namespace.id, blocks)
    # Another engine (an empty CPU tier) restores the prefix from the server.
    with build_store(config) as engine_b:
        hit = engine_b.lookup(own_namespace.id, keys)
        assert hit.num_blocks == 4 and hit.blocks_per_tier() == {"remote": 4}
        restored = engine_b.restore_prefix(
            own_namespace.id, keys, fingerprint=own_namespace.fingerprint
        )
        assert restored.sources == ("remote",) * 4
        assert [bytes(b.data) for b in restored.blocks] == [bytes(b.data) for b in blocks]


def test_a_store_says_an_unreachable_server_as_it_starts(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with refusing_port() as port, caplog.at_level(logging.WARNING, logger="cachetier"):
        config = StoreConfig(
            cpu_bytes=1 << 20, remote_url=f"http://127.0.0.1:{port}", remote_token="s3cret-t0ken"
        )
        with build_store(config):
            errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1 and f"127.0.0.1:{port}" in errors[0]
    assert "cannot be reached" in errors[0] and "s3cret" not in caplog.text


def test_connector_config_names_the_server() -> None:
    url = "http://127.0.0.1:8470"  # never reached: the config only names it
    config = ConnectorConfig.from_extra_config(
        {"cpu_bytes": 1 << 20, "remote_url": url, "remote_token": TOKENS["bob"]}
    )
    assert config.has_shared_tier
    store = config.store_config(with_cpu=False)
    assert (store.remote_url, store.remote_token, store.cpu_bytes) == (url, TOKENS["bob"], 0)
    with pytest.raises(ValueError, match="http"):
        ConnectorConfig.from_extra_config({"remote_url": "redis://127.0.0.1:6379"})


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"url": "redis://x:1"}, "http"),
        ({"url": "http://"}, "http"),
        ({"url": "http://h:1", "token": "has space"}, "token"),
        ({"url": "http://h:1", "timeout_s": 0}, "timeout_s"),
        ({"url": "http://h:1", "retries": -1}, "retries"),
        ({"url": "http://h:1", "backoff_base_s": 1, "backoff_cap_s": 0.5}, "cap_s"),
    ],
)
def test_config_rejects_nonsense(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        RemoteTierConfig(**kwargs)
