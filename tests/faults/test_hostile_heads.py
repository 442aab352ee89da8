"""Heads past ``max_head_bytes``, from just over the cap to 256 KiB, sent in one read, in random
chunks and 64 bytes at a time, against a real server: none is served. And the same heads
pipelined behind small requests (with no body, a Content-Length body or a chunked one) in the
same read: the small requests are answered, the oversized head behind them never is.

Figures: ``oversized_heads_accepted`` and ``pipelined_oversized_heads_accepted`` (both must be
0), ``hostile_inputs``.
"""

from __future__ import annotations

import json
import random
import socket
from collections.abc import Iterator

import pytest

from tests.faults.conftest import FaultFigures
from tests.faults.hostile import head_chunkings, http_head, oversized_head, status_after
from tests.server.live import TOKENS, ThreadServer, test_config

MAX_HEAD = 32 << 10
SIZES = (MAX_HEAD + 1, 40_800, 62_900, 96 << 10, 128 << 10, 256 << 10)
PIPELINED_SIZES = (MAX_HEAD + 1, 40_000, 60_000, 96 << 10)
AUTH = {"Authorization": f"Bearer {TOKENS['alice']}"}
_LOOKUP = json.dumps({"keys": ["00" * 32]}).encode()


def _small_requests() -> dict[str, bytes]:
    """Requests to send ahead of an oversized head, each answered 200 on its own."""
    lookup = "/v1/namespaces/heads-model/lookup"
    json_type = {"Content-Type": "application/json"}
    sized = http_head("POST", lookup, {**AUTH, **json_type, "Content-Length": str(len(_LOOKUP))})
    chunked = http_head("POST", lookup, {**AUTH, **json_type, "Transfer-Encoding": "chunked"})
    chunks = b"%x\r\n%s\r\n0\r\n\r\n" % (len(_LOOKUP), _LOOKUP)
    stats = http_head("GET", "/v1/stats", AUTH)
    return {
        "get": stats,
        "three_gets": stats * 3,
        "sized_body": sized + _LOOKUP,
        "chunked_body": chunked + chunks,
    }


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ThreadServer]:
    running = ThreadServer(
        test_config(tmp_path_factory.mktemp("heads"), max_head_bytes=MAX_HEAD)
    ).start()
    yield running
    running.stop()


def test_no_head_over_the_cap_is_served_in_any_chunking(
    server: ThreadServer, fault_figures: FaultFigures
) -> None:
    rng = random.Random(51)
    served = []
    for size in SIZES:
        data = oversized_head(TOKENS["alice"], size)
        for name, chunks in head_chunkings(len(data), rng).items():
            status = status_after(server.port, data, chunks)
            fault_figures.add("hostile_inputs")
            if status is not None and status < 400:
                served.append((size, name, status))
    fault_figures.add("oversized_heads_accepted", len(served))
    assert not served, served
    # The server is still there for a head under the cap.
    ok = oversized_head(TOKENS["alice"], MAX_HEAD - 200)
    assert status_after(server.port, ok, [len(ok)]) == 200


def statuses_after(port: int, data: bytes, chunks: list[int]) -> list[int]:
    """Send ``data`` in ``chunks`` on one connection and read every answer until the server
    closes it (or stops answering): their statuses, in order."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        at = 0
        try:
            for size in chunks:
                sock.sendall(data[at : at + size])
                at += size
        except OSError:
            pass  # refused and closed while sending: read the answers
        stream = sock.makefile("rb")
        statuses = []
        try:
            while line := stream.readline():
                statuses.append(int(line.split(b" ", 2)[1]))
                length = 0
                while (header := stream.readline()) not in (b"\r\n", b""):
                    name, _, value = header.partition(b":")
                    if name.strip().lower() == b"content-length":
                        length = int(value)
                stream.read(length)
        except (OSError, ValueError, IndexError):
            pass  # reset, timed out, or cut short: what was answered is what counts
        return statuses


def test_no_head_over_the_cap_is_served_behind_another_request(
    server: ThreadServer, fault_figures: FaultFigures
) -> None:
    rng = random.Random(65)
    served, lost = [], []
    for ahead_name, ahead in _small_requests().items():
        num_ahead = ahead.count(b"HTTP/1.1\r\n")
        for size in PIPELINED_SIZES:
            data = ahead + oversized_head(TOKENS["alice"], size)
            for name, chunks in (("one_write", [len(data)]), ("random", _chunks(data, rng))):
                statuses = statuses_after(server.port, data, chunks)
                fault_figures.add("hostile_inputs")
                # Every answer after the small requests' own is one to the oversized head.
                if any(status < 400 for status in statuses[num_ahead:]):
                    served.append((ahead_name, size, name, statuses))
                if statuses[:num_ahead] != [200] * num_ahead:
                    lost.append((ahead_name, size, name, statuses))
    fault_figures.add("pipelined_oversized_heads_accepted", len(served))
    assert not served, served
    assert not lost, f"requests under the cap ahead of an oversized head went unanswered: {lost}"


def test_heads_under_the_cap_pipelined_in_one_write_are_all_served(server: ThreadServer) -> None:
    for ahead_name, ahead in _small_requests().items():
        num_ahead = ahead.count(b"HTTP/1.1\r\n")
        near_cap = oversized_head(TOKENS["alice"], MAX_HEAD - 200)
        data = ahead + near_cap + http_head("GET", "/healthz", {"Connection": "close"})
        assert statuses_after(server.port, data, [len(data)])[: num_ahead + 1] == [200] * (
            num_ahead + 1
        ), ahead_name


def _chunks(data: bytes, rng: random.Random) -> list[int]:
    return head_chunkings(len(data), rng)["random"]
