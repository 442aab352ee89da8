"""The server's own bounds: every body's size by its route, bytes in flight over all requests
(503 / ``BUSY`` past them), the write queues in bytes, and the transfer port's budget of
connections before their hello; the config's checks of them, and the command line's deadlines.
(Bad input refused with a 4xx: ``test_server_bad_input``; the hostile clients themselves, and
what they are measured at: ``tests/faults``.)"""

from __future__ import annotations

import socket
import struct
import time
from pathlib import Path

import pytest

from cachetier.primitives.keys import Namespace
from cachetier.protocol.http_batch import BATCH_MEDIA_TYPE
from cachetier.protocol.transfer_frames import REPLY, Op, Status, hello, request
from tests.server.batches import ALICE, batch_body, get_batch, post_batch
from tests.server.live import TOKENS, ThreadServer, call, test_config
from tests.support import SMALL_LAYOUT, make_blocks


@pytest.mark.parametrize(
    "field,value",
    [
        ("head_timeout_s", 0),
        ("body_timeout_s", -1.0),
        ("idle_timeout_s", True),
        ("transfer_hello_timeout_s", "five"),
        ("transfer_unauthenticated_connections", 0),
        ("max_head_bytes", 0),
        ("max_inflight_bytes", 1 << 20),  # below max_batch_bytes
        ("write_queue_bytes", -1),
    ],
)
def test_bounds_are_checked_in_the_config(tmp_path: Path, field: str, value: object) -> None:
    with pytest.raises(ValueError, match=field):
        test_config(tmp_path, max_batch_bytes=4 << 20, **{field: value})


def test_every_body_is_bounded_by_its_route_whatever_its_type(
    shared_server: ThreadServer, own_namespace: Namespace
) -> None:
    ns = own_namespace.id
    limits = shared_server.config
    json_limit = 128 * max(limits.max_keys, limits.max_batch_blocks) + (64 << 10)
    over_json = b"\0" * (json_limit + 1)
    for method, path, ctype in [
        ("POST", f"/v1/namespaces/{ns}/lookup", "application/octet-stream"),
        ("POST", f"/v1/namespaces/{ns}/batch/get", BATCH_MEDIA_TYPE),
        ("POST", f"/v1/namespaces/{ns}/batch/exists", "text/plain"),
        ("DELETE", f"/v1/namespaces/{ns}", "application/octet-stream"),
        ("GET", "/v1/stats", "application/octet-stream"),
        ("POST", "/healthz", "application/octet-stream"),  # a public path: no token needed
    ]:
        status, _, answer = call(
            shared_server.url, method, path, over_json, token=ALICE, content_type=ctype
        )
        assert status == 413 and b"too_large" in answer, (method, path, answer[:200])
    # The record and batch routes take their own, larger limits.
    record_path = f"/v1/namespaces/{ns}/blocks/{'00' * 32}"
    status, _, answer = call(
        shared_server.url,
        "PUT",
        record_path,
        b"\0" * (limits.max_block_bytes + 1),
        token=ALICE,
        content_type="application/json",
    )
    assert status == 413, answer[:200]


def _wait_for(check: object, what: str) -> None:
    """Poll ``check()`` until it is true (bounded: a server thread is to act first)."""
    deadline = time.monotonic() + 10
    while not check():  # type: ignore[operator]
        assert time.monotonic() < deadline, f"still not {what}"
        time.sleep(0.02)


def _inflight(server: ThreadServer) -> float:
    _, _, body = call(server.url, "GET", "/metrics", token=TOKENS["ops"])
    for line in body.decode().splitlines():
        if line.startswith("cachetier_inflight_bytes "):
            return float(line.split()[1])
    raise AssertionError("no cachetier_inflight_bytes in /metrics")


def _transfer_reply(sock: socket.socket) -> tuple[int, int]:
    head = sock.recv(REPLY.size, socket.MSG_WAITALL)
    assert len(head) == REPLY.size, "the server closed without a reply"
    status, value = REPLY.unpack(head)
    if status != Status.OK:
        sock.recv(value, socket.MSG_WAITALL)
    return status, value


def test_uploads_past_the_bytes_in_flight_are_answered_busy(tmp_path: Path) -> None:
    config = test_config(
        tmp_path, transfer_port=0, max_batch_bytes=4 << 20, max_inflight_bytes=4 << 20
    )
    server = ThreadServer(config).start()
    ns = Namespace("busy-model", SMALL_LAYOUT)
    block = make_blocks(ns, 1)[0]
    body = batch_body([block])
    path = f"/v1/namespaces/{ns.id}/batch/put"
    held = socket.create_connection(("127.0.0.1", server.port), timeout=10)
    try:
        # An upload of 3 MiB whose body is still coming holds its 3 MiB.
        held.sendall(
            f"POST {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {ALICE}\r\n"
            f"Content-Type: {BATCH_MEDIA_TYPE}\r\nContent-Length: {3 << 20}\r\n\r\n".encode()
            + body[:100]
        )
        _wait_for(lambda: _inflight(server) >= 3 << 20, "holding the first upload")
        status, headers, answer = call(
            server.url,
            "POST",
            path,
            bytes(2 << 20),
            token=ALICE,
            content_type=BATCH_MEDIA_TYPE,
        )
        assert status == 503 and headers["retry-after"] == "1" and b"busy" in answer
        # The transfer port shares the budget; its connection stays usable after BUSY.
        with socket.create_connection(
            ("127.0.0.1", server.config.transfer_port), timeout=10
        ) as sock:
            sock.sendall(hello(ALICE, None))
            assert _transfer_reply(sock)[0] == Status.OK
            lengths = struct.pack("<2Q", 1 << 20, 1 << 20)
            sock.sendall(request(Op.PUT, ns.id, 2) + lengths + bytes(2 << 20))
            assert _transfer_reply(sock)[0] == Status.BUSY
            sock.sendall(request(Op.GET, ns.id, 1) + block.key)
            assert _transfer_reply(sock) == (Status.OK, 1)
    finally:
        held.close()
    _wait_for(lambda: _inflight(server) == 0, "given back")
    status, _, answer = call(
        server.url, "POST", path, body, token=ALICE, content_type=BATCH_MEDIA_TYPE
    )
    assert status == 200, answer
    server.stop()


def test_a_write_queue_holds_at_most_write_queue_bytes(tmp_path: Path) -> None:
    ns = Namespace("queue-model", SMALL_LAYOUT)
    blocks = make_blocks(ns, 40)  # 2 KiB of payload each
    limit = 16 * len(blocks[0].data)
    server = ThreadServer(
        test_config(tmp_path, sync_puts=False, write_queue_bytes=limit, cpu_bytes=1 << 20)
    ).start()
    try:
        url = server.url
        # More than the queue may hold at once: the disk tier never gets this put.
        status, _ = post_batch(server, ns.id, batch_body(blocks[:20]))
        assert status == 200
        status, _ = post_batch(server, ns.id, batch_body(blocks[20:30]))  # fits
        assert status == 200
        server.restart()  # the queue is flushed to disk; the CPU tier starts empty
        got = get_batch(url, ns.id, [b.key for b in blocks[:30]])
        assert got[:20] == [None] * 20
        assert [g and bytes(g.data) for g in got[20:]] == [b.data for b in blocks[20:30]]
    finally:
        server.stop()


def test_connections_that_never_say_hello_have_a_small_budget_of_their_own(
    tmp_path: Path,
) -> None:
    config = test_config(
        tmp_path,
        transfer_port=0,
        transfer_connections=2,
        transfer_unauthenticated_connections=2,
    )
    server = ThreadServer(config).start()
    port = server.config.transfer_port
    try:
        silent = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(3)]
        # The third took the place of the first, which the server dropped.
        assert silent[0].recv(1) == b""
        # Clients with a token still get both known slots, silent ones or not.
        known = []
        for _ in range(2):
            sock = socket.create_connection(("127.0.0.1", port), timeout=10)
            sock.sendall(hello(ALICE, None))
            assert _transfer_reply(sock)[0] == Status.OK
            known.append(sock)
        # With both known slots taken, a new connection is told BUSY at once.
        with socket.create_connection(("127.0.0.1", port), timeout=10) as extra:
            assert _transfer_reply(extra)[0] == Status.BUSY
        for sock in silent + known:
            sock.close()
    finally:
        server.stop()


def test_the_cli_sets_the_deadlines_and_the_budget_of_unknown_connections(
    tmp_path: Path,
) -> None:
    from cachetier.cli.main import build_parser
    from cachetier.server.config import load_config

    args = build_parser().parse_args(
        [
            "serve",
            "--open",
            "--data-dir",
            str(tmp_path),
            "--head-timeout-s",
            "3",
            "--body-timeout-s",
            "30.5",
            "--idle-timeout-s",
            "9",
            "--transfer-hello-timeout-s",
            "2",
            "--transfer-unauthenticated-connections",
            "4",
        ]
    )
    config = load_config(
        None,
        {},
        open_mode=args.open_mode,
        head_timeout_s=args.head_timeout_s,
        body_timeout_s=args.body_timeout_s,
        idle_timeout_s=args.idle_timeout_s,
        transfer_hello_timeout_s=args.transfer_hello_timeout_s,
        transfer_unauthenticated_connections=args.transfer_unauthenticated_connections,
    )
    got = (
        config.head_timeout_s,
        config.body_timeout_s,
        config.idle_timeout_s,
        config.transfer_hello_timeout_s,
        config.transfer_unauthenticated_connections,
    )
    assert got == (3.0, 30.5, 9.0, 2.0, 4)
    env = {"CACHETIER_HEAD_TIMEOUT_S": "4.5", "CACHETIER_OPEN_MODE": "1"}
    assert load_config(None, env).head_timeout_s == 4.5
