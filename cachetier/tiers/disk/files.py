"""Files of the disk tier that are not records: who owns a temp file, folder modes, fsyncs and
the scan of a folder.

Several processes (engine pods on one node) may share one folder, each in its own PID
namespace, so a pid alone does not say whether a temp file's writer still runs: pod A's pid 7
is not pod B's. Each open tier instead holds an exclusive ``flock`` on a mark file of its own,
``<root>/.owners/<owner id>``; the kernel drops that lock when the process dies, however it
dies, and every process on the node sees the same lock. A temp file carries its writer's owner
id in its name, so "is its writer alive?" is one non-blocking ``flock`` on the writer's mark.
The owner id also holds the boot id, so a temp file from before a reboot is an orphan at once.

``FolderFiles`` is one open tier's hold on these files: it takes the folder's settings once,
at open, and every later look at the folder (a scan, an orphan, an owner) goes through it.
"""

from __future__ import annotations

import fcntl
import os
import secrets
import time
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from cachetier.errors import TierUnavailableError
from cachetier.primitives.keys import HASH_BYTES, parse_key
from cachetier.tiers.base import check_namespace
from cachetier.tiers.disk.config import DiskTierConfig

SUFFIX = ".ctkv"
TMP_PREFIX = ".tmp-"
OWNERS_DIR = ".owners"
_NEW_MARK_PREFIX = ".new-"  # a mark being created (never ``.tmp-``: those are record writes)
_BOOT_ID_PATH = "/proc/sys/kernel/random/boot_id"


def read_boot_id() -> str:
    """This boot of the kernel as 32 hex digits (``"0" * 32`` where the kernel does not say).

    Returns:
        The boot id, the same for every process (and pod) of the node until it reboots.
    """
    try:
        with open(_BOOT_ID_PATH, encoding="ascii") as f:
            text = f.read().strip().replace("-", "")
    except OSError:
        return "0" * 32
    return text if len(text) == 32 and all(c in "0123456789abcdef" for c in text) else "0" * 32


def new_owner_id(boot_id: str) -> str:
    """``<boot id>-<pid>-<random>``: the random part keeps ids apart across PID namespaces."""
    return f"{boot_id}-{os.getpid()}-{secrets.token_hex(4)}"


def temp_name(owner_id: str) -> str:
    """The name of a new temp file written by ``owner_id`` (unique: it ends in 64 random bits)."""
    return f"{TMP_PREFIX}{owner_id}-{secrets.token_hex(8)}"


def owner_of_temp(name: str) -> tuple[str, str] | None:
    """``(boot id, owner id)`` of a temp file's writer, or ``None`` for a name without one (a
    temp file of an older cachetier)."""
    parts = name[len(TMP_PREFIX) :].split("-")
    if not name.startswith(TMP_PREFIX) or len(parts) != 4 or len(parts[0]) != 32:
        return None
    return parts[0], "-".join(parts[:3])


def ensure_dir(path: Path, mode: int, fsync: bool) -> None:
    """Create ``path`` and its missing parents with ``mode``; an existing folder is left as is.

    Args:
        path: the folder.
        mode: permission bits of each folder created (set exactly, whatever the umask).
        fsync: fsync the parent of each folder created, so its entry survives a power loss.
    """
    try:
        os.mkdir(path, mode)
    except FileExistsError:
        return
    except FileNotFoundError:
        ensure_dir(path.parent, mode, fsync)
        try:
            os.mkdir(path, mode)
        except FileExistsError:
            return
    if mode & 0o077:  # the usual umasks only take group and other bits away
        os.chmod(path, mode)
    if fsync:
        fsync_dir(path.parent)


def fsync_dir(path: str | Path) -> None:
    """fsync a folder: its entries (a rename, a new file or folder) then survive a power loss."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def stamp_file(path: Path | str | int, stamp_ns: int) -> None:
    """Set a file's mtime (the LRU stamp every process sharing the folder reads) to
    ``stamp_ns``; a file of another user only lets us set it to now, and that is enough.
    ``path`` may be an open descriptor of the file (no path lookup)."""
    try:
        os.utime(path, ns=(stamp_ns, stamp_ns))
    except PermissionError:
        try:
            os.utime(path)
        except OSError:
            pass
    except OSError:
        pass


class OwnerMark:
    """This tier's mark file under ``<root>/.owners``, exclusively ``flock``-ed while it is open.

    Args:
        root: the tier's folder.
        owner_id: this tier's owner id (``new_owner_id``).
        file_mode: permission bits of the mark.
        dir_mode: permission bits of ``.owners`` if it must be created.
    """

    def __init__(self, root: Path, owner_id: str, file_mode: int, dir_mode: int) -> None:
        self.owner_id = owner_id
        self._folder = root / OWNERS_DIR
        self._file_mode = file_mode
        self._dir_mode = dir_mode
        self._fd = -1
        self._ino = -1
        self._finalizer = weakref.finalize(self, _close_fd, [self._fd])
        self.ensure()

    @property
    def path(self) -> Path:
        return self._folder / self.owner_id

    def ensure(self) -> None:
        """(Re)create the mark if it is gone, e.g. after the whole folder was deleted."""
        try:
            if os.stat(self.path).st_ino == self._ino:
                return
        except FileNotFoundError:
            pass
        self.close()
        ensure_dir(self._folder, self._dir_mode, fsync=False)
        # Locked under a side name, then renamed: a mark is never seen unlocked, so nobody
        # takes a starting process for a dead one.
        side = self._folder / f"{_NEW_MARK_PREFIX}{self.owner_id}"
        fd = os.open(side, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, self._file_mode)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.replace(side, self.path)
        except BaseException:
            os.close(fd)
            raise
        self._fd, self._ino = fd, os.fstat(fd).st_ino
        self._finalizer.detach()
        self._finalizer = weakref.finalize(self, _close_fd, [fd])

    def close(self) -> None:
        """Remove the mark and drop its lock."""
        if self._fd < 0:
            return
        try:
            if os.stat(self.path).st_ino == self._ino:
                os.unlink(self.path)
        except OSError:
            pass
        self._finalizer()
        self._fd = self._ino = -1


def _close_fd(holder: list[int]) -> None:
    try:
        os.close(holder[0])
    except OSError:
        pass


def owner_alive(root: Path, owner_id: str, boot_id: str) -> bool:
    """Whether the tier that wrote as ``owner_id`` may still be running.

    Args:
        root: the tier's folder.
        owner_id: the owner id to check.
        boot_id: this boot's id; an owner of another boot is gone.

    Returns:
        ``False`` when the owner is surely gone (another boot, no mark, or a mark nobody
        locks); ``True`` when it runs or we cannot tell (a mark we may not open).
    """
    if not owner_id.startswith(boot_id):
        return False
    try:
        fd = os.open(root / OWNERS_DIR / owner_id, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return False
    except OSError:
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:
        return True
    finally:
        os.close(fd)
    return False


def reap_dead_marks(root: Path) -> None:
    """Remove the marks of owners that are gone (their lock is free)."""
    folder = root / OWNERS_DIR
    try:
        names = os.listdir(folder)
    except OSError:
        return
    for name in names:
        try:
            if name.startswith(_NEW_MARK_PREFIX) and not _older_than(folder / name, 60.0):
                continue  # being created: its owner takes the lock a moment after creating it
            fd = os.open(folder / name, os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.unlink(folder / name)  # still locked by us: nobody can be relying on it
        except OSError:
            pass
        finally:
            os.close(fd)


def _older_than(path: Path, age_s: float) -> bool:
    return time.time_ns() - os.lstat(path).st_mtime_ns > age_s * 1e9


@dataclass(slots=True)
class FolderScan:
    """What a scan of a tier's folder found.

    Args:
        records: ``(mtime ns, namespace, key, size)`` of every record file.
        temps: ``(path, name, mtime ns)`` of every temp file.
    """

    records: list[tuple[int, str, bytes, int]] = field(default_factory=list)
    temps: list[tuple[str, str, int]] = field(default_factory=list)

    @property
    def record_bytes(self) -> int:
        return sum(size for _, _, _, size in self.records)


def scan_folder(root: Path) -> FolderScan:
    """List every record and temp file under ``root`` (one ``scandir`` per shard).

    Folders that vanish while they are scanned (another process clears a namespace) are
    skipped, as are names that are not namespaces (``.owners``, the ledger) or not records.

    Args:
        root: the tier's folder.

    Returns:
        The records, ordered by mtime (oldest first), and the temp files.
    """
    scan = FolderScan()
    for ns_entry in _entries(root):
        if not ns_entry.is_dir(follow_symlinks=False):
            continue
        try:
            check_namespace(ns_entry.name)
        except ValueError:
            continue
        for shard in _entries(ns_entry.path):
            if not shard.is_dir(follow_symlinks=False):
                continue
            for entry in _entries(shard.path):
                name = entry.name
                if name.startswith(TMP_PREFIX):
                    try:
                        mtime_ns = entry.stat(follow_symlinks=False).st_mtime_ns
                    except OSError:
                        continue
                    scan.temps.append((entry.path, name, mtime_ns))
                    continue
                if not name.endswith(SUFFIX) or len(name) != 2 * HASH_BYTES + len(SUFFIX):
                    continue
                try:
                    # parse_key, not bytes.fromhex: a stray name with spaces in it would give
                    # a short key that later breaks eviction.
                    key = parse_key(name[: 2 * HASH_BYTES])
                    st = entry.stat(follow_symlinks=False)
                except (ValueError, OSError):
                    continue
                scan.records.append((st.st_mtime_ns, ns_entry.name, bytes(key), st.st_size))
    scan.records.sort()
    return scan


def namespace_records(root: Path, namespace: str) -> list[str]:
    """Paths of the record files of one namespace (its temp files left out)."""
    return [
        entry.path
        for shard in _entries(root / namespace)
        if shard.is_dir(follow_symlinks=False)
        for entry in _entries(shard.path)
        if entry.name.endswith(SUFFIX) and not entry.name.startswith(TMP_PREFIX)
    ]


def _entries(path: str | Path) -> Iterator[os.DirEntry[str]]:
    # One entry at a time: a list of a shard's entries would keep thousands of objects alive.
    try:
        it = os.scandir(path)
    except (FileNotFoundError, NotADirectoryError):
        return
    with it:
        yield from it


def is_orphan_temp(root: Path, name: str, mtime_ns: int, boot_id: str, max_age_s: float) -> bool:
    """Whether a temp file can be removed: its writer is gone, or it is older than
    ``max_age_s`` (a write that old is stuck for good). Another live writer's temp file is an
    in-flight write and is never an orphan before that age.

    Args:
        root: the tier's folder.
        name: the temp file's name.
        mtime_ns: its mtime.
        boot_id: this boot's id.
        max_age_s: the age past which any temp file is an orphan.

    Returns:
        ``True`` if it may be deleted.
    """
    if time.time_ns() - mtime_ns > max_age_s * 1e9:
        return True
    owner = owner_of_temp(name)
    if owner is None:  # an older cachetier's write: its age is all we can go by
        return False
    return not owner_alive(root, owner[1], boot_id)


def unlink_quietly(path: str | Path) -> None:
    """Remove a file if it can be (gone already, or not ours to remove: left as it is)."""
    try:
        os.unlink(path)
    except OSError:
        pass


class FolderFiles:
    """The files of a disk tier folder as one open tier sees them: the folder (made if
    missing), this boot's id and the tier's owner mark, taken at open.

    Args:
        config: the tier's configuration (its root, modes, fsync and orphan age are used).

    Raises:
        TierUnavailableError: the folder cannot be made, or is not a folder.
    """

    def __init__(self, config: DiskTierConfig) -> None:
        self.root = Path(config.root).resolve()
        self._dir_mode = config.dir_mode
        self._fsync = config.fsync
        self._orphan_temp_age_s = config.orphan_temp_age_s
        self.make_root()
        self.boot_id = read_boot_id()
        owner_id = new_owner_id(self.boot_id)
        self.mark = OwnerMark(self.root, owner_id, config.file_mode, config.dir_mode)

    @property
    def owner_id(self) -> str:
        return self.mark.owner_id

    def make_root(self) -> None:
        """Create the folder if it is missing (at open, or after it was deleted)."""
        try:
            ensure_dir(self.root, self._dir_mode, self._fsync)
        except OSError as e:
            raise TierUnavailableError(
                f"cannot create the disk tier folder {self.root}: {e}"
            ) from e
        if not self.root.is_dir():
            raise TierUnavailableError(f"the disk tier folder {self.root} is not a folder")

    def ensure_dir(self, folder: str) -> None:
        """Create a folder under the root (a record's shard) with the tier's mode."""
        ensure_dir(Path(folder), self._dir_mode, self._fsync)

    def scan(self) -> FolderScan:
        """``scan_folder`` of the root."""
        return scan_folder(self.root)

    def namespace_records(self, namespace: str) -> list[str]:
        """``namespace_records`` of the root."""
        return namespace_records(self.root, namespace)

    def owner_alive(self, owner_id: str) -> bool:
        """``owner_alive`` in this folder and boot."""
        return owner_alive(self.root, owner_id, self.boot_id)

    def remove_orphans(self, temps: list[tuple[str, str, int]]) -> None:
        """Remove the temp files of a scan (``FolderScan.temps``) that are orphans."""
        for path, name, mtime_ns in temps:
            if is_orphan_temp(self.root, name, mtime_ns, self.boot_id, self._orphan_temp_age_s):
                unlink_quietly(path)

    def reap_dead_marks(self) -> None:
        """``reap_dead_marks`` of the root."""
        reap_dead_marks(self.root)

    def close(self) -> None:
        """Remove this tier's owner mark."""
        self.mark.close()
