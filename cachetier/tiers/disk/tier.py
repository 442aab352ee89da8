"""Local disk tier: one record file per block under a root folder, surviving restarts, and
shared by any number of processes of one node (engine pods mounting one host folder).

Files live at ``root/<namespace>/<first two hex digits>/<key hex>.ctkv``. Only validated
namespaces and hex keys ever become path parts, so nothing can escape the root.

A record is never written while it is in place. A write goes to a temp file that is fsynced
and renamed over the final name (the folder is fsynced after the rename), so a reader that
opens the name gets the old record, the new one, or nothing. An eviction or a delete renames
the file away: it is unlinked, or kept by its process as a spare (``spares``) that a later
put writes over before renaming it in under its new name. A reader that opened the record
before then may read bytes being written over; the record's checksum fails, the reader sees
that the file changed under it, and it is a miss. No reader is ever served a torn record.

Sharing the folder:
- one byte budget for every process, kept in a ledger under ``flock`` (``budget``);
- eviction is global: the victim is the least recently used record of the folder whoever
  wrote it, by the files' mtimes, which every put and read stamps (the process checks a
  victim's mtime before removing it, and rescans the folder before it evicts a record newer
  than the last one it knows all files up to);
- a temp file names its writer, and only orphans are removed (``files``).

At open the index is rebuilt from the folder (one ``scandir`` per shard, ordered by mtime), so
every block written by an earlier process is found again.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from cachetier.errors import TierUnavailableError
from cachetier.primitives.keys import HASH_BYTES, BlockHash
from cachetier.record import Buffer, Compression, KVBlock, encode_parts
from cachetier.tiers.base import EvictionListener, Tier, check_namespace
from cachetier.tiers.disk.config import DiskTierConfig
from cachetier.tiers.disk.files import SUFFIX, ensure_dir, fsync_dir, stamp_file, temp_name
from cachetier.tiers.disk.folder import Admission, Landing, SharedFolder
from cachetier.tiers.disk.index import Slot
from cachetier.tiers.disk.reads import CorruptFile, read_block
from cachetier.tiers.disk.spares import Spare
from cachetier.util import parallel
from cachetier.util.landing import Destination
from cachetier.util.mounts import MEMORY_FILESYSTEMS, mount_fstype
from cachetier.util.parallel import map_in_threads

__all__ = ["SUFFIX", "DiskTier", "DiskTierConfig"]

logger = logging.getLogger(__name__)


class DiskTier(Tier):
    """Blocks as checksummed record files; reads are verified before they are returned.

    ``used_bytes`` and ``len`` are this process's view of the folder (what it wrote, read or
    found); ``folder_bytes`` is what the shared budget counts for every process;
    ``filesystem`` is the type of the file system holding the folder (``None`` where the
    kernel's list of mounts cannot be read).
    """

    name = "disk"
    supports_pins = True

    def __init__(self, config: DiskTierConfig) -> None:
        super().__init__()
        self._config = config
        self._compression = Compression.LZ4 if config.compression == "lz4" else Compression.NONE
        start = time.perf_counter()
        self._folder = SharedFolder(config, self._stats)
        self._root = self._folder.root
        try:
            self._folder.recover()
        except BaseException:
            self._folder.close()  # e.g. a ledger of a newer format: leave no mark behind
            raise
        self.recovery_s = time.perf_counter() - start
        self.filesystem = mount_fstype(self._root)
        if self.filesystem in MEMORY_FILESYSTEMS:
            # Allowed (a test, a node with no disk to spare), but not what "persistent" means.
            logger.warning(
                "disk tier folder %s is on %s: its blocks take RAM and are lost at a reboot",
                self._root,
                self.filesystem,
            )

    def listen_evictions(self, listener: EvictionListener) -> None:
        super().listen_evictions(listener)

        def tell(slots: list[tuple[Slot, int]]) -> None:
            for (namespace, key), mtime_ns in slots:
                listener(namespace, BlockHash(key), mtime_ns / 1e9)

        self._folder.on_evicted = tell

    @property
    def root(self) -> Path:
        return self._root

    @property
    def owner_id(self) -> str:
        """The id this tier's temp files and ledger reservations carry."""
        return self._folder.owner_id

    @property
    def heals(self) -> int:
        """Times this tier rebuilt the shared ledger from the folder (at open, or after it
        found it damaged, missing or counting bytes nobody holds)."""
        return self._folder.heals

    @property
    def capacity_bytes(self) -> int:
        return self._config.capacity_bytes

    @property
    def spare_bytes(self) -> int:
        """Bytes of this process's spare files (evicted or deleted records kept to be written
        over by its next puts; the folder's budget counts them)."""
        return self._folder.spares.held_bytes

    @property
    def used_bytes(self) -> int:
        return self._folder.index.used_bytes

    def __len__(self) -> int:
        return len(self._folder.index)

    def folder_bytes(self) -> int:
        """Bytes the shared budget counts: every process's records plus batches in flight.

        Returns:
            The ledger's count (rebuilt from the folder first if it could not be trusted).
        """
        with self._folder.locked() as state:
            return state.used_bytes

    def path_of(self, namespace: str, key: BlockHash) -> Path:
        """Where the record of ``key`` lives (whether or not it exists)."""
        check_namespace(namespace)
        return Path(self._file_of(namespace, key))

    def _file_of(self, namespace: str, key: BlockHash) -> str:
        # path_of for a checked namespace, as the folder's string (see SharedFolder.path).
        if len(key) != HASH_BYTES:
            raise ValueError(f"a key is {HASH_BYTES} bytes, got {len(key)}")
        return self._folder.path((namespace, key))

    def put_many(self, namespace: str, blocks: Sequence[KVBlock]) -> int:
        check_namespace(namespace)
        start = time.perf_counter()
        stored = nbytes = rejected = errors = skipped = 0
        todo: list[tuple[Slot, str, list[Buffer], int]] = []
        for block in blocks:
            path = self._file_of(namespace, block.key)
            if self._refresh_if_present(namespace, block.key, path):
                skipped += 1  # the folder holds a record of this key: not encoded, not written
                continue
            parts = encode_parts(block, self._compression)
            size = sum(memoryview(p).nbytes for p in parts)
            if size > self._config.capacity_bytes:
                rejected += 1
                continue
            todo.append(((namespace, bytes(block.key)), path, parts, size))
        if todo:
            batch_bytes = sum(size for _, _, _, size in todo)
            try:
                admission = self._folder.admit(batch_bytes, len(todo))
            except TierUnavailableError:
                errors += len(todo)
            else:
                if admission is None:
                    rejected += len(todo)  # no room: other processes' batches held it all
                else:
                    landed = self._write_batch(todo, admission)
                    errors += len(todo) - len(landed)
                    stored += len(landed)
                    nbytes += sum(size for _, _, _, size in landed)
        self._stats.add(
            puts=stored,
            bytes_in=nbytes,
            rejected=rejected,
            errors=errors,
            skipped_present=skipped,
        )
        self._stats.observe(time.perf_counter() - start)
        return stored + skipped

    def _write_batch(
        self, todo: list[tuple[Slot, str, list[Buffer], int]], admission: Admission
    ) -> list[Landing]:
        """Write a reserved batch: the temp files (or the spares handed out, written over) on
        a few threads (writev and fsync release the GIL), then one locked commit renames them
        in. Returns the records now stored."""
        reserved = admission.reserved
        spares: list[Spare | None] = [*admission.spares]
        spares += [None] * (len(todo) - len(spares))
        results = map_in_threads(
            lambda i: self._write_temp(todo[i][1], todo[i][2], spares[i]), range(len(todo))
        )
        landings = [
            (slot, path, tmp, size)
            for (slot, path, _, size), tmp in zip(todo, results, strict=True)
            if isinstance(tmp, str)
        ]
        for result in results:
            if isinstance(result, BaseException) and not isinstance(result, OSError):
                self._folder.commit([], reserved)  # gives the reservation back
                for _, _, tmp, _ in landings:
                    _unlink_quietly(tmp)
                raise result
        done = self._folder.commit(landings, reserved)
        landed = [landing for landing, ok in zip(landings, done, strict=True) if ok]
        if self._config.fsync:
            # A rename is durable once its folder is: until then a power loss may undo it.
            failed: set[str] = set()
            for folder in {os.path.dirname(path) for _, path, _, _ in landed}:
                try:
                    fsync_dir(folder)
                except OSError:
                    failed.add(folder)
            landed = [landing for landing in landed if os.path.dirname(landing[1]) not in failed]
        return landed

    def _refresh_if_present(self, namespace: str, key: BlockHash, path: str) -> bool:
        """Mark a block as just used instead of writing it, if the folder holds a record of
        its key, whichever process wrote it; ``False`` otherwise.

        A record under a key is the same KV whoever computed it (the key chains the tokens
        under a namespace of model, layout and tenant); a recompute of it differs only in
        rounding, and rewriting it would cost a full write for nothing: engines put the
        blocks of a shared prompt again after every request, and pods sharing the folder put
        each other's. A record known to be corrupt was removed when a read found it, so the
        next put writes it again; one damaged since is found by its checksum on its next read,
        the same way. Another process may evict the file right after this refresh, as it may
        any block right after its put.
        """
        try:
            size = os.stat(path).st_size
        except OSError:
            return False
        stamp = time.time_ns()
        stamp_file(path, stamp)  # the mtime carries the LRU order across processes and restarts
        with self._folder.lock:
            self._folder.index.add((namespace, bytes(key)), size, stamp)
        return True

    def _write_temp(self, path: str, parts: list[Buffer], spare: Spare | None) -> str:
        # Over a spare file of ours if one was handed out (in whichever shard it lies: the
        # folder is one file system); else a new file next to its final name. Both are named
        # after this tier, so that no other process opening the folder takes them for
        # orphans. Paths are strings: pathlib's joins and parses were a tenth of a small
        # block's put.
        mode = self._config.file_mode
        folder = os.path.dirname(path)
        fd = -1
        if spare is not None:
            tmp = spare.path
            fd = self._open_spare(spare)
        if fd < 0:
            spare = None
            tmp = f"{folder}/{temp_name(self._folder.owner_id)}"
            flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
            try:
                fd = os.open(tmp, flags, mode)
            except FileNotFoundError:  # a new shard (or the whole folder was deleted)
                ensure_dir(Path(folder), self._config.dir_mode, self._config.fsync)
                fd = os.open(tmp, flags, mode)
        try:
            try:
                if spare is not None and spare.mode != mode:
                    os.fchmod(fd, mode)  # written by a process of ours with another file_mode
                elif spare is None and mode & 0o077:  # umasks take group and other bits away
                    os.fchmod(fd, mode)
                views = [memoryview(p).cast("B") for p in parts if memoryview(p).nbytes]
                total = sum(v.nbytes for v in views)
                written = os.writev(fd, views)
                while written < total:  # short write: finish it part by part
                    flat = b"".join(views)[written:]
                    written += os.write(fd, flat)
                if spare is not None and spare.size != total:
                    os.ftruncate(fd, total)  # nothing of the old record may stay past the end
                if self._config.fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)
        except BaseException:
            _unlink_quietly(tmp)
            raise
        return tmp

    def _open_spare(self, spare: Spare) -> int:
        """Open a spare to be written over where it lies (the commit renames it in under the
        lock: every rename of a record or spare file is done under it, so a look at the folder
        under the lock sees each file once, and it makes the record's shard if that is still
        missing); -1 if it cannot be (then it is removed, and a new file is written)."""
        try:
            return os.open(spare.path, os.O_WRONLY | os.O_CLOEXEC)
        except OSError:  # e.g. removed by someone who took it for a stuck write
            _unlink_quietly(spare.path)
            return -1

    def get_many(self, namespace: str, keys: Sequence[BlockHash]) -> list[KVBlock | None]:
        return self._read_many(namespace, keys, None)

    def get_into(
        self, namespace: str, keys: Sequence[BlockHash], dests: Sequence[Destination]
    ) -> list[KVBlock | None]:
        # Payloads are read from the file straight into the destinations: no second copy.
        if len(dests) != len(keys):
            raise ValueError(f"{len(dests)} destinations for {len(keys)} keys")
        return self._read_many(namespace, keys, dests)

    def _read_many(
        self,
        namespace: str,
        keys: Sequence[BlockHash],
        dests: Sequence[Destination] | None,
    ) -> list[KVBlock | None]:
        check_namespace(namespace)
        start = time.perf_counter()
        out: list[KVBlock | None] = []
        hits = nbytes = errors = corrupt = 0
        paths = [self._file_of(namespace, key) for key in keys]

        # A batch's cold files go to the I/O threads (``reads``); a one-block get, or one
        # from background work, reads where it is.
        wide = len(keys) > 1 and parallel.may_wait_on_io()
        cold: dict[int, Future[tuple[KVBlock, int, int]]] = {}

        def read(index: int) -> tuple[KVBlock, int, int] | None:
            path, key = paths[index], keys[index]
            into = None if dests is None else dests[index]
            if not wide:
                return read_block(path, key, into)
            try:
                return read_block(path, key, into, nowait=True)
            except BlockingIOError:
                cold[index] = parallel.submit_io(lambda: read_block(path, key, into))
                return None

        # Cached files are read (and checksummed) on one thread per core; cold ones on the I/O
        # threads, many reads in flight. The index is updated after, in order.
        results = map_in_threads(read, range(len(keys)))
        for index, future in cold.items():
            try:
                results[index] = future.result()
            except Exception as exc:  # as map_in_threads: per item, the caller decides
                results[index] = exc
        folder = self._folder
        for key, result in zip(keys, results, strict=True):
            slot = (namespace, bytes(key))
            if type(result) is tuple:  # a hit, the usual answer: looked at first
                block, size, stamp = result
                with folder.lock:  # a block another process wrote is adopted here
                    folder.index.add(slot, size, stamp)
                hits += 1
                nbytes += size
                out.append(block)
                continue
            if isinstance(result, FileNotFoundError):
                with folder.lock:
                    folder.index.forget(slot)
                out.append(None)
                continue
            if isinstance(result, CorruptFile):
                corrupt += 1
                self._log_corrupt(key, str(result))
                try:
                    folder.drop_corrupt(slot, result.inode)
                except TierUnavailableError:
                    errors += 1
                out.append(None)
                continue
            if isinstance(result, OSError):
                errors += 1
                out.append(None)
                continue
            assert isinstance(result, BaseException), "a read answers a hit or an exception"
            raise result  # not an I/O error: a bug, not a miss
        if errors or corrupt:
            self._stats.add(errors=errors, corrupt=corrupt)
        self._stats.record_get(time.perf_counter() - start, hits, len(keys) - hits, nbytes)
        return out

    def held_keys(self) -> list[tuple[str, BlockHash]]:
        """The records this process's view of the folder holds (those other processes wrote
        since its last scan are not among them)."""
        with self._folder.lock:
            return [(ns, BlockHash(key)) for ns, key in self._folder.index.slots()]

    def contains_prefix(self, namespace: str, keys: Sequence[BlockHash]) -> int:
        check_namespace(namespace)
        # The file, not the index, is the truth: another process sharing the folder may have
        # written or evicted a block since this index last saw it (a stat is cheap).
        count = 0
        for key in keys:
            # os.path on the string: a pathlib Path per key costs twice as much.
            if not os.path.isfile(self._file_of(namespace, key)):
                break
            count += 1
        return count

    def delete(self, namespace: str, keys: Sequence[BlockHash]) -> int:
        check_namespace(namespace)
        for key in keys:
            self._file_of(namespace, key)  # checks the key before anything is removed
        try:
            return self._folder.remove([(namespace, bytes(key)) for key in keys])
        except TierUnavailableError:
            self._stats.add(errors=1)
            return 0

    def clear(self, namespace: str) -> int:
        check_namespace(namespace)
        try:
            return self._folder.remove_namespace(namespace)
        except TierUnavailableError:
            self._stats.add(errors=1)
            return 0

    def pin(self, namespace: str, keys: Sequence[BlockHash]) -> int:
        check_namespace(namespace)
        for key in keys:
            self._file_of(namespace, key)  # checks the key
        slots = [(namespace, bytes(key)) for key in keys]
        with self._folder.lock:
            return self._folder.index.pin(slots)

    def unpin(self, namespace: str, keys: Sequence[BlockHash]) -> int:
        check_namespace(namespace)
        for key in keys:
            self._file_of(namespace, key)  # checks the key
        with self._folder.lock:
            return self._folder.index.unpin([(namespace, bytes(key)) for key in keys])

    def pin_stats(self) -> dict[str, Any]:
        with self._folder.lock:
            return self._folder.index.pins.snapshot()

    def close(self) -> None:
        """Release this tier's mark and ledger file; its records stay for the next process."""
        self._folder.close()


def _unlink_quietly(path: str | Path) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass
