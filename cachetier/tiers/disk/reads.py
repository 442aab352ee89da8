"""Reading one record file of the disk tier, and telling a cold file from a cached one.

``read_block`` reads and checks a record. Asked to (``nowait``), the first read of a small
record is made with ``RWF_NOWAIT``: a file whose first page is not in memory then raises
``BlockingIOError`` at once instead of waiting for the disk, costing nothing more on a cached
file (the flag rides on the read the record needs anyway). Almost always: the kernel starts
reading the page in before it gives up, and a device that answers within microseconds (a
virtual disk the host caches) lets the read succeed, which is then as good as a cached file.
The tier reads a batch's cached files on its data threads, one per core, and hands the cold
ones to the I/O threads, which are many: a thread waiting on the disk takes no core, and more
small reads in flight hide the device's latency (``parallel.submit_io``).
"""

from __future__ import annotations

import errno
import logging
import os
import time

from cachetier.errors import CorruptBlockError
from cachetier.primitives.keys import BlockHash
from cachetier.record import KVBlock, read_record
from cachetier.tiers.disk.files import stamp_file
from cachetier.util.landing import Destination

log = logging.getLogger(__name__)

# Only files up to this size go to the I/O threads when cold. A small record's read is mostly
# the device's latency, which more reads in flight hide; a large one's is its bandwidth, which
# the kernel's readahead of a few streams already fills: more threads speed up cold 512 KiB
# records and slow down cold multi-megabyte ones.
WIDE_COLD_MAX_BYTES = 2 << 20

# 0 where the platform has no non-blocking buffered reads (then every file is read as if
# cached): Linux 4.14+ has them, with ext4, xfs and btrfs among the file systems.
_NOWAIT_FLAG = getattr(os, "RWF_NOWAIT", 0)
# The devices (st_dev) whose file system refused one (tmpfs on older kernels, some network and
# FUSE file systems): their files are read as if cached from then on. Per device, so that one
# tier on such a file system leaves the others of the process their cold reads.
_NO_NOWAIT_DEVICES: set[int] = set()


class CorruptFile(CorruptBlockError):
    """A record file failed a check; ``inode`` says which file, in case it is replaced."""

    def __init__(self, message: str, inode: int) -> None:
        super().__init__(message)
        self.inode = inode


def read_block(
    path: str, key: BlockHash, dest: Destination | None, *, nowait: bool = False
) -> tuple[KVBlock, int, int]:
    """The checked block in ``path``, the file's size, and the LRU stamp it was given.

    A record that fails a check is corrupt, unless the file changed while it was read: its
    process made it a spare and is writing over it (a rename and a write change its ctime).
    That is a miss (``FileNotFoundError``), and the file is not removed as corrupt.

    Args:
        path: the record file.
        key: the key asked for.
        dest: where the payload goes (``read_record``'s ``payload_into``), or ``None``.
        nowait: raise ``BlockingIOError`` instead of waiting if the file's first page is not
            in memory (nothing is read or stamped then), for files of at most
            ``WIDE_COLD_MAX_BYTES``; larger ones are read either way.

    Raises:
        FileNotFoundError: no such file, or it changed while it was read.
        CorruptFile: the record failed a check.
        BlockingIOError: ``nowait`` and the file is cold.
        OSError: the file could not be read.
    """
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        nowait = nowait and st.st_size <= WIDE_COLD_MAX_BYTES and _nowait_on(st.st_dev)
        reads = _Reads(fd, st.st_dev if nowait else None)
        try:
            block = read_record(
                reads.readinto,
                st.st_size,
                key=key,
                payload_into=dest,
                trusted_size=True,
                pread=reads.pread,
            )
        except CorruptBlockError as e:
            now = os.fstat(fd)
            if (now.st_ctime_ns, now.st_size) != (st.st_ctime_ns, st.st_size):
                raise FileNotFoundError(f"{path} changed while it was read") from e
            raise CorruptFile(str(e), st.st_ino) from e
        # The mtime carries the LRU order across processes. Set through the descriptor: no
        # second path lookup, and it is the inode just read that is stamped.
        stamp = time.time_ns()
        stamp_file(fd, stamp)
        return block, st.st_size, stamp
    finally:
        os.close(fd)


def _nowait_on(device: int) -> bool:
    return _NOWAIT_FLAG != 0 and device not in _NO_NOWAIT_DEVICES


class _Reads:
    """A record file's read functions for ``read_record``; the first read, whichever of the
    two it is, is non-blocking when ``nowait_device`` (the file's ``st_dev``) is set."""

    __slots__ = ("_fd", "_nowait_device")

    def __init__(self, fd: int, nowait_device: int | None) -> None:
        self._fd = fd
        self._nowait_device = nowait_device

    def readinto(self, buf: memoryview) -> int:
        if (device := self._nowait_device) is not None:
            self._nowait_device = None
            return _first_read(self._fd, buf, -1, device)  # -1: at (and moving) the position
        return os.readv(self._fd, [buf])

    def pread(self, buf: memoryview, offset: int) -> int:
        if (device := self._nowait_device) is not None:
            self._nowait_device = None
            return _first_read(self._fd, buf, offset, device)
        return os.preadv(self._fd, [buf], offset)


def _first_read(fd: int, buf: memoryview, offset: int, device: int) -> int:
    try:
        return os.preadv(fd, [buf], offset, _NOWAIT_FLAG)
    except BlockingIOError:
        raise  # cold: the caller reads the file where waiting costs no core
    except OSError as exc:
        if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
            raise
        if device not in _NO_NOWAIT_DEVICES:  # this file system cannot: read as if cached
            _NO_NOWAIT_DEVICES.add(device)
            log.warning(
                "non-blocking reads refused on device %#x (%s): its cold record files are "
                "read on the data threads from now on",
                device,
                errno.errorcode.get(exc.errno, exc.errno),
            )
        return os.readv(fd, [buf]) if offset < 0 else os.preadv(fd, [buf], offset)
