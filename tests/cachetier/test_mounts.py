"""cachetier.util.mounts: which file system a path lives on, from the kernel's list of mounts."""

from __future__ import annotations

import pytest

from cachetier.util.mounts import mount_fstype

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
