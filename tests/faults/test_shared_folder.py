"""One disk tier folder shared by several processes of one node (engine pods mounting one host
folder): 4 writer processes and 2 processes reopening the folder all the time, at once, under
one capacity; then a fresh process reads everything back.

Figures: ``shared_folder_writes_failed`` and ``shared_folder_blocks_lost`` (both must be 0),
``shared_folder_peak_bytes_over_capacity`` (sampled from the folder while the writers run) and
``shared_folder_batch_bytes`` (one ``put_many``'s bytes: the most the peak may be).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import pytest

from cachetier.record import encode_record
from cachetier.tiers.disk.budget import Ledger
from cachetier.tiers.disk.files import read_boot_id
from cachetier.tiers.disk.tier import DiskTier, DiskTierConfig
from tests.faults.writer import crash_blocks

ROOT = Path(__file__).resolve().parents[2]
NUM_WRITERS = 4
NUM_REOPENERS = 2
NUM_BATCHES = 25  # per writer
BATCH_BLOCKS = 4
RECORD_BYTES = len(encode_record(crash_blocks(0, 1)[0]))
BATCH_BYTES = BATCH_BLOCKS * RECORD_BYTES


class Worker:
    """``tests.faults.shared_worker`` in a child process."""

    def __init__(self, *args: object) -> None:
        # stderr to a file: a pipe read beside the stdout we read line by line could stall.
        self._stderr = tempfile.TemporaryFile(mode="w+")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.faults.shared_worker", *map(str, args)],
            cwd=ROOT,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
            stdout=subprocess.PIPE,
            stderr=self._stderr,
            text=True,
        )

    def wait_ready(self) -> None:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline().strip()
        if line != "ready":
            self.proc.kill()
            raise AssertionError(f"the worker did not start: {line!r}\n{self._errors()}")

    def result(self) -> dict:
        assert self.proc.stdout is not None
        out = self.proc.stdout.read()
        self.proc.wait(timeout=600)
        assert self.proc.returncode == 0, self._errors()
        return json.loads(out.strip().splitlines()[-1])

    def _errors(self) -> str:
        self.proc.wait(timeout=60)
        self._stderr.seek(0)
        return self._stderr.read()


def _folder_bytes(root: Path) -> int:
    """Bytes of every record and temp file (the ledger and the owner marks left out)."""
    total = 0
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if not d.startswith(".")]
        for name in filenames:
            if dirpath == str(root):
                continue  # the ledger
            try:
                total += os.lstat(os.path.join(dirpath, name)).st_size
            except FileNotFoundError:
                pass
    return total


class PeakMonitor(threading.Thread):
    """Samples the folder under the ledger's lock (so no rename or eviction is half-seen; temp
    files being written count with what they hold so far) while the writers run."""

    def __init__(self, root: Path) -> None:
        super().__init__(daemon=True)
        self._root = root
        self._done = threading.Event()
        self.samples = 0
        self.peak_disk = 0  # largest sum of file sizes seen
        self.peak_ledger = 0  # largest count of the ledger seen (records + reservations)
        self.undercount = 0  # most bytes found on disk beyond what the ledger counted

    def run(self) -> None:
        ledger = Ledger(self._root, read_boot_id(), 0o600, make_root=lambda: None)
        try:
            while not self._done.is_set():
                with ledger.locked() as state:
                    if state.heal_reason is None:
                        on_disk = _folder_bytes(self._root)
                        self.peak_disk = max(self.peak_disk, on_disk)
                        self.peak_ledger = max(self.peak_ledger, state.used_bytes)
                        self.undercount = max(self.undercount, on_disk - state.used_bytes)
                        self.samples += 1
                self._done.wait(0.003)  # leave the lock to the writers most of the time
        finally:
            ledger.close()

    def stop(self) -> None:
        self._done.set()
        self.join(30)


def _run_shared(root: Path, capacity: int, monitor: PeakMonitor | None = None) -> dict:
    """4 writers and 2 reopeners at once on ``root``; what each reported."""
    stop_file = root.parent / f"{root.name}.stop"
    DiskTier(DiskTierConfig(str(root), capacity)).close()  # the folder and its ledger exist
    reopeners = [Worker("reopen", root, capacity, stop_file) for _ in range(NUM_REOPENERS)]
    for w in reopeners:
        w.wait_ready()
    writers = [
        Worker("write", root, capacity, seed, NUM_BATCHES, BATCH_BLOCKS)
        for seed in range(NUM_WRITERS)
    ]
    for w in writers:
        w.wait_ready()
    if monitor is not None:
        monitor.start()
    written = [w.result() for w in writers]
    stop_file.touch()
    reopened = [w.result() for w in reopeners]
    if monitor is not None:
        monitor.stop()
    return {"writers": written, "reopeners": reopened}


def _read_back(root: Path, capacity: int) -> list[dict]:
    """A fresh process per writer's seed reads all that writer's blocks."""
    readers = [
        Worker("read", root, capacity, seed, NUM_BATCHES * BATCH_BLOCKS)
        for seed in range(NUM_WRITERS)
    ]
    for r in readers:
        r.wait_ready()
    return [r.result() for r in readers]


def test_four_writers_and_two_reopeners_lose_nothing(tmp_path: Path, fault_figures) -> None:
    # Room for everything: any block missing afterwards is lost, not evicted.
    root = tmp_path / "shared"
    capacity = 1 << 30
    runs = _run_shared(root, capacity)
    writers, reopeners = runs["writers"], runs["reopeners"]
    failed = sum(w["failed"] for w in writers)
    evictions = sum(w["stats"]["evictions"] for w in writers)
    evictions += sum(r["evictions"] for r in reopeners)
    read = _read_back(root, capacity)
    lost = sum(len(set(w["acked"]) - set(r["intact"])) for w, r in zip(writers, read))
    wrong = sum(len(r["wrong"]) for r in read)
    fault_figures.add("shared_folder_writes_failed", failed)
    fault_figures.add("shared_folder_blocks_lost", lost)
    fault_figures.add("corrupt_served", wrong)
    assert (failed, lost, wrong, evictions) == (0, 0, 0, 0)
    assert all(r["opens"] >= 2 for r in reopeners), "the reopeners must overlap the writers"
    assert all(w["stats"]["errors"] == 0 for w in writers)
    assert all(r["errors"] == 0 for r in reopeners)
    leftovers = [n for _, _, names in os.walk(root) for n in names if n.startswith(".tmp-")]
    assert leftovers == []


@pytest.mark.parametrize("capacity_batches", [10, 2])
def test_one_small_capacity_for_all_processes(
    tmp_path: Path, fault_figures, capacity_batches: int
) -> None:
    # Room for 10 of the 100 batches, then for fewer batches than the 4 writers have in
    # flight at once: the folder stays within one batch of the capacity whatever the number
    # of processes, and every block is either there or was evicted.
    root = tmp_path / "shared"
    capacity = capacity_batches * BATCH_BYTES
    monitor = PeakMonitor(root)
    runs = _run_shared(root, capacity, monitor)
    writers, reopeners = runs["writers"], runs["reopeners"]
    failed = sum(w["failed"] for w in writers)
    evictions = sum(w["stats"]["evictions"] for w in writers)
    evictions += sum(r["evictions"] for r in reopeners)
    read = _read_back(root, capacity)
    present = sum(len(r["intact"]) for r in read)
    wrong = sum(len(r["wrong"]) for r in read)
    written = NUM_WRITERS * NUM_BATCHES * BATCH_BLOCKS
    # A block neither found nor evicted by some process would be lost.
    lost = written - present - evictions
    peak_over = max(0, monitor.peak_disk - capacity)
    fault_figures.add("shared_folder_writes_failed", failed)
    fault_figures.add("shared_folder_blocks_lost", lost)
    fault_figures.add("corrupt_served", wrong)
    worst = max(peak_over, fault_figures.values.get("shared_folder_peak_bytes_over_capacity", 0))
    fault_figures.set("shared_folder_peak_bytes_over_capacity", worst)
    fault_figures.set("shared_folder_batch_bytes", BATCH_BYTES)
    # Which of the tier's counters the failures went to (refused for room, or an error).
    causes = [{k: w["stats"][k] for k in ("rejected", "errors")} for w in writers]
    assert (failed, lost, wrong) == (0, 0, 0), causes
    assert monitor.samples > 0
    assert peak_over <= BATCH_BYTES
    assert monitor.peak_ledger <= capacity + BATCH_BYTES
    assert monitor.undercount <= 0, "the ledger must never count less than the folder holds"
    with DiskTier(DiskTierConfig(str(root), capacity)) as tier:
        on_disk = _folder_bytes(root)
        assert tier.heals == 0, "a ledger kept by live processes needs no healing"
        assert tier.folder_bytes() == on_disk <= capacity
        assert len(tier) == present


def test_a_reader_never_sees_a_torn_block(tmp_path: Path, fault_figures) -> None:
    # One process replaces, deletes and (through a capacity of 6 blocks) evicts 12 keys while
    # another reads them: each read is a whole record of one of the two versions, or a miss.
    root = tmp_path / "shared"
    stop_file = tmp_path / "stop"
    DiskTier(DiskTierConfig(str(root), 6 * RECORD_BYTES)).close()
    churn = Worker("churn", root, 6 * RECORD_BYTES, 12, stop_file)
    churn.wait_ready()
    watch = Worker("watch", root, 12, 150)
    watch.wait_ready()
    seen = watch.result()
    stop_file.touch()
    churned = churn.result()
    fault_figures.add("corrupt_served", seen["wrong"])
    assert seen["wrong"] == 0
    assert seen["stats"]["corrupt"] == 0, "a replaced or evicted file never reads as damaged"
    assert seen["hits"] > 0 and churned["rounds"] > 0
    assert churned["stats"]["evictions"] > 0
