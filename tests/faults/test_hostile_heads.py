"""Heads past ``max_head_bytes``, from just over the cap to 256 KiB, sent in one read, in random
chunks and 64 bytes at a time, against a real server: none is served.

Figures: ``oversized_heads_accepted`` (must be 0), ``hostile_inputs``.
"""

from __future__ import annotations

import random
from collections.abc import Iterator

import pytest

from tests.faults.conftest import FaultFigures
from tests.faults.hostile import head_chunkings, oversized_head, status_after
from tests.server.live import TOKENS, ThreadServer, test_config

MAX_HEAD = 32 << 10
SIZES = (MAX_HEAD + 1, 40_800, 62_900, 96 << 10, 128 << 10, 256 << 10)


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
