"""Issue 13, part 2: a generated batch of hostile requests, raw bytes on the sockets, against a
real server: over HTTP, heads whose lengths, framing, Content-Type and token lie, with records
that are bombs, forgeries or noise; over the transfer port, hellos and request streams that lie
about their counts and lengths. Built from the fuzzers' strategies (``tests.faults.fuzzing``).

What must hold: no answer is a 5xx (HTTP) or ``FAILED`` (the transfer port), and the server
is healthy afterwards.

Figures: ``hostile_inputs`` (at least 2,000 here) and ``hostile_5xx``.
"""

from __future__ import annotations

import json
import logging
import re
import socket
import struct
from collections.abc import Callable, Iterator

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cachetier.protocol.http_batch import BATCH_MEDIA_TYPE, RECORD_MEDIA_TYPE
from cachetier.protocol.transfer_frames import Op, Status, error_reply, hello
from cachetier.record import encode_record
from tests.faults.conftest import FaultFigures
from tests.faults.fuzzing import (
    FUZZ_NS,
    KNOWN_BLOCKS,
    OTHER_NS,
    frame,
    fuzz_settings,
    head_len_of,
    mutations,
    near_keys,
    near_namespaces,
)
from tests.faults.hostile import (
    ALICE,
    WAIT_S,
    bomb,
    hostile_config,
    http_exchange,
    read_to_end,
    zeros_block,
)
from tests.server.live import ThreadServer, call
from tests.support import make_blocks

NUM_HTTP = 1400
NUM_TRANSFER = 700
FAILED_REPLY = error_reply(Status.FAILED, "the server failed; see its log")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ThreadServer]:
    running = ThreadServer(hostile_config(tmp_path_factory.mktemp("hostile-batch"))).start()
    yield running
    running.stop()


class Count:
    """Inputs sent and 5xx (or ``FAILED``) answers seen, added to the figures at the end."""

    def __init__(self) -> None:
        self.num_inputs = 0
        self.num_5xx = 0
        self.first_5xx: str | None = None

    def run_and_check(
        self, run: Callable[[], None], caplog: pytest.LogCaptureFixture, figures: FaultFigures
    ) -> None:
        """Run the generated inputs, add what they counted to the figures (also when they
        fail), and fail on any 5xx or any error the server logged while they ran."""
        with caplog.at_level(logging.ERROR, logger="cachetier"):
            try:
                run()
            finally:
                self.num_5xx += len(caplog.records)  # a failure the answers did not show
                figures.add("hostile_inputs", self.num_inputs)
                figures.add("hostile_5xx", self.num_5xx)
        assert self.num_5xx == 0, (self.first_5xx, [r.getMessage() for r in caplog.records])


def _bombs() -> list[bytes]:
    """Records that lie about what they decompress to (made once: one of them is 72 MiB)."""
    seed = KNOWN_BLOCKS[0]
    small = zeros_block(4 << 10, seed)
    return [
        bomb(zeros_block(72 << 20, seed)),
        bomb(small, 1 << 62),
        bomb(small, 3 << 30),
        bomb(small, (1 << 20) + 2),
        bomb(small, (4 << 10) - 2),
        bomb(small, 8 << 10),
        bomb(small),
    ]


BOMBS = _bombs()
VALID = [encode_record(b) for b in KNOWN_BLOCKS]
FOREIGN = [encode_record(b) for b in make_blocks(OTHER_NS, 2, seed=5)]


@st.composite
def records(draw: st.DrawFn) -> bytes:
    """One record: valid, of another namespace, a bomb, changed, or noise."""
    kind = draw(st.sampled_from(["valid", "foreign", "bomb", "changed", "noise"]))
    if kind == "valid":
        return draw(st.sampled_from(VALID))
    if kind == "foreign":
        return draw(st.sampled_from(FOREIGN))
    if kind == "bomb":
        return draw(st.sampled_from(BOMBS))
    if kind == "changed":
        i = draw(st.integers(0, len(KNOWN_BLOCKS) - 1))
        return draw(mutations(VALID[i], head_len_of(KNOWN_BLOCKS[i])))[0]
    return draw(st.binary(max_size=300))


@st.composite
def bodies(draw: st.DrawFn) -> bytes:
    """A body of any endpoint: a record, a batch (framed right or not), JSON keys, noise."""
    kind = draw(st.sampled_from(["record", "batch", "framing", "keys", "json", "noise", "empty"]))
    if kind == "record":
        return draw(records())
    if kind == "batch":
        return frame(draw(st.lists(st.none() | records(), max_size=4)))
    if kind == "framing":
        count = draw(st.sampled_from([0, 1, 2, 64, 65, 2**31, 2**32 - 1]))
        lengths = draw(
            st.lists(st.sampled_from([0, 1, 100, 1 << 20, (1 << 20) + 1, 2**63, 2**64 - 1]))
        )
        head = struct.pack(f"<4sI{len(lengths)}Q", b"CTB1", count, *lengths)
        return head + draw(st.binary(max_size=200))
    if kind == "keys":
        keys = draw(
            st.lists(st.sampled_from([b.key.hex() for b in KNOWN_BLOCKS]) | near_keys(), max_size=8)
        )
        return json.dumps({"keys": keys}).encode()
    if kind == "json":
        return draw(
            st.sampled_from(
                [b'{"keys": 5}', b"[]", b"null", b'{"keys": [' * 50, b'{"keys": []}' * 3, b"\xff"]
            )
        )
    if kind == "noise":
        return draw(st.binary(max_size=2000))
    return b""


def _paths() -> st.SearchStrategy[str]:
    key = KNOWN_BLOCKS[0].key.hex()
    namespaces = st.sampled_from([FUZZ_NS.id, "plain-hostile"]) | near_namespaces()
    tails = st.sampled_from(
        [
            "/lookup",
            "/batch/get",
            "/batch/put",
            "/batch/exists",
            "/batch/delete",
            f"/blocks/{key}",
            "/blocks/" + "zz" * 32,
            "",
        ]
    )
    fixed = st.sampled_from(["/healthz", "/v1/limits", "/v1/stats", "/metrics", "/nothing", "*"])
    return fixed | st.builds(lambda ns, tail: f"/v1/namespaces/{ns}{tail}", namespaces, tails)


AUTHORIZATIONS = {
    "alice": {"Authorization": f"Bearer {ALICE}"},
    "alice as bob": {"Authorization": f"Bearer {ALICE}", "X-Cachetier-Tenant": "bob"},
    "none": {},
    "forged": {"Authorization": "Bearer " + "x" * 22},
    "basic": {"Authorization": f"Basic {ALICE}"},
    "bare": {"Authorization": "Bearer"},
}
CONTENT_TYPES = [
    RECORD_MEDIA_TYPE,
    BATCH_MEDIA_TYPE,
    "application/json",
    "application/json; charset=utf-8",
    "text/plain",
    "multipart/form-data; boundary=x",
    None,
]


@st.composite
def http_requests(draw: st.DrawFn) -> tuple[bytes, bool]:
    """Raw bytes of one request, and whether the client ends its side after them (when the
    body it promised is longer than what it sent, so the test needs no deadline to pass)."""
    method = draw(st.sampled_from(["GET", "POST", "PUT", "DELETE", "HEAD", "PATCH", "OPTIONS"]))
    path = draw(_paths()).replace(" ", "%20").replace("\r", "%0D").replace("\n", "%0A")
    headers = dict(AUTHORIZATIONS[draw(st.sampled_from(sorted(AUTHORIZATIONS)))])
    content_type = draw(st.sampled_from(CONTENT_TYPES))
    if content_type is not None:
        headers["Content-Type"] = content_type
    body = draw(bodies())
    framing = draw(st.sampled_from(["exact", "longer", "shorter", "chunked", "bad chunks", "none"]))
    half_close = False
    if framing == "exact":
        headers["Content-Length"] = str(len(body))
    elif framing == "longer":
        headers["Content-Length"] = str(len(body) + draw(st.sampled_from([1, 1000, 10**9, 10**18])))
        half_close = True
    elif framing == "shorter":
        headers["Content-Length"] = str(max(0, len(body) - draw(st.integers(1, 50))))
    elif framing in ("chunked", "bad chunks"):
        headers["Transfer-Encoding"] = "chunked"
        cut = draw(st.integers(0, len(body)))
        pieces = [p for p in (body[:cut], body[cut:]) if p]
        body = b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in pieces) + b"0\r\n\r\n"
        if framing == "bad chunks":
            body = draw(mutations(body, None))[0]
            half_close = True
    # The server closes after its answer: every answer on the connection is read to its end,
    # a second request made of a body's leftovers included.
    lines = [f"{method} {path} HTTP/1.1", "Host: 127.0.0.1", "Connection: close"]
    lines += [f"{name}: {value}" for name, value in headers.items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body, half_close


def _http_statuses(port: int, data: bytes, half_close: bool) -> list[int]:
    """Send ``data``; the status of every answer until the server closes."""
    answers = http_exchange(port, data, half_close=half_close, read=read_to_end)
    return [int(m) for m in re.findall(rb"HTTP/1\.[01] (\d{3}) ", answers)]


def test_generated_hostile_http_requests_get_no_5xx(
    server: ThreadServer, fault_figures: FaultFigures, caplog: pytest.LogCaptureFixture
) -> None:
    count = Count()
    port = server.config.port

    @fuzz_settings(NUM_HTTP)
    @given(sent=http_requests())
    def run(sent: tuple[bytes, bool]) -> None:
        data, half_close = sent
        count.num_inputs += 1
        for status in _http_statuses(port, data, half_close):
            if status >= 500:
                count.num_5xx += 1
                count.first_5xx = count.first_5xx or repr(data[:300])

    count.run_and_check(run, caplog, fault_figures)
    assert call(server.url, "GET", "/healthz")[0] == 200


@st.composite
def transfer_streams(draw: st.DrawFn) -> bytes:
    """A hello (good or not) and up to three requests whose counts and lengths may lie."""
    first = draw(
        st.sampled_from(
            [
                hello(ALICE, None),
                hello(ALICE, None),
                hello(ALICE, "bob"),
                hello("x" * 20, None),
                hello(None, None),
                b"",
                b"CTX1",
            ]
        )
        | st.binary(max_size=40)
    )
    stream = first
    for _ in range(draw(st.integers(0, 3))):
        op = draw(st.sampled_from([Op.GET, Op.PUT, Op.PUT, 0, 9]))
        namespace = draw(st.sampled_from([FUZZ_NS.id, "plain-hostile", "a/../b", ""]))
        body = [draw(records()) for _ in range(draw(st.integers(0, 3)))]
        count = draw(st.sampled_from([len(body), len(body), 0, 65, 2**32 - 1]))
        stream += struct.pack("<BBI", op, len(namespace), count) + namespace.encode()
        if op == Op.GET:
            stream += b"".join(draw(st.sampled_from(KNOWN_BLOCKS)).key for _ in range(count % 4))
        else:
            lie = draw(st.sampled_from([0, 0, 0, 1, -1, 2**40]))
            lengths = [max(0, len(r) + lie) for r in body][: count % 4]
            stream += b"".join(min(n, 2**64 - 1).to_bytes(8, "little") for n in lengths)
            stream += b"".join(body)
    return stream


def test_generated_hostile_transfer_streams_get_no_failed(
    server: ThreadServer, fault_figures: FaultFigures, caplog: pytest.LogCaptureFixture
) -> None:
    count = Count()
    port = server.config.transfer_port
    assert port is not None

    @fuzz_settings(NUM_TRANSFER)
    @given(stream=transfer_streams())
    def run(stream: bytes) -> None:
        count.num_inputs += 1
        with socket.create_connection(("127.0.0.1", port), timeout=WAIT_S) as sock:
            try:
                sock.sendall(stream)
                sock.shutdown(socket.SHUT_WR)  # the server reads to the end, then closes
            except OSError:
                return  # refused early and closed
            # The server closes after FAILED: it can only be the last reply.
            if read_to_end(sock).endswith(FAILED_REPLY):
                count.num_5xx += 1
                count.first_5xx = count.first_5xx or repr(stream[:300])

    count.run_and_check(run, caplog, fault_figures)
    assert call(server.url, "GET", "/healthz")[0] == 200
