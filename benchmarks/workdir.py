"""Where a benchmark keeps the files its disk figures read and write: a folder on a disk.

Many systems mount the temp folder as ``tmpfs``. A "disk" tier kept there lives in RAM: its
reads are memory copies, dropping its page cache drops nothing, and a restart "from disk" only
proves that memory outlived a process. Such a run prints figures that look fine and measure the
wrong thing, so the benchmarks that time a disk refuse a memory-backed folder up front and say
which option moves it.
"""

from __future__ import annotations

import os
import re
import sys
import tempfile
from pathlib import Path

MEMORY_FILESYSTEMS = frozenset({"tmpfs", "ramfs"})
_MOUNTINFO = Path("/proc/self/mountinfo")
_ESCAPE = re.compile(r"\\([0-7]{3})")


def mount_fstype(path: str | Path, mountinfo: str | None = None) -> str | None:
    """The type of the file system holding ``path``: that of the deepest mount point above it.

    Args:
        path: a file or folder (symbolic links are resolved first).
        mountinfo: the text of ``/proc/self/mountinfo``; read from there when ``None``.

    Returns:
        The type as the kernel names it (``ext4``, ``tmpfs``, ...), or ``None`` where it cannot
        be told (no ``/proc``, or no mount above ``path``).
    """
    if mountinfo is None:
        try:
            mountinfo = _MOUNTINFO.read_text(encoding="utf-8", errors="surrogateescape")
        except OSError:
            return None
    target = os.path.realpath(path)
    best, found = "", None
    for line in mountinfo.splitlines():
        # "<id> <parent> <dev> <root> <mount point> <options> [<optional>...] - <type> ..."
        left, sep, right = line.partition(" - ")
        fields, rest = left.split(), right.split()
        if not sep or len(fields) < 5 or not rest:
            continue
        # The kernel writes a space, tab, newline or backslash in a path as an octal escape.
        mount = _ESCAPE.sub(lambda m: chr(int(m.group(1), 8)), fields[4])
        under = mount == "/" or target == mount or target.startswith(mount.rstrip("/") + "/")
        # ">=": a later mount on the same point hides the earlier one (the list is in order).
        if under and len(mount) >= len(best):
            best, found = mount, rest[0]
    return found


def disk_work_dir(folder: str | None, option: str) -> str | None:
    """``folder`` (``None``: the system temp folder), checked to be on a disk.

    Args:
        folder: where the benchmark will make its temp folders, as given by the user.
        option: the command-line option that sets ``folder``, named in the refusal.

    Returns:
        ``folder`` unchanged, for ``tempfile.TemporaryDirectory(dir=...)``.

    Raises:
        SystemExit: the folder is memory-backed.
    """
    where = folder if folder is not None else tempfile.gettempdir()
    kind = mount_fstype(where)
    if kind in MEMORY_FILESYSTEMS:
        sys.exit(
            f"{where} is on {kind}, which is memory: the disk figures would time RAM. "
            f"Pass {option} a folder on a disk."
        )
    return folder
