"""The heap trimmer: a trim once a burst of ended connections is over, never while one goes on
or while ``busy`` says so."""

from __future__ import annotations

import asyncio

import pytest

from cachetier.server.heap import HeapTrimmer

SETTLE_S = 0.05


async def _settled() -> None:
    await asyncio.sleep(3 * SETTLE_S)


def test_a_trim_follows_a_burst_once_it_is_over() -> None:
    async def run() -> None:
        busy = [False]
        heap = HeapTrimmer(asyncio.get_running_loop(), lambda: busy[0], 3, SETTLE_S)
        if not heap.can_trim:
            pytest.skip("no malloc_trim in this C library")
        heap.note_ended()
        heap.note_ended()
        await _settled()
        assert heap.num_trims == 0  # 2 ended: no burst yet
        busy[0] = True
        heap.note_ended()
        await _settled()
        assert heap.num_trims == 0  # a burst, but handshakes are still in progress
        busy[0] = False
        await _settled()
        assert heap.num_trims == 1  # glibc's malloc_trim, for real
        heap.note_ended()
        await _settled()
        assert heap.num_trims == 1  # counting starts again
        heap.close()

    asyncio.run(run())


def test_no_trim_while_connections_keep_ending() -> None:
    async def run() -> None:
        settle_s = 0.5  # long beside the steps: a slow loop turn does not end the burst
        heap = HeapTrimmer(asyncio.get_running_loop(), threshold=3, settle_s=settle_s)
        if not heap.can_trim:
            pytest.skip("no malloc_trim in this C library")
        for _ in range(30):  # 3 ends every step: the burst goes on
            for _ in range(3):
                heap.note_ended()
            await asyncio.sleep(settle_s / 10)
        trims_during = heap.num_trims
        await asyncio.sleep(3 * settle_s)
        heap.close()
        assert trims_during == 0 and heap.num_trims == 1

    asyncio.run(run())


def test_a_threshold_must_be_positive() -> None:
    with pytest.raises(ValueError, match="threshold must be positive"):
        asyncio.run(_make_with_threshold(0))


async def _make_with_threshold(threshold: int) -> HeapTrimmer:
    return HeapTrimmer(asyncio.get_running_loop(), threshold=threshold)
