"""Spare files: record files this process evicted or deleted, kept for a while so that its next
puts write over them instead of creating new files.

Why: a new file costs the file system a block allocation and a fresh page-cache page for every
4 KiB written, and unlinking the victim frees all of them again. Writing over a file that is
already allocated (and still cached) skips both: on ext4 a put over a spare takes a fraction of
a put into a new file, the more so for small records. A full tier evicts about what each put
writes, so in its steady state every put finds spares; an engine's delete-then-put finds them
too. Databases do the same with their logs (RocksDB's ``recycle_log_file_num``).

What keeps this safe:
- A spare is one of this process's temp files (``files.temp_name``), so if the process
  dies its spares are orphans that the next open removes, and until then no other process
  reads, takes or removes them.
- A spare's bytes stay in the shared budget as this process's reservation, so the folder never
  holds more than its capacity; a batch counts the spares it will write over as room already
  made. Spares are capped (``DiskTierConfig.spare_bytes``) and dropped after
  ``spare_idle_s`` unused, so a process never sits on more than a little of the room.
- Only a file of this user is kept (written over, another user's file would keep its owner).
- A reader that opened the record before it became a spare may read bytes being written over:
  its checksum fails, and the reader sees that the file changed under it (``DiskTier`` reads it
  as a miss, and does not remove the file as corrupt). No torn record is ever served.
"""

from __future__ import annotations

import os
import stat
import threading
import time
from dataclasses import dataclass

from cachetier.tiers.disk.files import stamp_file, temp_name


@dataclass(frozen=True, slots=True)
class Spare:
    """A file of ours waiting to be written over.

    Args:
        path: where it is (a temp name of this process, in the shard it was evicted from).
        size: its size in bytes (what the budget counts for it).
        mode: its permission bits.
        since: when it became a spare (``time.monotonic``).
    """

    path: str
    size: int
    mode: int
    since: float


class SparePool:
    """This process's spares, oldest first.

    Args:
        owner_id: the tier's owner id (spares are named after it, like its temp files).
        max_bytes: most bytes held as spares (0: keep none).
        idle_s: a spare unused for longer is given back (unlinked).
    """

    def __init__(self, owner_id: str, max_bytes: int, idle_s: float) -> None:
        self._owner_id = owner_id
        self._max_bytes = max_bytes
        self._idle_s = idle_s
        self._spares: list[Spare] = []
        self._lock = threading.Lock()
        self.held_bytes = 0

    def __len__(self) -> int:
        return len(self._spares)

    def keep(self, path: str, st: os.stat_result) -> bool:
        """Turn the record file at ``path`` into a spare instead of unlinking it.

        The caller holds the folder's lock, so no other process renames or removes ``path``
        meanwhile, and it counts the bytes as reserved once this returns ``True``.

        Args:
            path: the record file.
            st: its ``lstat``.

        Returns:
            ``False`` if it is not kept (not a regular file of ours, empty, no room left among
            the spares, or the rename failed): the caller unlinks it as before.
        """
        size = st.st_size
        if not (0 < size <= self._max_bytes - self.held_bytes):
            return False
        if st.st_uid != os.geteuid() or not stat.S_ISREG(st.st_mode):
            return False
        spare = f"{os.path.dirname(path)}/{temp_name(self._owner_id)}"
        try:
            os.rename(path, spare)
        except OSError:
            return False
        # A new mtime: other processes remove temp files past an age, whoever writes them.
        stamp_file(spare, time.time_ns())
        with self._lock:
            self._spares.append(Spare(spare, size, stat.S_IMODE(st.st_mode), time.monotonic()))
            self.held_bytes += size
        return True

    def cover(self, count: int, nbytes: int) -> int:
        """The bytes ``take(count, nbytes)`` would hand out now."""
        with self._lock:
            return sum(spare.size for spare in self._pick(count, nbytes))

    def take(self, count: int, nbytes: int) -> list[Spare]:
        """Spares for a batch of ``count`` records of ``nbytes`` in all: the newest first (the
        most likely to be cached), until they cover ``nbytes`` or ``count`` are taken."""
        with self._lock:
            taken = self._pick(count, nbytes)
            del self._spares[len(self._spares) - len(taken) :]
            self.held_bytes -= sum(spare.size for spare in taken)
        return taken

    def _pick(self, count: int, nbytes: int) -> list[Spare]:
        picked: list[Spare] = []
        covered = 0
        for spare in reversed(self._spares):
            if len(picked) >= count or covered >= nbytes:
                break
            picked.append(spare)
            covered += spare.size
        return picked

    def expired(self, *, everything: bool = False) -> list[Spare]:
        """Remove from the pool (and return, for the caller to unlink and release) the spares
        unused for ``idle_s``, or all of them."""
        cutoff = time.monotonic() - self._idle_s
        with self._lock:
            if everything:
                gone, self._spares = self._spares, []
            else:
                keep_from = 0
                while keep_from < len(self._spares) and self._spares[keep_from].since < cutoff:
                    keep_from += 1
                gone, self._spares = self._spares[:keep_from], self._spares[keep_from:]
            self.held_bytes -= sum(spare.size for spare in gone)
        return gone
