"""Issue 13, part 2: clients that hold connections without finishing anything. Heads and bodies
sent a byte a second, connections that never send a byte, answers never read, hellos that
stall on the transfer port, and floods of such connections while real clients work. Against a
real server whose deadlines are all ``DEADLINE_S``.

What must hold: the server closes each such connection within its deadline (+ ``SLACK_S``),
measured from the client's side as the time until it sees the connection end; and while dozens
of silent connections are open on both ports, every client with a token is served.

Figures: ``slow_client_max_open_s``, ``slow_client_deadline_s``,
``authenticated_clients_refused_during_flood``, ``hostile_inputs``.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator

import pytest

from cachetier.protocol.http_batch import BATCH_MEDIA_TYPE
from cachetier.protocol.transfer_frames import HELLO, MAGIC, Op, Status, hello, request
from cachetier.record import KVBlock, encode_record
from tests.faults.conftest import FaultFigures
from tests.faults.fuzzing import FUZZ_NS, frame
from tests.faults.hostile import (
    ALICE,
    DEADLINE_S,
    SLACK_S,
    WAIT_S,
    hostile_config,
    http_head,
    max_figure,
    metric,
    time_until_closed,
    transfer_put,
    transfer_reply,
    transfer_session,
    trickle,
)
from tests.server.live import ThreadServer, call
from tests.support import make_blocks

NUM_SILENT = 100  # silent connections per port in the flood (the issue saw 64 suffice)
NUM_CLIENTS = 30  # exchanges of clients with a token during the flood

Feed = Callable[[socket.socket, threading.Event], None]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ThreadServer]:
    folder = tmp_path_factory.mktemp("hostile-clients")
    # Batches up to 16 MiB: an answer larger than the socket buffers, for the unread one.
    running = ThreadServer(hostile_config(folder, max_batch_bytes=16 << 20)).start()
    yield running
    running.stop()


def _report_open(figures: FaultFigures, opened: dict[str, float]) -> None:
    max_figure(figures, "slow_client_max_open_s", round(max(opened.values()), 3))
    figures.set("slow_client_deadline_s", DEADLINE_S)
    figures.add("hostile_inputs", len(opened))
    late = {what: s for what, s in opened.items() if s > DEADLINE_S + SLACK_S}
    assert not late, f"open past {DEADLINE_S} + {SLACK_S} s: {late}"


def _answered(sock: socket.socket) -> None:
    """Read one whole answer to ``GET /healthz`` (small, with a Content-Length)."""
    got = b""
    while b"\r\n\r\n" not in got:
        chunk = sock.recv(4096)
        assert chunk, "closed before the answer"
        got += chunk
    head, _, body = got.partition(b"\r\n\r\n")
    length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
    while len(body) < length:
        body += sock.recv(4096)


def test_slow_and_silent_http_clients_are_closed_within_the_deadline(
    server: ThreadServer, fault_figures: FaultFigures
) -> None:
    port = server.config.port
    auth = {"Authorization": f"Bearer {ALICE}"}
    lookup = f"/v1/namespaces/{FUZZ_NS.id}/lookup"
    body = b'{"keys": []}'
    post_head = http_head(
        "POST", lookup, {**auth, "Content-Type": "application/json", "Content-Length": "100"}
    )
    healthz = http_head("GET", "/healthz", {})
    # what -> (bytes sent at once first, whether an answer to them comes first, the feed)
    cases: dict[str, tuple[bytes, bool, Feed | None]] = {
        "never a byte": (b"", False, None),
        "head a byte a second": (b"", False, trickle(http_head("GET", "/healthz", auth))),
        "half a head, then nothing": (post_head[:30], False, None),
        "head, then no body": (post_head, False, None),
        "body a byte a second": (post_head, False, trickle(b" " * 100)),
        "body shorter than its length": (post_head + body, False, None),
        "idle after an answer": (healthz, True, None),
        "second head a byte a second": (healthz, True, trickle(healthz)),
        "a long header a byte every 10 ms": (
            b"GET /healthz HTTP/1.1\r\nX-Pad: ",
            False,
            trickle(b"a" * 1000, every_s=0.01),
        ),
    }
    opened: dict[str, float] = {}
    for what, (first, answered, feed) in cases.items():
        with socket.create_connection(("127.0.0.1", port), timeout=WAIT_S) as sock:
            if first:
                sock.sendall(first)
            if answered:
                _answered(sock)
            opened[what] = time_until_closed(sock, feed)
    _report_open(fault_figures, opened)
    assert metric(server, 'cachetier_http_connections_closed_total{reason="head_timeout"}') >= 5
    assert call(server.url, "GET", "/healthz")[0] == 200


def test_an_answer_the_client_never_reads_is_dropped_within_the_deadline(
    server: ThreadServer, fault_figures: FaultFigures
) -> None:
    ns = FUZZ_NS.id
    # 12 MiB in all: more than the kernel's socket buffers take on both ends.
    big = [
        KVBlock(b.key, b.fingerprint, "uint8", (512 << 10,), b.num_tokens, bytes(512 << 10))
        for b in make_blocks(FUZZ_NS, 24, seed=41)
    ]
    for i in range(0, len(big), 4):
        status, _, answer = call(
            server.url,
            "POST",
            f"/v1/namespaces/{ns}/batch/put",
            frame([encode_record(b) for b in big[i : i + 4]]),
            token=ALICE,
            content_type=BATCH_MEDIA_TYPE,
        )
        assert status == 200, answer
    keys = b'{"keys": [' + b", ".join(b'"%s"' % b.key.hex().encode() for b in big) + b"]}"
    before = metric(server, 'cachetier_http_connections_closed_total{reason="send_timeout"}')
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # reads nothing, holds little
    sock.connect(("127.0.0.1", server.config.port))
    try:
        head = http_head(
            "POST",
            f"/v1/namespaces/{ns}/batch/get",
            {
                "Authorization": f"Bearer {ALICE}",
                "Content-Type": "application/json",
                "Content-Length": str(len(keys)),
            },
        )
        sock.sendall(head + keys)
        start = time.monotonic()
        while time.monotonic() - start < WAIT_S:
            now = metric(server, 'cachetier_http_connections_closed_total{reason="send_timeout"}')
            if now > before:
                break
            time.sleep(0.05)
        opened = {"answer never read": time.monotonic() - start}
    finally:
        sock.close()
    _report_open(fault_figures, opened)


def test_stalled_hellos_are_closed_within_the_deadline(
    server: ThreadServer, fault_figures: FaultFigures
) -> None:
    port = server.config.transfer_port
    assert port is not None
    good = hello(ALICE, None)
    cases: dict[str, tuple[bytes, Feed | None]] = {
        "zero-byte hello": (b"", None),
        "hello a byte a second": (b"", trickle(good)),
        "magic only": (MAGIC, None),
        "a long token, a byte at a time": (
            HELLO.pack(MAGIC, 1024, 0),
            trickle(b"t" * 1024, every_s=0.05),
        ),
        "hello, then no request": (good, None),
        "request head a byte a second": (good, trickle(request(Op.GET, FUZZ_NS.id, 1))),
    }
    opened: dict[str, float] = {}
    for what, (first, feed) in cases.items():
        with socket.create_connection(("127.0.0.1", port), timeout=WAIT_S) as sock:
            if first:
                sock.sendall(first)
            if first == good:
                assert transfer_reply(sock) == (Status.OK, b"")
            opened[what] = time_until_closed(sock, feed)
    _report_open(fault_figures, opened)


def _transfer_client_ok(port: int, record: bytes, key: bytes) -> bool:
    """One whole exchange of a client with a token: hello, put, get."""
    try:
        with transfer_session(port) as sock:
            if transfer_put(sock, FUZZ_NS.id, [record]) != (Status.OK, b""):
                return False
            sock.sendall(request(Op.GET, FUZZ_NS.id, 1) + key)
            return transfer_reply(sock) == (Status.OK, b"")
    except (OSError, AssertionError):
        return False


def _http_client_ok(server: ThreadServer, key: bytes) -> bool:
    try:
        status, _, _ = call(
            server.url, "GET", f"/v1/namespaces/{FUZZ_NS.id}/blocks/{key.hex()}", token=ALICE
        )
    except OSError:
        return False
    return status == 200


def _flood(port: int, stop: threading.Event, opened: list[socket.socket]) -> None:
    """Open silent connections, one every 10 ms, until told to stop (at most 500)."""
    while not stop.wait(0.01) and len(opened) < 500:
        try:
            opened.append(socket.create_connection(("127.0.0.1", port), timeout=WAIT_S))
        except OSError:
            pass  # the backlog was full for a moment: the flood goes on


def test_floods_of_silent_connections_turn_no_client_with_a_token_away(
    server: ThreadServer, fault_figures: FaultFigures
) -> None:
    transfer_port = server.config.transfer_port
    assert transfer_port is not None
    block = make_blocks(FUZZ_NS, 1, seed=42)[0]
    record = encode_record(block)
    assert _transfer_client_ok(transfer_port, record, block.key)
    silent: list[socket.socket] = []
    stop = threading.Event()
    refused = {"transfer": 0, "http": 0}
    try:
        for port in (transfer_port, server.config.port):
            silent += [
                socket.create_connection(("127.0.0.1", port), timeout=WAIT_S)
                for _ in range(NUM_SILENT)
            ]
            # Half a head and half a hello on some: they look like slow clients, not idle ones.
            for sock in silent[-NUM_SILENT // 2 :]:
                sock.sendall(b"GET / HT" if port == server.config.port else MAGIC)
        floods = [
            threading.Thread(target=_flood, args=(port, stop, silent), daemon=True)
            for port in (transfer_port, server.config.port)
        ]
        for flood in floods:
            flood.start()
        for _ in range(NUM_CLIENTS):
            refused["transfer"] += not _transfer_client_ok(transfer_port, record, block.key)
            refused["http"] += not _http_client_ok(server, block.key)
    finally:
        stop.set()
        for sock in silent:
            sock.close()
    dropped = metric(server, "cachetier_transfer_unauthenticated_dropped_total")
    fault_figures.add("authenticated_clients_refused_during_flood", sum(refused.values()))
    fault_figures.add("hostile_inputs", len(silent))
    assert refused == {"transfer": 0, "http": 0}, refused
    assert dropped >= NUM_SILENT - server.config.transfer_unauthenticated_connections
