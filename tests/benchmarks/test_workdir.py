"""benchmarks.support.workdir: the benchmarks that time a disk refuse a folder that lives in
memory."""

from __future__ import annotations

import tempfile

import pytest

from benchmarks.support.workdir import disk_work_dir
from cachetier.util.mounts import MEMORY_FILESYSTEMS, mount_fstype


def test_a_memory_folder_is_refused_naming_the_option() -> None:
    with pytest.raises(SystemExit) as refused:
        disk_work_dir("/dev/shm", "--data-dir")
    message = str(refused.value.code)
    assert "/dev/shm is on tmpfs" in message and "--data-dir" in message


def test_the_temp_folder_is_checked_when_no_folder_is_given(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(tempfile, "tempdir", "/dev/shm")
    with pytest.raises(SystemExit, match="--work-dir"):
        disk_work_dir(None, "--work-dir")


def test_a_folder_not_in_memory_is_given_back_unchanged() -> None:
    assert mount_fstype("/proc") not in MEMORY_FILESYSTEMS
    assert disk_work_dir("/proc", "--data-dir") == "/proc"
