"""Secrets never printed: a real ``cachetier serve`` with a password in its Redis URL and known
tokens, driven through puts, gets, bad tokens, a Redis that refuses its password and one that
is gone; then everything it and the code around it printed is searched for those secrets.

Searched: both servers' stdout and stderr (log level debug, the config echo), ``/v1/stats``,
``/metrics``, ``/v1/limits``, the answers to bad tokens (HTTP and transfer port), every log
record of this process, the repr of every config object, and the messages of errors raised
for bad URLs and failed connections. Reported as ``secrets_printed`` (must be 0).
"""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import threading
from pathlib import Path
from urllib.parse import quote

import pytest
from redis import exceptions as redis_exceptions

from cachetier.connectors.config import ConnectorConfig
from cachetier.primitives.keys import KVLayout, Namespace
from cachetier.protocol.transfer_frames import hello
from cachetier.server.config import load_config
from cachetier.store.config import StoreConfig
from cachetier.tiers.redis import RedisTier, RedisTierConfig, make_client, parse_cluster_url
from cachetier.tiers.redis.resp import Endpoint, RespConnection
from cachetier.tiers.remote import RemoteTier, RemoteTierConfig
from tests.server.live import ROOT, call, wait_healthy
from tests.support import (
    PrivateRedis,
    end_process,
    make_blocks,
    refusing_port,
    spawn_serve,
    wait_ports_file,
)

REDIS_PASSWORD = "redis-pass-Qx81Zr"
WRONG_PASSWORD = "wrong-pass-Lm27Vt"
URL_PASSWORD = "url-pass-Hd55Kc"
ALICE_TOKEN = "alice-secret-token-4f9e2b71c0"
OPS_TOKEN = "ops-secret-token-8a1d6c39e2"
BAD_TOKEN = "bad-secret-token-0b7c5e1a94"
SECRETS = (REDIS_PASSWORD, WRONG_PASSWORD, URL_PASSWORD, ALICE_TOKEN, OPS_TOKEN, BAD_TOKEN)
LAYOUT = KVLayout("float16", block_size=16, num_layers=2, num_kv_heads=2, head_dim=8)
NS = Namespace("secrets-model", LAYOUT)


class Sidecar:
    """``cachetier serve`` in a child process whose only tier is Redis (every put and get
    goes through it), at log level debug."""

    def __init__(self, folder: Path, redis_url: str, *, url_in_env: bool) -> None:
        ports_file = folder.parent / f"{folder.name}-ports.json"
        args = ["--port", "0", "--transfer-port", "0", "--ports-file", str(ports_file)]
        args += ["--data-dir", str(folder), "--log-level", "debug"]
        env = {
            **os.environ,
            "PYTHONPATH": str(ROOT),
            "CACHETIER_TENANTS": f"alice:{ALICE_TOKEN},ops:{OPS_TOKEN}",
            "CACHETIER_ADMIN_TENANTS": "ops",
            "CACHETIER_CPU_BYTES": "0",
            "CACHETIER_DISK_BYTES": "0",
            "CACHETIER_REDIS_KEY_PREFIX": f"secrets-{os.getpid()}",
        }
        if url_in_env:
            env["CACHETIER_REDIS_URL"] = redis_url
        else:
            args += ["--redis-url", redis_url]
        self.proc = spawn_serve(args, env)
        self.output = ""
        try:
            ports = wait_ports_file(ports_file, self.proc)
            self.port, self.transfer_port = ports["http"], ports["transfer"]
            wait_healthy(self.url, proc=self.proc)
        except RuntimeError:
            raise RuntimeError(f"cachetier serve did not start:\n{self.stop()}") from None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self) -> str:
        """SIGTERM, then everything it printed."""
        out, err = end_process(self.proc)
        self.output += out + err
        return self.output


def _exercise(server: Sidecar, printed: dict[str, str], label: str) -> None:
    """Puts and gets over the transfer port and HTTP, bad tokens on both, and the three
    read-only endpoints; what came back goes into ``printed``."""
    blocks = make_blocks(NS, 6)
    keys = [b.key for b in blocks]
    for transfer in (True, False):
        tier = RemoteTier(
            RemoteTierConfig(url=server.url, token=ALICE_TOKEN, transfer=transfer, timeout_s=2)
        )
        try:
            tier.put_many(NS.id, blocks)
            tier.get_many(NS.id, keys)
            tier.lookup(NS.id, keys)
            printed[f"{label} tier stats transfer={transfer}"] = repr(tier.stats())
        finally:
            tier.close()
    bad = RemoteTier(RemoteTierConfig(url=server.url, token=BAD_TOKEN, timeout_s=2))
    try:
        bad.get_many(NS.id, keys)
        bad.put_many(NS.id, blocks)
        printed[f"{label} bad tier stats"] = repr(bad.stats())
    finally:
        bad.close()
    status, headers, body = call(server.url, "GET", "/v1/stats", token=BAD_TOKEN)
    printed[f"{label} bad token answer"] = f"{status} {headers} {body!r}"
    with socket.create_connection(("127.0.0.1", server.transfer_port), timeout=5) as sock:
        sock.sendall(hello(BAD_TOKEN, None))
        sock.shutdown(socket.SHUT_WR)
        printed[f"{label} bad token transfer answer"] = repr(sock.recv(4096))
    for path in ("/v1/stats", "/metrics", "/v1/limits"):
        status, _, body = call(server.url, "GET", path, token=OPS_TOKEN)
        assert status == 200, (path, body[:200])
        printed[f"{label} {path}"] = body.decode()


def _configs_and_errors(redis: PrivateRedis, printed: dict[str, str]) -> None:
    with refusing_port() as closed_port, refusing_port() as down_port:
        """The repr of every config object, and the messages of errors about URLs and connects."""
        url = f"redis://:{REDIS_PASSWORD}@127.0.0.1:{redis.port}/0"
        env = {"CACHETIER_TENANTS": f"alice:{ALICE_TOKEN},ops:{OPS_TOKEN}"}
        server_config = load_config(env=env, redis_url=url, data_dir="/tmp/x", disk_bytes=0)
        redis_config = RedisTierConfig(url=url)
        remote_config = RemoteTierConfig(url="http://127.0.0.1:1", token=ALICE_TOKEN)
        cluster = parse_cluster_url(f"rediss+cluster://me:{REDIS_PASSWORD}@10.0.0.1:7000,10.0.0.2")
        endpoint = Endpoint.from_url(url, 0.2, 0.2)
        objects = {
            "ServerConfig": server_config,
            "ServerConfig.describe": server_config.describe(),
            "StoreConfig": server_config.store,
            "StoreConfig.from_env": StoreConfig.from_env(
                {"CACHETIER_REMOTE_URL": "http://h:1", "CACHETIER_REMOTE_TOKEN": ALICE_TOKEN},
                redis_url=url,
            ),
            "RedisTierConfig": redis_config,
            "RemoteTierConfig": remote_config,
            "ClusterAddress": cluster,
            "Endpoint": endpoint,
            # vLLM logs its kv_transfer_config, and so the connector's config with it.
            "ConnectorConfig": ConnectorConfig.from_extra_config(
                {"redis_url": url, "remote_url": "http://127.0.0.1:1", "remote_token": ALICE_TOKEN}
            ),
        }
        for name, obj in objects.items():
            printed[f"repr {name}"] = f"{obj!r} {obj!s}"
        bad_urls = [
            lambda: RedisTierConfig(url=f"redis://:{URL_PASSWORD}@127.0.0.1:99999/0"),
            lambda: RedisTierConfig(url=f"redis://:{URL_PASSWORD}@127.0.0.1:6379/x"),
            lambda: RedisTierConfig(url=f"redis://:{URL_PASSWORD}@127.0.0.1:6379/0?ssl=true"),
            lambda: RedisTierConfig(url=f"rediss+cluster://u:{URL_PASSWORD}@h:1/3"),
            lambda: RemoteTierConfig(url=f"https://user:{URL_PASSWORD}@127.0.0.1:1"),
            lambda: RemoteTierConfig(url=f"ftp://user:{URL_PASSWORD}@127.0.0.1:1"),
            lambda: StoreConfig(cpu_bytes=0, redis_url=None, remote_url=None),
        ]
        bad_urls.append(lambda: load_config(env={"CACHETIER_TENANTS": f"alice={ALICE_TOKEN}"}))
        for i, make in enumerate(bad_urls):
            with pytest.raises(ValueError) as caught:
                make()
            printed[f"bad url {i}"] = f"{caught.value} {caught.value!r}"
        # Failed connects: a closed port, with the password in the URL.
        closed = f"redis://:{REDIS_PASSWORD}@127.0.0.1:{closed_port}/0"
        with pytest.raises(OSError) as refused:
            RespConnection(Endpoint.from_url(closed, 0.2, 0.2))
        printed["RespConnection refused"] = f"{refused.value} {refused.value!r}"
        client = make_client(RedisTierConfig(url=closed, connect_timeout_s=0.2))
        with pytest.raises(redis_exceptions.ConnectionError) as refused_py:
            client.ping()
        client.close()
        printed["redis-py refused"] = f"{refused_py.value} {refused_py.value!r}"
        tier = RedisTier(RedisTierConfig(url=closed, key_prefix="secrets", failure_threshold=100))
        try:
            tier.get_many(NS.id, [b.key for b in make_blocks(NS, 2)])
            tier.contains_prefix(NS.id, [b.key for b in make_blocks(NS, 2)])
            printed["RedisTier unreachable stats"] = repr(tier.stats())
        finally:
            tier.close()
        remote = RemoteTier(RemoteTierConfig(url=f"http://127.0.0.1:{down_port}", token=OPS_TOKEN))
        try:
            remote.get_many(NS.id, [b.key for b in make_blocks(NS, 2)])
            printed["RemoteTier unreachable stats"] = repr(remote.stats())
        finally:
            remote.close()
        # A server answering garbage: aiohttp's error then carries the request's headers, the
        # Authorization one included, and the tier logs it (debug).
        with socket.create_server(("127.0.0.1", 0)) as liar:
            threading.Thread(target=_answer_garbage, args=(liar,), daemon=True).start()
            url = f"http://127.0.0.1:{liar.getsockname()[1]}"
            remote = RemoteTier(RemoteTierConfig(url=url, token=ALICE_TOKEN, retries=0))
            try:
                remote.get_many(NS.id, [b.key for b in make_blocks(NS, 2)])
                printed["RemoteTier garbage stats"] = repr(remote.stats())
            finally:
                remote.close()


def _answer_garbage(listener: socket.socket) -> None:
    while True:
        try:
            conn, _ = listener.accept()
        except OSError:
            return
        with conn:
            conn.recv(65536)
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: abc\r\n\r\n{}")


def _bad_configs(printed: dict[str, str]) -> None:
    """``cachetier serve`` refusing configurations that hold secrets: what it prints."""
    bad = {
        "tenant without ':'": ({"CACHETIER_TENANTS": f"alice={ALICE_TOKEN}"}, []),
        "redis url with a bad port": (
            {"CACHETIER_TENANTS": f"alice:{ALICE_TOKEN}"},
            ["--redis-url", f"redis://:{URL_PASSWORD}@127.0.0.1:99999/0"],
        ),
        "redis url with ?ssl=true": (
            {"CACHETIER_TENANTS": f"alice:{ALICE_TOKEN}"},
            ["--redis-url", f"redis://:{URL_PASSWORD}@127.0.0.1:6379/0?ssl=true"],
        ),
    }
    for name, (env, args) in bad.items():
        done = subprocess.run(
            [sys.executable, "-m", "cachetier.cli.main", "serve", "--port", "0", *args],
            env={**os.environ, "PYTHONPATH": str(ROOT), **env},
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 2, (name, done.stderr[-2000:])
        printed[f"serve refusing a {name}"] = done.stdout + done.stderr


def test_no_secret_is_printed(
    tmp_path: Path, fault_figures, caplog: pytest.LogCaptureFixture
) -> None:
    redis = PrivateRedis(tmp_path, password=REDIS_PASSWORD)
    redis.start()
    printed: dict[str, str] = {}
    try:
        with caplog.at_level(logging.DEBUG):
            good = Sidecar(
                tmp_path / "good",
                f"redis://:{REDIS_PASSWORD}@127.0.0.1:{redis.port}/0",
                url_in_env=False,
            )
            wrong = Sidecar(
                tmp_path / "wrong",
                f"redis://:{WRONG_PASSWORD}@127.0.0.1:{redis.port}/0",
                url_in_env=True,
            )
            try:
                _exercise(good, printed, "good")
                _exercise(wrong, printed, "wrong password")
                redis.stop()  # now unreachable, password and all
                _exercise(good, printed, "redis gone")
            finally:
                printed["good server output"] = good.stop()
                printed["wrong server output"] = wrong.stop()
            _configs_and_errors(redis, printed)
            _bad_configs(printed)
    finally:
        redis.stop()
    printed["this process's log records"] = caplog.text

    leaks = {
        source: n
        for source, text in printed.items()
        if (n := sum(text.count(form) for s in SECRETS for form in {s, quote(s, safe="")}))
    }
    fault_figures.add("secrets_printed", sum(leaks.values()))
    # The searched text is what the checks above claim it is: the config echo, the Redis tier
    # at work (and refused), the bad tokens refused.
    good_out, wrong_out = printed["good server output"], printed["wrong server output"]
    assert f"redis://:***@127.0.0.1:{redis.port}/0" in good_out
    assert "refuses the tier's credentials" in wrong_out
    assert "redis://:***@" in wrong_out
    assert (
        '"redis"' in printed["good /v1/stats"] and "cachetier_tier_hits" in printed["good /metrics"]
    )
    assert "refused a request" in printed["this process's log records"]
    assert "'Authorization': 'Bearer ***'" in printed["this process's log records"]
    assert "401" in printed["good bad token answer"]
    assert "token" in printed["good bad token transfer answer"]
    assert not leaks, f"secrets printed in: {sorted(leaks)}"
