"""The data paths' threads: results in order, one item's failure kept to itself, nested calls
inline, and copies that land every byte (pieces, odd sizes, read-only sources)."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from cachetier.util.parallel import beside, copy_into, map_in_threads


def test_results_keep_their_order_and_failures_stay_per_item() -> None:
    def work(i: int) -> int:
        if i == 3:
            raise ValueError("three")
        return i * i

    out = map_in_threads(work, list(range(10)))
    assert [r for i, r in enumerate(out) if i != 3] == [i * i for i in range(10) if i != 3]
    assert isinstance(out[3], ValueError)


def test_work_really_runs_on_several_threads_and_workers_do_not_fan_out_again() -> None:
    barrier = threading.Barrier(2, timeout=5)  # only passes if two items run at once

    def work(i: int) -> tuple[str, set[str]]:
        barrier.wait()
        inner = map_in_threads(lambda _: threading.current_thread().name, [0, 1, 2])
        return threading.current_thread().name, set(inner)  # type: ignore[arg-type]

    out = map_in_threads(work, [0, 1], workers=2)
    assert not any(isinstance(r, BaseException) for r in out), out
    on_worker = [inner for name, inner in out if name.startswith("cachetier-data")]  # type: ignore[misc]
    assert len(on_worker) == 1 and len(on_worker[0]) == 1  # a worker ran its inner items inline


@pytest.mark.parametrize("sizes", [[10, 0, 7], [(16 << 20) + 5, 5 << 20, 1, (9 << 20) - 1]])
def test_copies_land_every_byte(sizes: list[int]) -> None:
    rng = np.random.default_rng(0)
    srcs = [memoryview(rng.integers(0, 256, n, dtype=np.uint8).tobytes()) for n in sizes]
    dests = [memoryview(np.zeros(n, dtype=np.uint8)) for n in sizes]
    copy_into(list(zip(dests, srcs)))
    assert [bytes(d) for d in dests] == [bytes(s) for s in srcs]


def test_beside_runs_on_a_data_thread_but_never_from_one() -> None:
    future = beside(lambda: threading.current_thread().name)
    assert future is not None and future.result(timeout=5).startswith("cachetier-data")
    inner = map_in_threads(lambda _: beside(lambda: None), [0, 1], workers=2)
    # Both shares of a parallel map, the caller's included, count as data threads: none may
    # wait on a pool thread that is busy with the other share.
    assert inner == [None, None]
