"""Where a benchmark keeps the files its disk figures read and write: a folder on a disk.

Many systems mount the temp folder as ``tmpfs``. A "disk" tier kept there lives in RAM: its
reads are memory copies, dropping its page cache drops nothing, and a restart "from disk" only
proves that memory outlived a process. Such a run prints figures that look fine and measure the
wrong thing, so the benchmarks that time a disk refuse a memory-backed folder up front and say
which option moves it.
"""

from __future__ import annotations

import sys
import tempfile

from cachetier.util.mounts import MEMORY_FILESYSTEMS, mount_fstype


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
