"""The sidecar over TLS: ``cachetier serve --tls-cert/--tls-key`` as a real subprocess, HTTPS and
a TLS transfer port, and the remote tier verifying them with a CA this session made.

Also what a security reviewer tries: plaintext to the TLS port (no reply, and no token taken
by a client that follows ``/v1/limits``), a client that does not trust the CA, a certificate
for another host name, and handshakes that never complete (they must not hold up accepts).
"""

from __future__ import annotations

import http.client
import json
import logging
import os
import socket
import ssl
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from cachetier.primitives.keys import KVLayout, Namespace
from cachetier.protocol.sockets import accept_tls
from cachetier.protocol.transfer_frames import Status, hello
from cachetier.tiers.remote import RemoteTier, RemoteTierConfig
from cachetier.util.tls import client_context, server_context
from tests.certs import TLSFiles
from tests.server.live import ROOT, TOKENS, ThreadServer, serve_env, test_config
from tests.support import end_process, make_blocks, spawn_serve, wait_ports_file

# 2 layers x K/V x 64 tokens x 2 heads x 64 dims, fp16: 64 KiB per block.
LAYOUT = KVLayout("float16", block_size=64, num_layers=2, num_kv_heads=2, head_dim=64)
NS = Namespace("tls-model", LAYOUT)


class TLSServer:
    """``cachetier serve`` with TLS in a child process, on ports the OS picks (``port`` and
    ``transfer_port`` say which once started), stopped with SIGTERM."""

    def __init__(self, folder: Path, cert: str, key: str, ca: str) -> None:
        self.port = self.transfer_port = 0  # known once started
        self.ports_file = folder / "ports.json"
        self.socket_path = str(folder / "transfer.sock")
        self.ca = ca
        args = ["--port", "0", "--transfer-port", "0", "--ports-file", str(self.ports_file)]
        args += ["--transfer-socket", self.socket_path, "--data-dir", str(folder / "data")]
        args += ["--tls-cert", cert, "--tls-key", key, "--log-level", "warning"]
        env = serve_env()
        self.proc = spawn_serve(args, env)
        self.stderr = ""

    @property
    def url(self) -> str:
        return f"https://127.0.0.1:{self.port}"

    def get(self, path: str, *, context: ssl.SSLContext | None = None) -> tuple[int, bytes]:
        """One HTTPS GET, verified against the CA unless another context is given."""
        conn = http.client.HTTPSConnection(
            "127.0.0.1", self.port, timeout=5, context=context or client_context(self.ca)
        )
        try:
            conn.request("GET", path)
            resp = conn.getresponse()
            return resp.status, resp.read()
        finally:
            conn.close()

    def wait_started(self, timeout_s: float = 30) -> TLSServer:
        """Until ``/healthz`` answers over HTTPS (with no verification: the wrong-host server
        must start too)."""
        unverified = client_context(verify=False)
        deadline = time.monotonic() + timeout_s
        try:
            ports = wait_ports_file(self.ports_file, timeout_s=timeout_s, proc=self.proc)
        except RuntimeError as exc:
            raise RuntimeError(f"cachetier serve with TLS did not start: {exc}") from None
        self.port, self.transfer_port = ports["http"], ports["transfer"]
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"cachetier serve exited:\n{self.stop()}")
            try:
                if self.get("/healthz", context=unverified)[0] == 200:
                    return self
            except OSError:
                pass
            time.sleep(0.05)
        raise RuntimeError(f"cachetier serve with TLS did not start:\n{self.stop()}")

    def stop(self) -> str:
        self.stderr += end_process(self.proc)[1]
        return self.stderr


@pytest.fixture(scope="module")
def tls_server(
    tmp_path_factory: pytest.TempPathFactory, tls_files: TLSFiles
) -> Iterator[TLSServer]:
    folder = tmp_path_factory.mktemp("tls-server")
    server = TLSServer(folder, tls_files.cert, tls_files.key, tls_files.ca).wait_started()
    yield server
    server.stop()


MakeTier = Callable[..., RemoteTier]


@pytest.fixture
def make_tier() -> Iterator[MakeTier]:
    opened: list[RemoteTier] = []

    def make(url: str, **options: object) -> RemoteTier:
        options.setdefault("token", TOKENS["alice"])
        options.setdefault("timeout_s", 2.0)
        tier = RemoteTier(RemoteTierConfig(url=url, **options))  # type: ignore[arg-type]
        opened.append(tier)
        return tier

    yield make
    for tier in opened:
        tier.close()


def test_limits_say_the_transfer_port_speaks_tls(tls_server: TLSServer) -> None:
    status, body = tls_server.get("/v1/limits")
    limits = json.loads(body)
    assert status == 200
    assert limits["transfer_port"] == tls_server.transfer_port
    assert limits["transfer_tls"] is True


def test_the_remote_tier_verifies_and_uses_tls_for_http_and_the_transfer_port(
    tls_server: TLSServer, tls_files: TLSFiles, make_tier: MakeTier
) -> None:
    blocks = make_blocks(NS, 10)
    keys = [b.key for b in blocks]
    # transfer_socket off: the TCP port, which must then speak TLS.
    tier = make_tier(tls_server.url, ca_file=tls_files.ca, transfer_socket=False)
    assert tier.put_many(NS.id, blocks) == 10
    dests = [memoryview(bytearray(len(b.data))) for b in blocks]
    got = tier.get_into(NS.id, keys, dests)
    assert all(g is not None for g in got)
    assert [bytes(d) for d in dests] == [b.data for b in blocks]
    stats = tier.stats()
    assert stats["transfer"] == f"tls:127.0.0.1:{tls_server.transfer_port}"
    assert (stats["puts"], stats["hits"], stats["errors"], stats["tls_failures"]) == (10, 10, 0, 0)
    # HTTP: lookups, and gets over HTTP with transfers off.
    assert tier.lookup(NS.id, keys).num_blocks == 10
    http_only = make_tier(tls_server.url, ca_file=tls_files.ca, transfer=False)
    assert [g.data for g in http_only.get_many(NS.id, keys) if g] == [b.data for b in blocks]
    assert http_only.stats()["transfer"] is None


def test_the_unix_socket_stays_plaintext_beside_a_tls_port(
    tls_server: TLSServer, tls_files: TLSFiles, make_tier: MakeTier
) -> None:
    blocks = make_blocks(NS, 3, seed=1)
    tier = make_tier(tls_server.url, ca_file=tls_files.ca)
    assert tier.put_many(NS.id, blocks) == 3
    assert all(g is not None for g in tier.get_many(NS.id, [b.key for b in blocks]))
    assert tier.stats()["transfer"] == f"unix:{tls_server.socket_path}"


def test_the_transfer_port_takes_no_plaintext(tls_server: TLSServer) -> None:
    with socket.create_connection(("127.0.0.1", tls_server.transfer_port), timeout=5) as sock:
        try:
            sock.sendall(hello(TOKENS["alice"], None))
            sock.shutdown(socket.SHUT_WR)
        except OSError:
            pass  # the server saw no TLS handshake and dropped us already: no answer either
        answer = b""
        try:
            while chunk := sock.recv(4096):
                answer += chunk
        except ConnectionResetError:
            pass  # closed with unread bytes of ours: also no answer
    # Nothing, or a TLS alert record (type 21): never a transfer reply, let alone an OK.
    assert answer == b"" or answer[:1] == b"\x15", answer[:40]
    assert not answer.startswith(bytes([Status.OK]))
    # Plain HTTP to the HTTPS port: no answer either.
    conn = http.client.HTTPConnection("127.0.0.1", tls_server.port, timeout=5)
    with pytest.raises((OSError, http.client.HTTPException)):
        conn.request("GET", "/v1/limits")
        conn.getresponse().read()
    conn.close()


def test_a_client_without_the_ca_gets_misses_and_counted_errors(
    tls_server: TLSServer, make_tier: MakeTier, caplog: pytest.LogCaptureFixture
) -> None:
    blocks = make_blocks(NS, 2, seed=2)
    keys = [b.key for b in blocks]
    tier = make_tier(tls_server.url, transfer_socket=False)  # the system's CAs only
    with caplog.at_level(logging.DEBUG):
        assert tier.put_many(NS.id, blocks) == 0
        assert tier.get_many(NS.id, keys) == [None, None]
        assert tier.lookup(NS.id, keys).num_blocks == 0
    stats = tier.stats()
    assert stats["errors"] >= 3 and stats["tls_failures"] >= 3
    assert stats["retries"] == 0  # a certificate that does not verify is not retried
    warnings = [r for r in caplog.records if "TLS with the cachetier server" in r.message]
    assert len(warnings) == 1  # once per interval, not per call
    assert TOKENS["alice"] not in caplog.text


def test_a_certificate_for_another_host_fails_verification(
    tmp_path: Path, tls_files: TLSFiles, make_tier: MakeTier
) -> None:
    server = TLSServer(
        tmp_path, tls_files.wrong_host_cert, tls_files.wrong_host_key, tls_files.ca
    ).wait_started()
    try:
        blocks = make_blocks(NS, 2, seed=3)
        tier = make_tier(server.url, ca_file=tls_files.ca, transfer_socket=False)
        assert tier.put_many(NS.id, blocks) == 0
        assert tier.get_many(NS.id, [b.key for b in blocks]) == [None, None]
        assert tier.stats()["tls_failures"] >= 2
        # The same through the port directly: its certificate names another host too.
        with pytest.raises(ssl.SSLCertVerificationError, match="match|mismatch"):
            socket_tls = client_context(tls_files.ca).wrap_socket(
                socket.create_connection(("127.0.0.1", server.transfer_port), timeout=5),
                server_hostname="127.0.0.1",
            )
            socket_tls.close()
    finally:
        server.stop()


def test_stalled_handshakes_do_not_hold_up_accepts(
    tls_server: TLSServer, tls_files: TLSFiles, make_tier: MakeTier
) -> None:
    stalled = [
        socket.create_connection(("127.0.0.1", tls_server.transfer_port), timeout=5)
        for _ in range(8)
    ]
    try:
        stalled[0].sendall(b"\x16\x03\x01\x02\x00\x01")  # the start of a ClientHello, no more
        blocks = make_blocks(NS, 2, seed=4)
        tier = make_tier(tls_server.url, ca_file=tls_files.ca, transfer_socket=False)
        start = time.monotonic()
        assert tier.put_many(NS.id, blocks) == 2
        assert all(g is not None for g in tier.get_many(NS.id, [b.key for b in blocks]))
        assert time.monotonic() - start < 2.0
        assert tier.stats()["transfer"].startswith("tls:")
    finally:
        for sock in stalled:
            sock.close()


@pytest.mark.parametrize("trickle", [False, True])
def test_a_handshake_has_one_deadline_however_the_client_trickles(
    tls_files: TLSFiles, trickle: bool
) -> None:
    context = server_context(tls_files.cert, tls_files.key)
    server, client = socket.socketpair()
    stop = threading.Event()

    def drip() -> None:
        # A record head announcing 16 KiB of ClientHello, then a byte of it every 50 ms: each
        # read is quick, the handshake never ends.
        client.sendall(b"\x16\x03\x01\x40\x00")
        while not stop.wait(0.05):
            try:
                client.send(b"\x01")
            except OSError:
                return

    if trickle:
        threading.Thread(target=drip, daemon=True).start()
    start = time.monotonic()
    try:
        with pytest.raises(TimeoutError):
            accept_tls(server, context, time.monotonic() + 0.5)
        assert 0.4 < time.monotonic() - start < 1.5
    finally:
        stop.set()
        server.close()
        client.close()


def test_tls_settings_are_checked(tls_files: TLSFiles) -> None:
    with pytest.raises(ValueError, match="not https"):
        RemoteTierConfig(url="http://127.0.0.1:1", ca_file=tls_files.ca)
    with pytest.raises(ValueError, match="credentials"):
        RemoteTierConfig(url="https://user:pw-in-url-9@127.0.0.1:1")
    with pytest.raises(ValueError, match="CA bundle"):
        RemoteTier(RemoteTierConfig(url="https://127.0.0.1:1", ca_file="/nonexistent/ca.pem"))
    from cachetier.server.config import ServerConfig

    with pytest.raises(ValueError, match="tls_cert and tls_key"):
        ServerConfig(open_mode=True, tls_cert=tls_files.cert)


def test_serve_refuses_a_certificate_it_cannot_load(tmp_path: Path, tls_files: TLSFiles) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "cachetier.cli.main", "serve", "--open", "--port", "0"]
        + ["--data-dir", str(tmp_path), "--tls-cert", str(tmp_path / "missing.pem")]
        + ["--tls-key", tls_files.key],
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert "cannot load the TLS certificate" in done.stderr


class TLSFront:
    """A TLS-terminating proxy (as a load balancer would be) in front of a plain HTTP port:
    the server behind it has a plaintext transfer port, which ``/v1/limits`` names."""

    def __init__(self, target_port: int, tls: TLSFiles) -> None:
        self._target = target_port
        self._context = server_context(tls.cert, tls.key)
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            front = self._context.wrap_socket(conn, server_side=True)
            back = socket.create_connection(("127.0.0.1", self._target))
        except OSError:
            conn.close()
            return
        threading.Thread(target=_pipe, args=(back, front), daemon=True).start()
        _pipe(front, back)

    def close(self) -> None:
        self._listener.close()


def _pipe(src: socket.socket, dst: socket.socket) -> None:
    try:
        while data := src.recv(65536):
            dst.sendall(data)
    except OSError:
        pass
    finally:
        for sock in (src, dst):
            try:
                sock.close()
            except OSError:
                pass


def test_an_https_tier_never_sends_its_token_to_a_plaintext_port(
    tmp_path: Path, tls_files: TLSFiles, make_tier: MakeTier
) -> None:
    server = ThreadServer(test_config(tmp_path / "plain", transfer_port=0)).start()
    front = TLSFront(server.config.port, tls_files)
    try:
        url = f"https://127.0.0.1:{front.port}"
        conn = http.client.HTTPSConnection(
            "127.0.0.1", front.port, timeout=5, context=client_context(tls_files.ca)
        )
        conn.request("GET", "/v1/limits")
        limits = json.loads(conn.getresponse().read())
        conn.close()
        assert limits["transfer_port"] == server.config.transfer_port
        assert limits["transfer_tls"] is False
        tier = make_tier(url, ca_file=tls_files.ca, transfer_socket=False)
        blocks = make_blocks(NS, 3, seed=5)
        assert tier.put_many(NS.id, blocks) == 3
        assert all(g is not None for g in tier.get_many(NS.id, [b.key for b in blocks]))
        # Everything went over HTTPS: no transfer client was made for the plaintext port.
        assert tier.stats()["transfer"] is None
    finally:
        front.close()
        server.stop()


def test_tls_verify_off_still_encrypts_but_trusts_anyone(
    tls_server: TLSServer, make_tier: MakeTier
) -> None:
    blocks = make_blocks(NS, 2, seed=6)
    tier = make_tier(tls_server.url, tls_verify=False, transfer_socket=False)
    assert tier.put_many(NS.id, blocks) == 2
    assert all(g is not None for g in tier.get_many(NS.id, [b.key for b in blocks]))
    assert tier.stats()["transfer"] == f"tls:127.0.0.1:{tls_server.transfer_port}"
