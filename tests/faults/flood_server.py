"""Shared pieces of the flood tests (``test_floods.py``): a real ``cachetier serve`` child process
under a descriptor limit of the test's choosing, raw sockets that connect and say nothing (or
half a TLS ClientHello), and probes that ask each listener to serve one real request.

Everything runs on 127.0.0.1; the server is told its ports by the OS (``--port 0
--ports-file``).
"""

from __future__ import annotations

import http.client
import os
import resource
import socket
import ssl
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

from cachetier.primitives.keys import Namespace
from cachetier.protocol.transfer_frames import KEY_BYTES, REPLY, Op, Status, hello, request
from cachetier.tiers.remote import RemoteTier, RemoteTierConfig
from cachetier.util.tls import client_context
from tests.certs import TLSFiles
from tests.server.live import TOKENS, serve_env
from tests.support import end_process, make_blocks, wait_ports_file

PROBE_TIMEOUT_S = 2.0  # one probe's connect, handshake, request and answer


class FloodServer:
    """``cachetier serve`` (disk tier, the three tenants of ``TOKENS``, a transfer port, HTTPS
    and TLS on the transfer port when given certificates) in a child process.

    Args:
        folder: the test's own folder (data, ports file).
        tls: certificates to serve TLS with; ``None`` for plaintext.
        nofile: the child's ``RLIMIT_NOFILE`` (soft and hard), ``None`` to inherit this one's.
        settings: ``ServerConfig`` fields, set through ``CACHETIER_<FIELD>`` variables.
    """

    def __init__(
        self,
        folder: Path,
        *,
        tls: TLSFiles | None = None,
        nofile: int | None = None,
        settings: dict[str, object] | None = None,
    ) -> None:
        self.folder = folder
        self.tls = tls
        self.nofile = nofile
        self.settings = settings or {}
        self.port = self.transfer_port = 0  # known once started
        self.proc: subprocess.Popen[str] | None = None
        self.stderr = ""

    @property
    def scheme(self) -> str:
        return "https" if self.tls is not None else "http"

    @property
    def url(self) -> str:
        return f"{self.scheme}://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        assert self.proc is not None, "not started"
        return self.proc.pid

    def client_tls(self) -> ssl.SSLContext | None:
        """A client context that trusts the test CA (``None`` without TLS)."""
        return None if self.tls is None else client_context(self.tls.ca)

    def start(self, timeout_s: float = 30) -> FloodServer:
        ports_file = self.folder / "ports.json"
        args = ["--port", "0", "--transfer-port", "0", "--ports-file", str(ports_file)]
        args += ["--data-dir", str(self.folder / "data"), "--log-level", "warning"]
        if self.tls is not None:
            args += ["--tls-cert", self.tls.cert, "--tls-key", self.tls.key]
        env = serve_env(**self.settings)
        limit = self.nofile

        def set_limit() -> None:  # in the child, before exec
            if limit is not None:
                resource.setrlimit(resource.RLIMIT_NOFILE, (limit, limit))

        self.proc = subprocess.Popen(
            [sys.executable, "-m", "cachetier.cli.main", "serve", *args],
            env=env,
            stdout=subprocess.DEVNULL,  # it prints its configuration: nothing to read there
            stderr=subprocess.PIPE,
            text=True,
            preexec_fn=set_limit,
        )
        try:
            ports = wait_ports_file(ports_file, self.proc, timeout_s=timeout_s)
            self.port, self.transfer_port = ports["http"], ports["transfer"]
            deadline = time.monotonic() + timeout_s
            while not http_serves(self):
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("cachetier serve did not answer")
                time.sleep(0.05)
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> str:
        """SIGTERM (SIGKILL if it lingers); returns what it wrote on stderr."""
        if self.proc is not None:
            self.stderr += end_process(self.proc)[1]
        return self.stderr

    def num_fds(self) -> int:
        """Descriptors the server process holds now."""
        return len(os.listdir(f"/proc/{self.pid}/fd"))

    def rss_mib(self) -> float:
        """The server's resident memory now (``VmRSS``), in MiB."""
        with open(f"/proc/{self.pid}/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
        raise AssertionError("no VmRSS in /proc/<pid>/status")

    def get(self, path: str, token: str | None = None) -> tuple[int, bytes]:
        """One request on a fresh connection (a new TLS handshake with TLS)."""
        conn: http.client.HTTPConnection
        if self.tls is None:
            conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=PROBE_TIMEOUT_S)
        else:
            conn = http.client.HTTPSConnection(
                "127.0.0.1", self.port, timeout=PROBE_TIMEOUT_S, context=self.client_tls()
            )
        headers = {} if token is None else {"Authorization": f"Bearer {token}"}
        try:
            conn.request("GET", path, headers=headers)
            resp = conn.getresponse()
            return resp.status, resp.read()
        finally:
            conn.close()

    def metric_sum(self, name: str) -> float:
        """The sum of a metric's samples over its labels (read as the admin tenant)."""
        status, body = self.get("/metrics", token=TOKENS["ops"])
        assert status == 200, body[:200]
        total = 0.0
        for line in body.decode().splitlines():
            if line.startswith((name + "{", name + " ", name + "_total")):
                total += float(line.rsplit(" ", 1)[1])
        return total


def remote_tier(server: FloodServer, tenant: str, *, transfer: bool) -> RemoteTier:
    """A real client of ``tenant`` (over the transfer port, or HTTP alone)."""
    config = RemoteTierConfig(
        url=server.url,
        token=TOKENS[tenant],
        timeout_s=2.0,
        transfer=transfer,
        ca_file=None if server.tls is None else server.tls.ca,
    )
    return RemoteTier(config)


def puts_and_gets(tier: RemoteTier, ns: Namespace, seed: int, count: int = 8) -> tuple[int, int]:
    """Put ``count`` blocks and get them back; returns (operations that succeeded, operations):
    a put counts if stored, a get if it returned the very bytes put."""
    blocks = make_blocks(ns, count, seed=seed)
    stored = tier.put_many(ns.id, blocks)
    got = tier.get_many(ns.id, [b.key for b in blocks])
    right = sum(g is not None and bytes(g.data) == bytes(b.data) for g, b in zip(got, blocks))
    return stored + right, 2 * count


def http_serves(server: FloodServer, token: str = TOKENS["alice"]) -> bool:
    """Whether the HTTP port accepts a new connection and answers an authenticated request."""
    try:
        return server.get("/v1/stats", token=token)[0] == 200
    except (OSError, http.client.HTTPException):
        return False


def transfer_serves(server: FloodServer, namespace: str, token: str = TOKENS["alice"]) -> bool:
    """Whether the transfer port accepts a new connection, takes a hello with a token, and
    answers a GET of one key (a miss or a hit, either is an answer)."""
    try:
        raw = socket.create_connection(("127.0.0.1", server.transfer_port), PROBE_TIMEOUT_S)
    except OSError:
        return False
    sock: socket.socket = raw
    try:
        context = server.client_tls()
        if context is not None:
            sock = context.wrap_socket(raw, server_hostname="127.0.0.1")
        sock.sendall(hello(token, None))
        head = _read_exactly(sock, REPLY.size)  # OK with the server's id, nothing after
        if head is None or REPLY.unpack(head)[0] != Status.OK:
            return False
        sock.sendall(request(Op.GET, namespace, 1) + bytes(KEY_BYTES))
        head = _read_exactly(sock, REPLY.size)
        if head is None:
            return False
        status, count = REPLY.unpack(head)
        return status == Status.OK and count == 1 and _read_exactly(sock, 8) is not None
    except OSError:
        return False
    finally:
        sock.close()


def _read_exactly(sock: socket.socket, nbytes: int) -> bytes | None:
    out = b""
    while len(out) < nbytes:
        chunk = sock.recv(nbytes - len(out))
        if not chunk:
            return None
        out += chunk
    return out


def wait_until(check: Callable[[], bool], timeout_s: float, every_s: float = 0.1) -> bool:
    """Poll ``check`` until it holds or ``timeout_s`` passes; returns whether it held."""
    deadline = time.monotonic() + timeout_s
    while True:
        if check():
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(every_s)


def client_hello() -> bytes:
    """The first flight of a real TLS client (its ClientHello), as it goes on the wire."""
    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    tls = context.wrap_bio(incoming, outgoing, server_hostname="flood.invalid")
    try:
        tls.do_handshake()
    except ssl.SSLWantReadError:
        pass
    data = outgoing.read()
    assert data[:1] == b"\x16", "a TLS handshake record"
    return data


class Flood:
    """Connections a client without a token opens and holds; every one closed by ``close``.

    Args:
        port: where to connect.
        first_bytes: what each connection sends after its connect, given its index (``b""``:
            nothing).
    """

    def __init__(self, port: int, first_bytes: Callable[[int], bytes] = lambda _: b"") -> None:
        self.port = port
        self._first_bytes = first_bytes
        self.socks: list[socket.socket] = []
        self.num_failed = 0  # connects that failed or timed out (the accept queue full)

    def open(self, count: int, connect_timeout_s: float = 0.2) -> int:
        """Open up to ``count`` more; returns how many opened."""
        opened = 0
        for _ in range(count):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.settimeout(connect_timeout_s)
            try:
                sock.connect(("127.0.0.1", self.port))
                data = self._first_bytes(len(self.socks))
                if data:
                    sock.sendall(data)
            except OSError:
                sock.close()
                self.num_failed += 1
                continue
            self.socks.append(sock)
            opened += 1
        return opened

    def num_closed_by_server(self) -> int:
        """Of the held connections, how many the server has ended (end of stream or reset)."""
        closed = 0
        for sock in self.socks:
            sock.setblocking(False)
            try:
                while chunk := sock.recv(65536):  # what a server wrote (a ServerHello) is read
                    del chunk
                closed += 1
            except BlockingIOError:
                pass
            except OSError:
                closed += 1
        return closed

    def close(self) -> None:
        for sock in self.socks:
            sock.close()
        self.socks = []


class Monopoly:
    """A tenant's keep-alive connections, each with one authenticated request answered, held
    open; ``keep_opening`` goes on opening more in a thread until ``close``.

    Args:
        port: the HTTP port.
        tenant: whose token the requests show (``TOKENS``).
    """

    def __init__(self, port: int, tenant: str) -> None:
        self.port = port
        self.socks: list[socket.socket] = []
        self.num_opened = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="monopoly", daemon=True)
        self._request = (
            b"GET /v1/stats HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
            + TOKENS[tenant].encode()
            + b"\r\n\r\n"
        )

    def open(self, count: int) -> None:
        for _ in range(count):
            try:
                sock = socket.create_connection(("127.0.0.1", self.port), timeout=2)
                sock.sendall(self._request)
                answer = sock.recv(4096)  # one read: the head of a small answer, kept alive
            except OSError:
                continue
            if answer.startswith(b"HTTP/1.1 200"):
                self.socks.append(sock)
                self.num_opened += 1
            else:
                sock.close()

    def num_held(self) -> int:
        """Of the connections held, how many the server has not closed."""
        held = 0
        for sock in self.socks:
            sock.setblocking(False)
            try:
                while sock.recv(65536):  # the rest of an answer, then the end of the stream
                    pass
            except BlockingIOError:
                held += 1  # nothing more to read, and not closed
            except OSError:
                pass
        return held

    def keep_opening(self) -> Monopoly:
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            self.open(8)

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(30)
        for sock in self.socks:
            sock.close()
