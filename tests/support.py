"""Helpers shared by tests (plain functions; fixtures live in conftest.py)."""

from __future__ import annotations

import json
import random
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import redis
import uvicorn

from cachetier.cli.ports import bound_port
from cachetier.primitives.keys import BlockHash, KVLayout, Namespace, block_keys
from cachetier.record import KVBlock
from cachetier.report.events import EventLog, LookupEvent

# The Mooncake conversation trace the repository ships (workloads/README.md says whence).
CONVERSATION_TRACE = (
    Path(__file__).resolve().parents[1] / "workloads" / "mooncake_conversation_trace.jsonl.gz"
)

# A small layout so shared-suite tests move kilobytes, not megabytes.
SMALL_LAYOUT = KVLayout("float16", block_size=16, num_layers=2, num_kv_heads=2, head_dim=8)


def make_blocks(
    namespace: Namespace, num_blocks: int, *, seed: int = 0, layout: KVLayout | None = None
) -> list[KVBlock]:
    """``num_blocks`` chained blocks with random fp16 payloads, deterministic per seed."""
    layout = layout or namespace.layout
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, 50_000, size=num_blocks * layout.block_size)
    keys = block_keys(namespace, tokens)
    shape = (layout.num_layers, 2, layout.block_size, layout.num_kv_heads, layout.head_dim)
    return [
        KVBlock(
            key,
            namespace.fingerprint,
            layout.dtype,
            shape,
            layout.block_size,
            _payload(rng, shape, layout.dtype),
        )
        for key in keys
    ]


def keys_of(blocks: list[KVBlock]) -> list[BlockHash]:
    """The blocks' keys, in order."""
    return [b.key for b in blocks]


def _payload(rng: np.random.Generator, shape: tuple[int, ...], dtype: str) -> bytes:
    if dtype in ("float16", "float32"):
        return rng.standard_normal(shape).astype(dtype).tobytes()
    # Types numpy lacks (bfloat16, fp8): random bits of the right width.
    width = {"bfloat16": 2}.get(dtype, 1)
    return rng.integers(0, 256, size=int(np.prod(shape)) * width, dtype=np.uint8).tobytes()


@contextmanager
def own_redis_prefix(url: str, label: str) -> Iterator[str]:
    """A Redis key prefix nobody else uses; every key under it is deleted on exit."""
    prefix = f"{label}-{uuid.uuid4().hex[:12]}"
    try:
        yield prefix
    finally:
        client = redis.Redis.from_url(url)
        try:
            keys = list(client.scan_iter(match=f"{prefix}*", count=1000))
            if keys:
                client.delete(*keys)
        finally:
            client.close()


# A Redis tier that fails fast: a dead or silent Redis costs a test tenths of a second.
TIMEOUT_S = 0.2
FAST_FAIL = {"socket_timeout_s": TIMEOUT_S, "connect_timeout_s": TIMEOUT_S}


class FakeClock:
    """A clock that only moves when the test says so."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


# Ports a server that cannot listen on port 0 tries (redis-server: its port 0 turns TCP off).
# Below Linux's ephemeral range (32768-60999), so no outgoing connection holds one; a Redis
# Cluster node's bus port, its port + 10000, stays below it too.
PRIVATE_PORTS = range(10_000, 22_000)
START_TRIES = 30


def start_on_a_free_port(
    start: Callable[[int], subprocess.Popen],
    log: Path,
    *,
    ready: str = "Ready to accept connections",
    busy: str = "Address already in use",
    timeout_s: float = 30,
    ports: Callable[[], int] = lambda: random.choice(PRIVATE_PORTS),
) -> tuple[int, subprocess.Popen]:
    """Start a server that cannot report a port-0 bind on a random port, and again on another
    while it exits because its port is taken. Its own bind decides: nothing is reserved and
    released, so this does not race with other programs (``free_port`` did).

    Args:
        start: starts the server on the port it is given; the server logs to ``log``.
        log: the server's log file (appended to across starts).
        ready: the log line that says it listens on every port it was given.
        busy: the log line of a port someone else holds.
        timeout_s: how long one start may take.
        ports: picks the next port to try.

    Returns:
        The port and the running process.
    """
    for _ in range(START_TRIES):
        port = ports()
        offset = log.stat().st_size if log.exists() else 0
        proc = start(port)
        deadline = time.monotonic() + timeout_s
        while True:
            text = _read_from(log, offset)
            if ready in text and proc.poll() is None:
                return port, proc
            if proc.poll() is not None:
                break
            if time.monotonic() > deadline:
                end_process(proc, signal.SIGKILL)
                raise RuntimeError(f"{start} on port {port} did not start: {text[-2000:]}")
            time.sleep(0.01)
        text = _read_from(log, offset)
        if busy not in text:
            raise RuntimeError(f"server on port {port} exited ({proc.returncode}): {text[-2000:]}")
    raise RuntimeError(f"no free port after {START_TRIES} tries")


@contextmanager
def refusing_port() -> Iterator[int]:
    """A port on 127.0.0.1 that refuses every connection (a server that is down), held for
    the ``with`` block: the socket is bound and never listens, so no other program can take
    the port meanwhile."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        yield sock.getsockname()[1]


@contextmanager
def silent_port() -> Iterator[int]:
    """A port on 127.0.0.1 that accepts connections (into the kernel's backlog) and never
    answers (a hung server), held for the ``with`` block."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(64)
        yield sock.getsockname()[1]


def _read_from(path: Path, offset: int) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            return f.read().decode(errors="replace")
    except FileNotFoundError:
        return ""


def wait_ports_file(
    path: Path, proc: subprocess.Popen | None = None, timeout_s: float = 60
) -> dict[str, Any]:
    """The ports a server started with ``--port 0 --ports-file path`` listens on, once it has
    written them (it writes the file whole, in one rename, after every listener is bound).

    Args:
        path: the ports file.
        proc: the server's process; its exit ends the wait with an error.
        timeout_s: how long to wait.

    Returns:
        The file's JSON, e.g. ``{"http": 43121, "transfer": 40123, "unix": None}``.
    """
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if proc is not None and proc.poll() is not None:
            _, err = end_process(proc)
            raise RuntimeError(f"the server exited ({proc.returncode}): {err[-3000:]!s}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"no ports file {path} after {timeout_s} s")
        time.sleep(0.01)
    return json.loads(path.read_text())


def spawn_serve(args: list[str], env: dict[str, str]) -> subprocess.Popen[str]:
    """``cachetier serve *args`` in a child process with ``env``, its output piped (text)."""
    return spawn_cli("serve", args, env)


def spawn_cli(command: str, args: list[str], env: dict[str, str]) -> subprocess.Popen[str]:
    """``cachetier <command> *args`` in a child process with ``env``, its output piped."""
    return subprocess.Popen(
        [sys.executable, "-m", "cachetier.cli.main", command, *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def end_process(
    proc: subprocess.Popen, sig: int = signal.SIGTERM, timeout_s: float = 30
) -> tuple[str, str]:
    """Send ``sig`` if it still runs, wait (SIGKILL after ``timeout_s``), and return what it
    wrote on stdout and stderr where those were piped (else ``""``)."""
    if proc.poll() is None:
        proc.send_signal(sig)
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
    return out or "", err or ""


@contextmanager
def opened_redis_tiers(**defaults: object) -> Iterator[Callable[..., Any]]:
    """A factory of ``RedisTier``s with ``defaults`` under each one's settings, every tier it
    made closed at the end (the body of the Redis tests' ``make_tier`` fixtures)."""
    from cachetier.tiers.redis import RedisTier, RedisTierConfig

    opened: list[RedisTier] = []

    def make(*, clock: Callable[[], float] = time.monotonic, **settings: object) -> RedisTier:
        tier = RedisTier(RedisTierConfig(**{**defaults, **settings}), clock=clock)  # type: ignore[arg-type]
        opened.append(tier)
        return tier

    try:
        yield make
    finally:
        for tier in opened:
            tier.close()


class PrivateRedis:
    """A redis-server of this test's own, on a port of its own, that the test can stop and
    restart (on the same port)."""

    def __init__(self, folder: Path, *, password: str | None = None) -> None:
        self.port = 0  # chosen at the first start
        self.folder = folder
        self.password = password
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def socket_path(self) -> Path:
        """Its Unix socket (it listens there too)."""
        return self.folder / "redis.sock"

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def _popen(self, port: int) -> subprocess.Popen[bytes]:
        return subprocess.Popen(
            ["redis-server", "--port", str(port), "--bind", "127.0.0.1"]
            + ["--save", "", "--appendonly", "no", "--dir", str(self.folder)]
            + ["--logfile", str(self.folder / "redis.log")]
            + ["--unixsocket", str(self.socket_path)]
            + ([] if self.password is None else ["--requirepass", self.password]),
        )

    def start(self) -> None:
        assert self.proc is None, "already running"
        # A restart keeps the port: the clients under test hold its URL.
        same = (lambda: self.port) if self.port else (lambda: random.choice(PRIVATE_PORTS))
        self.port, self.proc = start_on_a_free_port(
            self._popen, self.folder / "redis.log", ports=same, timeout_s=10
        )
        client = redis.Redis(
            port=self.port, password=self.password, socket_timeout=1, socket_connect_timeout=1
        )
        deadline = time.monotonic() + 10
        try:
            while True:
                try:
                    client.ping()
                    return
                except redis.exceptions.ConnectionError as exc:
                    if self.proc.poll() is not None or time.monotonic() > deadline:
                        raise RuntimeError(
                            f"redis-server on port {self.port} did not start"
                        ) from exc
                    time.sleep(0.02)
        finally:
            client.close()

    def pause(self) -> None:
        """SIGSTOP: the server keeps its connections open and answers nothing (a hung Redis)."""
        assert self.proc is not None, "not running"
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        assert self.proc is not None, "not running"
        self.proc.send_signal(signal.SIGCONT)

    def stop(self) -> None:
        if self.proc is None:
            return
        self.proc.send_signal(signal.SIGCONT)  # a paused server cannot act on SIGTERM
        end_process(self.proc, timeout_s=10)
        self.proc = None


class AppThread:
    """uvicorn serving an ASGI app in a thread of this process, on 127.0.0.1; restartable on the
    same port. ``make_app`` builds a fresh app (and so a fresh lifespan) for every start.

    Args:
        make_app: returns the app to serve.
        port: the port to listen on; 0 (the default) for one the OS picks at the first start
            (``port`` says which once started; a restart listens there again).
        log_level: uvicorn's log level.
        name: the thread's name, and what error messages call the server.
        start_timeout_s: how long a start may take (an engine loads its model first).
    """

    def __init__(
        self,
        make_app: Callable[[], Any],
        port: int = 0,
        *,
        log_level: str = "warning",
        name: str = "test-server",
        start_timeout_s: float = 20,
    ) -> None:
        self.make_app = make_app
        self.port = port
        self.log_level = log_level
        self.name = name
        self.start_timeout_s = start_timeout_s
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def make_server(self) -> uvicorn.Server:
        """The uvicorn server ``start_thread`` runs (a subclass may build its own)."""
        config = uvicorn.Config(
            self.make_app(),
            host="127.0.0.1",
            port=self.port,
            log_level=self.log_level,
            lifespan="on",
        )
        return uvicorn.Server(config)

    def start_thread(self) -> None:
        """Start uvicorn and wait until it listens (the caller checks its health)."""
        self._server = self.make_server()
        self._thread = threading.Thread(target=self._server.run, name=self.name, daemon=True)
        self._thread.start()
        deadline = time.monotonic() + self.start_timeout_s
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the {self.name} on {self.url} did not start")
            time.sleep(0.005)
        self.port = bound_port(self._server)

    def stop(self) -> None:
        """Ask uvicorn to exit (requests in flight finish, the lifespan ends) and wait."""
        if self._server is not None and self._thread is not None:
            self._server.should_exit = True
            self._thread.join(timeout=60)
            assert not self._thread.is_alive(), f"the {self.name} did not stop"
        self._server = self._thread = None


def write_engine_event_log(path: Path, hit_tokens: dict[str, int], num_events: int = 40) -> None:
    """An engine's lookup event log of ``num_events`` 1,000-token lookups, 15 s apart: tenants
    alice (3 in 4) and bob; every other lookup hits ``hit_tokens`` (by source) with 8 tokens
    lost to alignment and 0.5 s of restore, the rest miss."""
    with EventLog(path) as log:
        for i in range(num_events):
            log.record(
                LookupEvent(
                    time_s=1_700_000_000.0 + 15 * i,
                    tenant="alice" if i % 4 else "bob",
                    num_tokens=1000,
                    hit_tokens=hit_tokens if i % 2 else {},
                    block_size=16,
                    num_alignment_lost_tokens=8 if i % 2 else 0,
                    restore_s=0.5 if i % 2 else 0.0,
                    origin="engine",
                )
            )
