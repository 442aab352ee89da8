"""Local disk tier: one record file per block under a root folder, surviving restarts.

Files live at ``root/<namespace>/<first two hex digits>/<key hex>.ctkv``. Only validated
namespaces and hex keys ever become path parts, so nothing can escape the root. Writes go to a
temp file that is fsynced and renamed over the final name, so a reader (or a process restarted
after a crash) sees either the whole old record, the whole new one, or none.

At open the index is rebuilt from the folder (one ``scandir`` per shard, ordered by mtime,
which hits refresh), so every block written by an earlier process is found again.
"""

from __future__ import annotations

import os
import shutil
import threading
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from cachetier.errors import CorruptBlockError
from cachetier.eviction import make_policy
from cachetier.keys import HASH_BYTES, BlockHash, parse_key
from cachetier.parallel import map_in_threads
from cachetier.record import (
    Buffer,
    Compression,
    KVBlock,
    encode_parts,
    read_record,
    record_checksum,
)
from cachetier.tiers.base import Tier, check_namespace

SUFFIX = ".ctkv"
_TMP_PREFIX = ".tmp-"


@dataclass(frozen=True, slots=True)
class DiskTierConfig:
    """Args:
    root: folder that holds the tier (created if missing).
    capacity_bytes: most record bytes kept on disk.
    policy: eviction policy name.
    compression: ``"none"`` or ``"lz4"`` for stored payloads.
    fsync: fsync each record before it is renamed into place (durable across power loss;
        a killed process loses nothing either way).
    """

    root: str
    capacity_bytes: int
    policy: str = "lru"
    compression: str = "none"
    fsync: bool = True

    def __post_init__(self) -> None:
        if not self.root:
            raise ValueError("root must name a folder")
        if self.capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes must be positive, got {self.capacity_bytes}")
        if self.compression not in ("none", "lz4"):
            raise ValueError(f"compression must be 'none' or 'lz4', got {self.compression!r}")


class DiskTier(Tier):
    """Blocks as checksummed record files; reads are verified before they are returned."""

    name = "disk"

    def __init__(self, config: DiskTierConfig) -> None:
        super().__init__()
        self._config = config
        self._root = Path(config.root).resolve()
        self._root.mkdir(parents=True, exist_ok=True)
        self._compression = Compression.LZ4 if config.compression == "lz4" else Compression.NONE
        self._sizes: dict[tuple[str, bytes], int] = {}
        # Checksums of the records this tier wrote (not those found at start): a put of the
        # same record again only refreshes it.
        self._checksums: dict[tuple[str, bytes], bytes] = {}
        self._policy = make_policy(config.policy)
        self._used = 0
        self._lock = threading.Lock()
        self.recovery_s = self._rebuild_index()

    @property
    def root(self) -> Path:
        return self._root

    @property
    def capacity_bytes(self) -> int:
        return self._config.capacity_bytes

    @property
    def used_bytes(self) -> int:
        return self._used

    def __len__(self) -> int:
        return len(self._sizes)

    def path_of(self, namespace: str, key: BlockHash) -> Path:
        """Where the record of ``key`` lives (whether or not it exists)."""
        check_namespace(namespace)
        if len(key) != HASH_BYTES:
            raise ValueError(f"a key is {HASH_BYTES} bytes, got {len(key)}")
        name = key.hex()
        return self._root / namespace / name[:2] / (name + SUFFIX)

    def _rebuild_index(self) -> float:
        start = time.perf_counter()
        found: list[tuple[int, str, bytes, int]] = []
        for ns_entry in os.scandir(self._root):
            if not ns_entry.is_dir(follow_symlinks=False):
                continue
            try:
                check_namespace(ns_entry.name)
            except ValueError:
                continue
            for shard in os.scandir(ns_entry.path):
                if not shard.is_dir(follow_symlinks=False):
                    continue
                for entry in os.scandir(shard.path):
                    name = entry.name
                    if name.startswith(_TMP_PREFIX):
                        # A write that died before its rename: never acknowledged, drop it.
                        _unlink_quietly(entry.path)
                        continue
                    if not name.endswith(SUFFIX) or len(name) != 2 * HASH_BYTES + len(SUFFIX):
                        continue
                    try:
                        # parse_key, not bytes.fromhex: a stray name with spaces in it would
                        # give a short key that later breaks eviction.
                        key = parse_key(name[: 2 * HASH_BYTES])
                        st = entry.stat(follow_symlinks=False)
                    except (ValueError, OSError):
                        continue
                    found.append((st.st_mtime_ns, ns_entry.name, key, st.st_size))
        found.sort()
        with self._lock:
            for _, ns, key, size in found:
                self._policy.insert((ns, key))
                self._sizes[(ns, key)] = size
                self._used += size
            self._evict_over_capacity()
        return time.perf_counter() - start

    def put_many(self, namespace: str, blocks: Sequence[KVBlock]) -> int:
        check_namespace(namespace)
        start = time.perf_counter()
        stored = nbytes = rejected = errors = 0
        todo: list[tuple[KVBlock, Path, list[Buffer], int]] = []
        for block in blocks:
            path = self.path_of(namespace, block.key)
            parts = encode_parts(block, self._compression)
            if self._refresh_if_same(namespace, block.key, path, record_checksum(parts)):
                stored += 1  # the file already holds exactly this record
                continue
            size = sum(memoryview(p).nbytes for p in parts)
            if size > self._config.capacity_bytes:
                rejected += 1
                continue
            todo.append((block, path, parts, size))
        # The writes on a few threads (writev and rename release the GIL); the index after,
        # in order. A batch may so overshoot the capacity until its blocks are indexed.
        results = map_in_threads(lambda item: self._write_atomically(item[1], item[2]), todo)
        for (block, _, parts, size), result in zip(todo, results, strict=True):
            if isinstance(result, OSError):
                errors += 1
                continue
            if isinstance(result, BaseException):
                raise result
            with self._lock:
                slot = (namespace, bytes(block.key))
                old = self._sizes.get(slot)
                if old is None:
                    self._policy.insert(slot)
                else:
                    self._used -= old
                    self._policy.touch(slot)
                self._sizes[slot] = size
                self._checksums[slot] = record_checksum(parts)
                self._used += size
                self._evict_over_capacity()
            stored += 1
            nbytes += size
        self._stats.add(puts=stored, bytes_in=nbytes, rejected=rejected, errors=errors)
        self._stats.observe(time.perf_counter() - start)
        return stored

    def _refresh_if_same(self, namespace: str, key: BlockHash, path: Path, checksum: bytes) -> bool:
        """Mark a block as just used instead of writing it, if this tier wrote exactly this
        record (same checksum) and its file is still there; ``False`` otherwise.

        Rewriting it would cost a full write (and freeing the old file's pages) for the same
        bytes: engines put the blocks of a shared prompt again after every request. Another
        record under the key is written as usual (a put replaces). A file damaged since is
        found by the checksum on its next read, removed, and written again by the next put.
        """
        slot = (namespace, bytes(key))
        with self._lock:
            if self._checksums.get(slot) != checksum:
                return False
        if not path.exists():  # removed behind our back: write it again
            return False
        with self._lock:
            if self._checksums.get(slot) != checksum:  # evicted or replaced meanwhile
                return False
            self._policy.touch(slot)
        _touch_quietly(path)  # mtime carries the LRU order across restarts
        return True

    def _write_atomically(self, path: Path, parts: list) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.parent / f"{_TMP_PREFIX}{uuid.uuid4().hex}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            try:
                views = [memoryview(p).cast("B") for p in parts if memoryview(p).nbytes]
                total = sum(v.nbytes for v in views)
                written = os.writev(fd, views)
                while written < total:  # short write: finish it part by part
                    flat = b"".join(views)[written:]
                    written += os.write(fd, flat)
                if self._config.fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, path)
        except BaseException:
            _unlink_quietly(tmp)
            raise

    def _evict_over_capacity(self) -> None:
        # Caller holds the lock. Unlinking here keeps a concurrent re-put of the victim safe.
        evictions = 0
        while self._used > self._config.capacity_bytes:
            victim = self._policy.pop_victim()
            if victim is None:
                break
            size = self._sizes.pop(victim)  # type: ignore[call-overload]
            self._checksums.pop(victim, None)  # type: ignore[call-overload]
            self._used -= size
            ns, key = victim  # type: ignore[misc]
            _unlink_quietly(self.path_of(ns, BlockHash(key)))
            evictions += 1
        if evictions:
            self._stats.add(evictions=evictions)

    def get_many(self, namespace: str, keys: Sequence[BlockHash]) -> list[KVBlock | None]:
        return self._read_many(namespace, keys, None)

    def get_into(
        self, namespace: str, keys: Sequence[BlockHash], dests: Sequence[memoryview]
    ) -> list[KVBlock | None]:
        # Payloads are read from the file straight into the destinations: no second copy.
        if len(dests) != len(keys):
            raise ValueError(f"{len(dests)} destinations for {len(keys)} keys")
        return self._read_many(namespace, keys, dests)

    def _read_many(
        self,
        namespace: str,
        keys: Sequence[BlockHash],
        dests: Sequence[memoryview] | None,
    ) -> list[KVBlock | None]:
        check_namespace(namespace)
        start = time.perf_counter()
        out: list[KVBlock | None] = []
        hits = nbytes = errors = corrupt = 0
        paths = [self.path_of(namespace, key) for key in keys]

        def read(index: int) -> tuple[KVBlock, int]:
            into = None if dests is None else dests[index]
            return _read_block(paths[index], keys[index], into)

        # Reads (and their checksums) on a few threads: cold files keep several requests in
        # flight, cached ones copy on every core. The index is updated after, in order.
        results = map_in_threads(read, range(len(keys)))
        for key, path, result in zip(keys, paths, results, strict=True):
            if isinstance(result, FileNotFoundError):
                self._forget(namespace, key)
                out.append(None)
                continue
            if isinstance(result, CorruptBlockError):
                corrupt += 1
                self._drop(namespace, key, path)
                out.append(None)
                continue
            if isinstance(result, OSError):
                errors += 1
                out.append(None)
                continue
            if isinstance(result, BaseException):
                raise result
            block, size = result
            with self._lock:
                slot = (namespace, bytes(key))
                if slot in self._sizes:
                    self._policy.touch(slot)
                else:  # written by another process sharing this folder: adopt it
                    self._policy.insert(slot)
                    self._sizes[slot] = size
                    self._used += size
                    self._evict_over_capacity()
            _touch_quietly(path)  # mtime carries the LRU order across restarts
            hits += 1
            nbytes += size
            out.append(block)
        self._stats.add(
            hits=hits, misses=len(keys) - hits, bytes_out=nbytes, errors=errors, corrupt=corrupt
        )
        self._stats.observe(time.perf_counter() - start)
        return out

    def contains_prefix(self, namespace: str, keys: Sequence[BlockHash]) -> int:
        check_namespace(namespace)
        # The file, not the index, is the truth: another process sharing the folder may have
        # written or evicted a block since this index last saw it (a stat is ~2 us).
        count = 0
        for key in keys:
            if not self.path_of(namespace, key).is_file():
                break
            count += 1
        return count

    def delete(self, namespace: str, keys: Sequence[BlockHash]) -> int:
        check_namespace(namespace)
        removed = 0
        for key in keys:
            path = self.path_of(namespace, key)
            with self._lock:
                self._forget_locked(namespace, key)
                try:
                    os.unlink(path)
                    removed += 1
                except FileNotFoundError:
                    pass
                except OSError:
                    self._stats.add(errors=1)
        return removed

    def clear(self, namespace: str) -> int:
        check_namespace(namespace)
        with self._lock:
            slots = [slot for slot in self._sizes if slot[0] == namespace]
            for slot in slots:
                self._forget_locked(namespace, BlockHash(slot[1]))
            shutil.rmtree(self._root / namespace, ignore_errors=True)
        return len(slots)

    def _drop(self, namespace: str, key: BlockHash, path: Path) -> None:
        with self._lock:
            self._forget_locked(namespace, key)
            _unlink_quietly(path)

    def _forget(self, namespace: str, key: BlockHash) -> None:
        with self._lock:
            self._forget_locked(namespace, key)

    def _forget_locked(self, namespace: str, key: BlockHash) -> None:
        self._checksums.pop((namespace, bytes(key)), None)
        size = self._sizes.pop((namespace, bytes(key)), None)
        if size is not None:
            self._used -= size
            self._policy.remove((namespace, bytes(key)))


def _read_block(path: Path, key: BlockHash, dest: memoryview | None) -> tuple[KVBlock, int]:
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        block = read_record(lambda buf: os.readv(fd, [buf]), size, key=key, payload_into=dest)
        return block, size
    finally:
        os.close(fd)


def _unlink_quietly(path: str | Path) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def _touch_quietly(path: Path) -> None:
    try:
        os.utime(path)
    except OSError:
        pass
