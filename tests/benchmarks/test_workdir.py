"""benchmarks.workdir: the benchmarks that time a disk refuse a folder that lives in memory."""

from __future__ import annotations

import tempfile

import pytest

from benchmarks.workdir import MEMORY_FILESYSTEMS, disk_work_dir, mount_fstype

# Mount points under a root no machine has, so that resolving the paths cannot follow a link.
MOUNTINFO = "\n".join(
    [
        "22 1 252:1 / / rw,relatime shared:1 - ext4 /dev/vda rw",
        "30 22 0:30 / /ct-test/tmp rw,nosuid shared:5 - tmpfs tmpfs rw,size=100k",
        r"31 22 0:31 / /ct-test/my\040data rw - xfs /dev/vdb rw",
        "32 30 252:1 /srv /ct-test/tmp/bind rw - ext4 /dev/vda rw",
        "33 22 0:33 / /ct-test/shadow rw - ext4 /dev/vdc rw",
        "34 22 0:34 / /ct-test/shadow rw master:3 - ramfs ramfs rw",
        "not a mountinfo line",
        "35 22 0:35 / /ct-test/broken rw no separator here",
    ]
)


@pytest.mark.parametrize(
    ("path", "kind"),
    [
        ("/ct-test/elsewhere/x", "ext4"),  # only the root above it
        ("/ct-test/tmp", "tmpfs"),  # the mount point itself
        ("/ct-test/tmp/a/b", "tmpfs"),
        ("/ct-test/tmpfoo/a", "ext4"),  # a name that merely starts like a mount point
        ("/ct-test/my data/a", "xfs"),  # the kernel's octal escape of a space
        ("/ct-test/tmp/bind/a", "ext4"),  # the deepest mount wins
        ("/ct-test/shadow/a", "ramfs"),  # the later of two mounts on one point hides the first
        ("/ct-test/broken/a", "ext4"),  # a line without " - " is skipped
        ("/ct-test/tmp/../elsewhere", "ext4"),  # the path is normalised first
    ],
)
def test_mount_fstype_takes_the_deepest_mount_above_the_path(path: str, kind: str) -> None:
    assert mount_fstype(path, MOUNTINFO) == kind


def test_mount_fstype_without_a_mount_above_says_none() -> None:
    assert mount_fstype("/ct-test/x", "") is None
    assert mount_fstype("/ct-test/x", "30 22 0:30 / /other rw - tmpfs tmpfs rw") is None


def test_this_machine_shared_memory_is_memory() -> None:
    # /dev/shm is tmpfs wherever Linux runs glibc (systemd and container runtimes mount it).
    assert mount_fstype("/dev/shm") == "tmpfs"
    assert mount_fstype("/proc/self") == "proc"


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
