"""The file system a path lives on, from the kernel's list of mounts.

A disk tier (or a benchmark's "disk") on ``tmpfs`` or ``ramfs`` is memory: it takes RAM, is gone
after a reboot, and has no page cache to drop. The tier says so when it opens such a folder;
the benchmarks that time a disk refuse one.
"""

from __future__ import annotations

import os
import re
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
