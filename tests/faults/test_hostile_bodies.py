"""Issue 13, part 2: bodies no client may make the sidecar crash on or hold. Compression bombs
and records that lie about their sizes, over HTTP and the transfer port; bodies sent without a
token; lengths and counts that lie in the HTTP head, the batch framing and the transfer
requests. Against a real server (uvicorn with its connection guard, the transfer port).

What must hold: every such body gets a 4xx (or the transfer port's ``BAD_REQUEST`` /
``TOO_LARGE``), never a 5xx or ``FAILED``; a refused upload is counted in ``rejected`` and
nothing of it is stored; nothing that decompresses past ``max_block_bytes`` (or a request past
``max_batch_bytes``) is accepted; a request without a valid token is answered before more than
64 KiB of its body is read, whatever its Content-Type and framing.

Figures: ``hostile_inputs``, ``hostile_5xx``, ``decompressed_over_limit_accepted``,
``unauthenticated_body_bytes_read_max``.
"""

from __future__ import annotations

import json
import socket
import struct
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from cachetier.protocol.http_batch import BATCH_MEDIA_TYPE, RECORD_MEDIA_TYPE
from cachetier.protocol.transfer_frames import KEY_BYTES, Op, Status, request
from cachetier.record import encode_record
from cachetier.server.httpserver import MAX_PIPELINED
from tests.faults.conftest import FaultFigures
from tests.faults.fuzzing import FUZZ_NS, frame
from tests.faults.hostile import (
    ALICE,
    WAIT_S,
    bomb,
    hostile_config,
    http_exchange,
    http_head,
    max_figure,
    metric,
    read_status,
    rejected,
    transfer_put,
    transfer_reply,
    transfer_session,
    zeros_block,
)
from tests.server.live import ThreadServer, call
from tests.support import make_blocks

MAX_UNAUTHENTICATED_BODY_BYTES = 65_536


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ThreadServer]:
    running = ThreadServer(hostile_config(tmp_path_factory.mktemp("hostile-bodies"))).start()
    yield running
    running.stop()


def _over_limit_cases(server: ThreadServer) -> list[tuple[str, bytes, bytes, bool]]:
    """(what, key, record, whether its payload decompresses past ``max_block_bytes``)."""
    limit = server.config.max_block_bytes
    seeds = make_blocks(FUZZ_NS, 4, seed=31)
    inflates = bomb(zeros_block(72 << 20, seeds[0]))  # the issue's: 0.3 MB that is 72 MiB
    assert len(inflates) < limit
    small = zeros_block(64 << 10, seeds[1])
    return [
        ("72 MiB of zeros", seeds[0].key, inflates, True),
        ("claims 2**62 bytes", seeds[1].key, bomb(small, 1 << 62), True),
        ("claims 3 GiB", seeds[1].key, bomb(small, 3 << 30), True),
        ("claims the limit + 2", seeds[1].key, bomb(small, limit + 2), True),
        ("claims less than it holds", seeds[1].key, bomb(small, (64 << 10) - 2), False),
        ("claims more than it holds", seeds[1].key, bomb(small, 128 << 10), False),
    ]


def test_compression_bombs_and_lying_raw_lengths_over_http(
    server: ThreadServer, fault_figures: FaultFigures
) -> None:
    ns = FUZZ_NS.id
    good = make_blocks(FUZZ_NS, 1, seed=32)[0]
    before = rejected(server)
    num_inputs = num_5xx = over_accepted = 0
    for what, key, record, over in _over_limit_cases(server):
        for path, body, ctype in [
            (f"/v1/namespaces/{ns}/blocks/{key.hex()}", record, RECORD_MEDIA_TYPE),
            (
                f"/v1/namespaces/{ns}/batch/put",
                frame([encode_record(good), record]),
                BATCH_MEDIA_TYPE,
            ),
        ]:
            method = "PUT" if ctype == RECORD_MEDIA_TYPE else "POST"
            status, _, answer = call(
                server.url, method, path, body, token=ALICE, content_type=ctype
            )
            num_inputs += 1
            num_5xx += status >= 500
            over_accepted += over and status < 300
            assert status == 400 and b"bad_record" in answer, (what, status, answer[:300])
        assert (
            call(server.url, "GET", f"/v1/namespaces/{ns}/blocks/{key.hex()}", token=ALICE)[0]
            == 404
        )
    assert (
        call(server.url, "GET", f"/v1/namespaces/{ns}/blocks/{good.key.hex()}", token=ALICE)[0]
        == 404
    )
    # Each record within max_block_bytes, together past max_batch_bytes once decompressed.
    limits = server.config
    each = limits.max_block_bytes - (64 << 10)
    blocks = [zeros_block(each, b) for b in make_blocks(FUZZ_NS, 8, seed=33)]
    fits = limits.max_batch_bytes // each
    for count, accepted in [(fits, True), (fits + 1, False)]:
        body = frame([bomb(b) for b in blocks[:count]])
        assert len(body) < limits.max_block_bytes  # small on the wire
        status, _, answer = call(
            server.url,
            "POST",
            f"/v1/namespaces/{ns}/batch/put",
            body,
            token=ALICE,
            content_type=BATCH_MEDIA_TYPE,
        )
        num_inputs += 1
        num_5xx += status >= 500
        over_accepted += not accepted and status < 300
        assert status == (200 if accepted else 400), (count, answer[:300])
    num_refused_records = 6 * 1 + 6 * 2 + (fits + 1)  # singles, pairs, the batch too large
    assert rejected(server) - before == num_refused_records
    fault_figures.add("hostile_inputs", num_inputs)
    fault_figures.add("hostile_5xx", num_5xx)
    fault_figures.add("decompressed_over_limit_accepted", over_accepted)


def test_compression_bombs_and_lying_raw_lengths_over_the_transfer_port(
    server: ThreadServer, fault_figures: FaultFigures
) -> None:
    port = server.config.transfer_port
    assert port is not None
    good = make_blocks(FUZZ_NS, 1, seed=34)[0]
    before = rejected(server)
    num_inputs = num_failed = over_accepted = 0
    sock = transfer_session(port)
    try:
        for what, key, record, over in _over_limit_cases(server):
            status, message = transfer_put(sock, FUZZ_NS.id, [encode_record(good), record])
            num_inputs += 1
            num_failed += status == Status.FAILED
            over_accepted += over and status == Status.OK
            assert status == Status.BAD_REQUEST and b"record 1" in message, (what, message)
            # The connection stays in step: a get on it still works, and found nothing.
            sock.sendall(request(Op.GET, FUZZ_NS.id, 2) + good.key + key)
            got = transfer_reply(sock)
            assert got == (Status.OK, b""), got
            lengths = sock.recv(16, socket.MSG_WAITALL)
            assert struct.unpack("<2Q", lengths) == (0, 0), what
        assert transfer_put(sock, FUZZ_NS.id, [encode_record(good)]) == (Status.OK, b"")
    finally:
        sock.close()
    assert rejected(server) - before == 2 * 6
    fault_figures.add("hostile_inputs", num_inputs)
    fault_figures.add("hostile_5xx", num_failed)
    fault_figures.add("decompressed_over_limit_accepted", over_accepted)


# Every endpoint, a public one included (a body nobody asked for), and a path that is none.
def _endpoints() -> list[tuple[str, str]]:
    ns, key = FUZZ_NS.id, "ab" * KEY_BYTES
    return [
        ("POST", f"/v1/namespaces/{ns}/lookup"),
        ("POST", f"/v1/namespaces/{ns}/batch/get"),
        ("POST", f"/v1/namespaces/{ns}/batch/exists"),
        ("POST", f"/v1/namespaces/{ns}/batch/delete"),
        ("POST", f"/v1/namespaces/{ns}/batch/put"),
        ("PUT", f"/v1/namespaces/{ns}/blocks/{key}"),
        ("GET", f"/v1/namespaces/{ns}/blocks/{key}"),
        ("DELETE", f"/v1/namespaces/{ns}"),
        ("GET", "/v1/stats"),
        ("GET", "/metrics"),
        ("POST", "/v1/nothing-here"),
    ]


WITHOUT_A_VALID_TOKEN = [
    ({}, 401),
    ({"Authorization": "Bearer not-a-token-of-this-server"}, 401),
    ({"Authorization": f"Basic {ALICE}"}, 401),
    ({"Authorization": "Bearer"}, 401),
    ({"Authorization": f"Bearer {ALICE}", "X-Cachetier-Tenant": "bob"}, 403),
]
CONTENT_TYPES = [RECORD_MEDIA_TYPE, BATCH_MEDIA_TYPE, "application/json", "text/plain", None]
_CHUNK = b"\0" * (1 << 20)


def _send_body(sock: socket.socket, chunked: bool, stop: threading.Event, limit: int) -> int:
    """Send body bytes until ``stop`` is set, a send fails or ``limit`` is reached."""
    sent = 0
    frame_head = f"{len(_CHUNK):x}\r\n".encode()
    while not stop.is_set() and sent < limit:
        try:
            if chunked:
                sock.sendall(frame_head + _CHUNK + b"\r\n")
            else:
                sock.sendall(_CHUNK)
        except OSError:
            break
        sent += len(_CHUNK)
    return sent


def test_bodies_without_a_valid_token_are_answered_before_they_are_read(
    server: ThreadServer, fault_figures: FaultFigures
) -> None:
    port = server.config.port
    num_inputs = num_5xx = 0
    for method, path in _endpoints():
        for headers, expected in WITHOUT_A_VALID_TOKEN:
            for ctype in CONTENT_TYPES:
                for chunked in (False, True):
                    sent_headers = dict(headers)
                    if ctype is not None:
                        sent_headers["Content-Type"] = ctype
                    if chunked:
                        sent_headers["Transfer-Encoding"] = "chunked"
                    else:
                        sent_headers["Content-Length"] = str(600_000_000)
                    with socket.create_connection(("127.0.0.1", port), timeout=WAIT_S) as sock:
                        sock.sendall(http_head(method, path, sent_headers))
                        stop = threading.Event()
                        feeder = threading.Thread(
                            target=_send_body, args=(sock, chunked, stop, 16 << 20), daemon=True
                        )
                        feeder.start()
                        status = read_status(sock)
                        stop.set()
                        feeder.join(WAIT_S)
                    num_inputs += 1
                    num_5xx += status is not None and status >= 500
                    assert status == expected, (method, path, headers, ctype, chunked, status)
    # A head alone, promising 600 MB: the answer comes without a byte of the body.
    with socket.create_connection(("127.0.0.1", port), timeout=WAIT_S) as sock:
        sock.sendall(
            http_head(
                "POST",
                f"/v1/namespaces/{FUZZ_NS.id}/lookup",
                {"Content-Type": RECORD_MEDIA_TYPE, "Content-Length": "600000000"},
            )
        )
        assert read_status(sock) == 401
    num_inputs += 1
    read_max = metric(server, "cachetier_http_refused_body_bytes_max")
    max_figure(fault_figures, "unauthenticated_body_bytes_read_max", read_max)
    fault_figures.add("hostile_inputs", num_inputs)
    fault_figures.add("hostile_5xx", num_5xx)
    assert 0 < read_max <= MAX_UNAUTHENTICATED_BODY_BYTES
    assert call(server.url, "GET", "/healthz")[0] == 200


def _rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS in /proc/self/status")


def test_600_mb_sent_chunked_without_a_token_leaves_memory_flat(
    server: ThreadServer, fault_figures: FaultFigures
) -> None:
    # The case: a JSON endpoint, a binary Content-Type, no token, 600 MB chunked.
    # The server (in this process) answers, drops what follows for a short while, and closes.
    head = http_head(
        "POST",
        f"/v1/namespaces/{FUZZ_NS.id}/lookup",
        {"Content-Type": RECORD_MEDIA_TYPE, "Transfer-Encoding": "chunked"},
    )
    peak = start = _rss_bytes()
    with socket.create_connection(("127.0.0.1", server.config.port), timeout=WAIT_S) as sock:
        sock.sendall(head)
        stop = threading.Event()
        sent: list[int] = []
        feeder = threading.Thread(
            target=lambda: sent.append(_send_body(sock, True, stop, 600 << 20)), daemon=True
        )
        feeder.start()
        while feeder.is_alive():
            peak = max(peak, _rss_bytes())
            feeder.join(0.01)
        status = read_status(sock)
    fault_figures.add("hostile_inputs", 1)
    assert status in (401, None), status  # None: the reset came before the answer was read
    assert peak - start < 64 << 20, f"RSS grew {(peak - start) >> 20} MiB while {sent} sent"
    assert metric(server, "cachetier_http_refused_body_bytes_max") <= MAX_UNAUTHENTICATED_BODY_BYTES


def _batch_put_head(headers: dict[str, str]) -> bytes:
    """The head of alice's batch put, with ``headers`` added to (or over) its own."""
    path = f"/v1/namespaces/{FUZZ_NS.id}/batch/put"
    auth = {"Authorization": f"Bearer {ALICE}"}
    return http_head("POST", path, {**auth, "Content-Type": BATCH_MEDIA_TYPE, **headers})


def _expect_statuses(
    server: ThreadServer,
    cases: list[tuple[str, bytes, tuple[int | None, ...]]],
    fault_figures: FaultFigures,
) -> None:
    """Send each case's bytes on a connection of its own; its status must be one it allows
    (``None``: the connection ended unanswered). The server must answer afterwards."""
    num_inputs = num_5xx = 0
    for what, data, allowed in cases:
        status = http_exchange(server.config.port, data, half_close=what == "length too large")
        num_inputs += 1
        num_5xx += status is not None and status >= 500
        assert status in allowed, (what, status)
    fault_figures.add("hostile_inputs", num_inputs)
    fault_figures.add("hostile_5xx", num_5xx)
    assert call(server.url, "GET", "/healthz")[0] == 200


def test_lengths_that_lie_in_the_http_head(
    server: ThreadServer, fault_figures: FaultFigures
) -> None:
    head = _batch_put_head
    body = frame([encode_record(make_blocks(FUZZ_NS, 1, seed=35)[0])])
    cases: list[tuple[str, bytes, tuple[int | None, ...]]] = [
        # A Content-Length larger than the body: the body ends early (400).
        ("length too large", head({"Content-Length": str(len(body) + 100)}) + body, (400, None)),
        # Smaller: the batch ends early; what follows is a second, malformed request.
        ("length too small", head({"Content-Length": str(len(body) - 10)}) + body, (400,)),
        ("length not a number", head({"Content-Length": "12abc"}) + body, (400,)),
        ("negative length", head({"Content-Length": "-5"}) + body, (400,)),
        ("two lengths", head({"Content-Length": f"{len(body)}, 5"}) + body, (400,)),
        (
            "length and chunked",
            head({"Content-Length": str(len(body)), "Transfer-Encoding": "chunked"}) + body,
            (400,),
        ),
        ("bad chunk size", head({"Transfer-Encoding": "chunked"}) + b"zz\r\n" + body, (400,)),
        # llhttp takes a chunk of 2**64-1 bytes; one byte of it comes, then the body deadline.
        (
            "huge chunk size",
            head({"Transfer-Encoding": "chunked"}) + b"ffffffffffffffff\r\nx",
            (400, 413, None),
        ),
        ("length 2**64", head({"Content-Length": str(1 << 64)}) + body, (400, 413)),
    ]
    _expect_statuses(server, cases, fault_figures)


def test_counts_and_lengths_that_lie_in_the_batch_framing(
    server: ThreadServer, fault_figures: FaultFigures
) -> None:
    limits = server.config
    framing = [
        ("count 2**32-1", struct.pack("<4sI", b"CTB1", 2**32 - 1)),
        ("count over the limit", struct.pack("<4sI", b"CTB1", limits.max_batch_blocks + 1)),
        ("length 2**64-1", struct.pack("<4sIQ", b"CTB1", 1, 2**64 - 1)),
        (
            "lengths past the batch",
            struct.pack("<4sI4Q", b"CTB1", 4, *[limits.max_block_bytes] * 4),
        ),
        ("count 0", struct.pack("<4sI", b"CTB1", 0)),
        ("count 1, no lengths", struct.pack("<4sI", b"CTB1", 1)),
    ]
    cases: list[tuple[str, bytes, tuple[int | None, ...]]] = [
        (what, _batch_put_head({"Content-Length": str(len(body))}) + body, (200, 400, 413))
        for what, body in framing
    ]
    _expect_statuses(server, cases, fault_figures)


def test_counts_and_lengths_that_lie_in_transfer_requests(
    server: ThreadServer, fault_figures: FaultFigures
) -> None:
    limits = server.config
    ns = FUZZ_NS.id
    transfer_port = limits.transfer_port
    assert transfer_port is not None
    transfer_cases = [
        ("get count 2**32-1", request(Op.GET, ns, 2**32 - 1), Status.TOO_LARGE),
        ("put count 2**32-1", request(Op.PUT, ns, 2**32 - 1), Status.TOO_LARGE),
        (
            "put length 2**64-1",
            request(Op.PUT, ns, 1) + struct.pack("<Q", 2**64 - 1),
            Status.TOO_LARGE,
        ),
        ("put length 0", request(Op.PUT, ns, 1) + struct.pack("<Q", 0), Status.BAD_REQUEST),
        (
            "lengths past the batch",
            request(Op.PUT, ns, 8) + struct.pack("<8Q", *[limits.max_block_bytes] * 8),
            Status.TOO_LARGE,
        ),
        ("namespace length past the name", struct.pack("<BBI", Op.GET, 255, 0) + b"ns", None),
        ("unknown op", struct.pack("<BBI", 77, 2, 1) + b"ns", Status.BAD_REQUEST),
    ]
    num_inputs = num_5xx = 0
    for what, data, expected in transfer_cases:
        with transfer_session(transfer_port) as sock:
            sock.sendall(data)
            sock.shutdown(socket.SHUT_WR)
            got = transfer_reply(sock)
        num_inputs += 1
        num_5xx += got is not None and got[0] == Status.FAILED
        assert (got and got[0]) == expected, (what, got)
    fault_figures.add("hostile_inputs", num_inputs)
    fault_figures.add("hostile_5xx", num_5xx)
    assert call(server.url, "GET", "/healthz")[0] == 200
    assert json.loads(call(server.url, "GET", "/v1/limits")[2])["transfer_port"] == transfer_port


def test_pipelined_requests_are_capped(server: ThreadServer, fault_figures: FaultFigures) -> None:
    # 64 KiB of pipelined heads in one read: uvicorn would queue ~1,800 requests, each with
    # its state, for a client that need not read a single answer.
    req = http_head("GET", "/v1/stats", {"Authorization": f"Bearer {ALICE}"})
    with socket.create_connection(("127.0.0.1", server.config.port), timeout=WAIT_S) as sock:
        sock.sendall(req * ((64 << 10) // len(req)))
        answers = b""
        while chunk := sock.recv(1 << 16):
            answers += chunk
    statuses = [
        int(line.split()[1]) for line in answers.split(b"\r\n") if line.startswith(b"HTTP/1.1 ")
    ]
    fault_figures.add("hostile_inputs", 1)
    # The one being answered and those queued behind it; then the connection ends.
    assert 0 < len(statuses) <= 1 + MAX_PIPELINED and set(statuses) == {200}, statuses
