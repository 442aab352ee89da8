"""Reads of the disk tier's record files (``cachetier.tiers.disk.reads``): a batch's cold small
files go to the I/O threads, found cold by a non-blocking first read; cached files, one-block
gets, large records and background work read on the data threads as before. The files are
made cold for real (written back, then dropped from the page cache)."""

from __future__ import annotations

import errno
import os
import threading
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pytest

from benchmarks.peers.common import drop_from_page_cache
from cachetier.primitives.keys import Namespace
from cachetier.record import KVBlock, encode_record
from cachetier.tiers.disk import reads as disk_reads
from cachetier.tiers.disk.reads import read_block
from cachetier.tiers.disk.tier import DiskTier, DiskTierConfig
from cachetier.util import parallel
from cachetier.util.mounts import MEMORY_FILESYSTEMS, mount_fstype
from tests.support import make_blocks


@pytest.fixture
def cold_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Callable[[Iterable[Path]], None]:
    """Drops files from the page cache, which needs a file system backed by a disk.

    The process starts these tests knowing of no device that refuses non-blocking reads: what
    an earlier test of the same process met (a worker runs files in an order of its own) must
    not decide which path these reads take."""
    monkeypatch.setattr(disk_reads, "_NO_NOWAIT_DEVICES", set())
    fstype = mount_fstype(tmp_path)
    assert fstype not in MEMORY_FILESYSTEMS, (
        f"{tmp_path} is on {fstype}, which keeps every page in memory: run pytest with"
        " --basetemp on a disk-backed folder"
    )
    return drop_from_page_cache


@pytest.fixture
def io_reads(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """The names of the threads that ran each read handed to the I/O threads."""
    ran: list[str] = []
    submit = parallel.submit_io

    def counted(fn: Callable[[], Any]) -> Future[Any]:
        def run() -> Any:
            ran.append(threading.current_thread().name)
            return fn()

        return submit(run)

    monkeypatch.setattr(parallel, "submit_io", counted)
    yield ran


def _tier(root: Path) -> DiskTier:
    return DiskTier(DiskTierConfig(str(root), 1 << 24, fsync=False))


def _stored(tmp_path: Path, namespace: Namespace, count: int) -> tuple[DiskTier, list[KVBlock]]:
    tier = _tier(tmp_path / "tier")
    blocks = make_blocks(namespace, count)
    assert tier.put_many(namespace.id, blocks) == count
    return tier, blocks


def _paths(tier: DiskTier, namespace: Namespace, blocks: list[KVBlock]) -> list[Path]:
    return [tier.path_of(namespace.id, b.key) for b in blocks]


# A non-blocking read of a page not in memory starts reading it in before it fails, and the
# read succeeds if that finished first (a virtual disk the host caches can answer in
# microseconds): a dropped file is found cold almost always, not always. So what must go
# through the cold path is tried until it has, a few times at most.
ATTEMPTS = 20


def test_a_first_read_without_waiting_fails_on_a_cold_file_only(
    tmp_path: Path,
    namespace: Namespace,
    cold_files: Callable[[Iterable[Path]], None],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    tier, [block] = _stored(tmp_path, namespace, 1)
    [path] = _paths(tier, namespace, [block])
    # Another file system of the process refused non-blocking reads: this one keeps them.
    monkeypatch.setattr(disk_reads, "_NO_NOWAIT_DEVICES", {path.stat().st_dev + 1})
    for _ in range(ATTEMPTS):
        cold_files([path])
        stamp = path.stat().st_mtime_ns
        try:
            read_block(str(path), block.key, None, nowait=True)
        except BlockingIOError:
            assert path.stat().st_mtime_ns == stamp  # nothing read, nothing stamped
            break
    else:
        pytest.fail(f"a cold file was read without waiting {ATTEMPTS} times in a row")
    got, size, _ = read_block(str(path), block.key, None)  # waits for the disk
    assert bytes(got.data) == block.data and size == len(encode_record(block))
    for _ in range(5):  # cached now: never refused
        got, _, _ = read_block(str(path), block.key, None, nowait=True)
        assert bytes(got.data) == block.data


def test_a_batch_reads_its_cold_files_on_the_io_threads(
    tmp_path: Path,
    namespace: Namespace,
    cold_files: Callable[[Iterable[Path]], None],
    io_reads: list[str],
) -> None:
    tier, blocks = _stored(tmp_path, namespace, 6)
    keys = [b.key for b in blocks]
    paths = _paths(tier, namespace, blocks)
    gets = 0
    for _ in range(ATTEMPTS):  # every other file cold: a batch of cold and cached files
        cold_files(paths[1::2])
        got = tier.get_many(namespace.id, keys)
        gets += 1
        assert [bytes(g.data) if g else None for g in got] == [b.data for b in blocks]
        assert len(io_reads) <= 3 * gets  # only the cold ones
        if io_reads:
            break
    assert io_reads and all(n.startswith("cachetier-io") for n in io_reads)
    handed = len(io_reads)
    for _ in range(ATTEMPTS):  # straight into the caller's buffers, from cold files too
        cold_files(paths)
        dests = [memoryview(bytearray(len(b.data))) for b in blocks]
        got = tier.get_into(namespace.id, keys, dests)
        gets += 1
        assert all(g is not None for g in got)
        assert [bytes(d) for d in dests] == [b.data for b in blocks]
        if len(io_reads) > handed:
            break
    assert len(io_reads) > handed
    handed = len(io_reads)
    for _ in range(5):  # all cached now: none goes to the I/O threads
        assert all(g is not None for g in tier.get_many(namespace.id, keys))
        gets += 1
    assert len(io_reads) == handed
    assert tier.stats()["hits"] == 6 * gets and tier.stats()["errors"] == 0


def test_one_block_gets_large_records_and_background_work_read_where_they_are(
    tmp_path: Path,
    namespace: Namespace,
    cold_files: Callable[[Iterable[Path]], None],
    io_reads: list[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    tier, blocks = _stored(tmp_path, namespace, 4)
    keys = [b.key for b in blocks]
    paths = _paths(tier, namespace, blocks)
    cold_files(paths[:1])
    assert tier.get_many(namespace.id, keys[:1])[0] is not None  # one block: no hand-off
    cold_files(paths)
    found: list[bool] = []

    def background() -> None:
        parallel.become_background(0)
        found.extend(g is not None for g in tier.get_many(namespace.id, keys))

    thread = threading.Thread(target=background)
    thread.start()
    thread.join()
    assert found == [True] * 4
    cold_files(paths)
    monkeypatch.setattr(disk_reads, "WIDE_COLD_MAX_BYTES", paths[0].stat().st_size - 1)
    assert all(g is not None for g in tier.get_many(namespace.id, keys))
    assert io_reads == []


def test_cold_corrupt_records_are_misses_and_dropped(
    tmp_path: Path,
    namespace: Namespace,
    cold_files: Callable[[Iterable[Path]], None],
    io_reads: list[str],
) -> None:
    # Every record of the batch corrupt, so whichever is read on an I/O thread is a corrupt one.
    tier = _tier(tmp_path / "tier")
    for attempt in range(ATTEMPTS):
        blocks = make_blocks(namespace, 3, seed=attempt)
        assert tier.put_many(namespace.id, blocks) == 3
        paths = _paths(tier, namespace, blocks)
        for path in paths:
            with open(path, "r+b") as f:  # one payload byte flipped
                f.seek(-5, os.SEEK_END)
                byte = f.read(1)
                f.seek(-5, os.SEEK_END)
                f.write(bytes([byte[0] ^ 0xFF]))
        cold_files(paths)
        assert tier.get_many(namespace.id, [b.key for b in blocks]) == [None] * 3
        assert tier.stats()["corrupt"] == 3 * (attempt + 1)
        assert not any(p.exists() for p in paths)
        if io_reads:
            break
    assert io_reads
    assert tier.stats()["errors"] == 0


def test_without_non_blocking_reads_every_file_is_read_as_cached(
    tmp_path: Path, namespace: Namespace, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A file system that refuses RWF_NOWAIT (EOPNOTSUPP): the read that asked for it is made
    # again as a plain one, and no later read asks.
    monkeypatch.setattr(disk_reads, "_NOWAIT_FLAG", os.RWF_NOWAIT)
    monkeypatch.setattr(disk_reads, "_NO_NOWAIT_DEVICES", set())
    preadv = os.preadv
    refused: list[int] = []

    def no_nowait(fd: int, buffers: list[Any], offset: int, flags: int = 0) -> int:
        if flags:
            refused.append(flags)
            raise OSError(errno.EOPNOTSUPP, "not supported")
        return preadv(fd, buffers, offset)

    monkeypatch.setattr(os, "preadv", no_nowait)
    tier, blocks = _stored(tmp_path, namespace, 3)
    for _ in range(2):
        got = tier.get_many(namespace.id, [b.key for b in blocks])
        assert [bytes(g.data) if g else None for g in got] == [b.data for b in blocks]
    assert len(refused) == 1
    assert disk_reads._NO_NOWAIT_DEVICES == {(tmp_path / "tier").stat().st_dev}
    assert tier.stats()["errors"] == 0
