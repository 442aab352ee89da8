"""The byte budget of a disk tier folder, shared by every process that opens the folder.

Mechanism: a small ledger file, ``<root>/.ledger``, read and rewritten under an exclusive
``flock`` on it. It holds the bytes of the records in the folder (``committed_bytes``) and,
per open tier, the bytes of the batch it is writing now (``reserved``). A put takes the lock
twice per batch, not per block: once to make room and reserve its batch before writing it
(evict until the records, every reservation and this batch fit the capacity), once to rename
its temp files into place and turn the reservation into committed bytes. So the folder stays
within its capacity; where the room cannot be made (a batch larger than the capacity, or
in-flight batches of other processes that together hold more), the put goes ahead once
everything else fits, and the folder exceeds the capacity by that one batch at most.
Evictions and deletes update the ledger under the same lock.

Why a ledger and not a scan of the folder: summing 100k file sizes takes ~0.3 s, far too long
for every put, and per-process counters (what we had) let N processes hold N capacities.
Why ``flock`` and not a lock server: it works for every process of one node (pods in their own
PID namespaces included: they share the kernel), the kernel releases it when a holder dies,
and an uncontended lock plus a 200-byte read and write costs microseconds.

The ledger also carries ``adds`` (how many records were renamed into place, all processes
together) and ``clock``, the last mtime stamp given to a record. A process whose last look
saw ``adds`` unchanged knows every file in the folder; otherwise it knows every file stamped
up to the clock it last saw, and rescans before it evicts a newer one (``folder``).

Drift and its healing. A process that dies leaves the ledger counting too much, never too
little: its reservation stays (and covers any record it renamed in before its ledger update
was written), and so do the files it was evicting in that moment. The count is rebuilt from
the folder, by a scan under the lock, whenever a process finds the ledger missing, unreadable
(torn or bit-flipped: a checksum covers it), of an older format, written in another boot (the
ledger is not fsynced: a power loss may leave it stale, and the boot id tells), not rebuilt for
``HEAL_INTERVAL_S`` (``view``), or, at open, holding a reservation of a dead owner; and
by a put that finds no record left to evict while the ledger still counts some. A ledger of a
newer format is refused with a clear error instead of being overwritten.
"""

from __future__ import annotations

import fcntl
import json
import os
import secrets
import struct
import threading
import time
import weakref
import zlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

from cachetier.errors import TierUnavailableError

_T = TypeVar("_T")

LEDGER_NAME = ".ledger"
LEDGER_VERSION = 1
_MAGIC = b"CTLEDGER"
_HEAD = struct.Struct("<8sHI")  # magic, version, crc32 of the JSON body
_MAX_LEDGER_BYTES = 1 << 20  # a ledger holds one small entry per open tier
_PAD_BYTES = 256


@dataclass(slots=True)
class LedgerState:
    """The ledger's contents while its lock is held; changes are written back on release.

    Args:
        ledger_id: random id of this ledger; a new one (healed, recreated) gets a new id.
        boot_id: the boot in which the ledger was written.
        committed_bytes: bytes of the record files in the folder.
        adds: records renamed into place so far, all processes together.
        clock: the last mtime stamp (ns) given to a record.
        reserved: owner id -> bytes of the batch it is writing now.
        healed_at: when the count was last rebuilt from the folder (ns since the epoch).
        heal_reason: why the contents cannot be trusted (set when they were read), else
            ``None``; the holder must rebuild them from the folder.
    """

    ledger_id: str
    boot_id: str
    committed_bytes: int = 0
    adds: int = 0
    clock: int = 0
    reserved: dict[str, int] = field(default_factory=dict)
    healed_at: int = 0
    heal_reason: str | None = None

    @property
    def reserved_bytes(self) -> int:
        return sum(self.reserved.values())

    @property
    def used_bytes(self) -> int:
        """What the folder may hold now: its records plus the batches being written."""
        return self.committed_bytes + self.reserved_bytes

    def reserve(self, owner_id: str, nbytes: int) -> None:
        self.reserved[owner_id] = self.reserved.get(owner_id, 0) + nbytes

    def release(self, owner_id: str, nbytes: int) -> None:
        # A heal may have dropped the reservation meanwhile: never go below zero.
        left = self.reserved.get(owner_id, 0) - nbytes
        if left > 0:
            self.reserved[owner_id] = left
        else:
            self.reserved.pop(owner_id, None)

    def next_stamp(self) -> int:
        """A stamp later than every stamp given before, close to the wall clock (ns)."""
        self.clock = max(time.time_ns(), self.clock + 1)
        return self.clock


def fresh_state(boot_id: str, heal_reason: str | None) -> LedgerState:
    """An empty ledger with a new id."""
    return LedgerState(secrets.token_hex(8), boot_id, heal_reason=heal_reason)


def encode_state(state: LedgerState) -> bytes:
    """The ledger file's bytes for ``state`` (``heal_reason`` is not stored)."""
    body = json.dumps(
        {
            "ledger_id": state.ledger_id,
            "boot_id": state.boot_id,
            "committed_bytes": state.committed_bytes,
            "adds": state.adds,
            "clock": state.clock,
            "reserved": state.reserved,
            "healed_at": state.healed_at,
        },
        sort_keys=True,
        separators=(",", ":"),
    ).encode()
    # Padded with spaces (JSON ignores them) to a multiple of _PAD_BYTES: a rewrite then keeps
    # the file's length, and skips the truncate, which costs as much as the rest together.
    body += b" " * (-(_HEAD.size + len(body)) % _PAD_BYTES)
    return _HEAD.pack(_MAGIC, LEDGER_VERSION, zlib.crc32(body)) + body


def decode_state(data: bytes, boot_id: str) -> LedgerState:
    """Parse a ledger file; anything unusable gives a fresh state with its ``heal_reason``.

    Args:
        data: the file's bytes.
        boot_id: this boot's id (a ledger of another boot must be healed).

    Returns:
        The state.

    Raises:
        TierUnavailableError: the ledger is of a newer format than this cachetier knows.
    """
    if not data:
        return fresh_state(boot_id, "missing")
    if len(data) < _HEAD.size:
        return fresh_state(boot_id, "truncated")
    magic, version, crc = _HEAD.unpack_from(data)
    if magic != _MAGIC:
        return fresh_state(boot_id, "not a ledger")
    if version > LEDGER_VERSION:
        raise TierUnavailableError(
            f"the disk tier ledger is of format {version}, newer than this cachetier's "
            f"{LEDGER_VERSION}: every process sharing the folder must run the newer version"
        )
    if version < LEDGER_VERSION:
        return fresh_state(boot_id, f"format {version}")
    body = data[_HEAD.size :]
    if zlib.crc32(body) != crc:
        return fresh_state(boot_id, "checksum mismatch")
    try:
        raw = json.loads(body)
        state = LedgerState(
            ledger_id=_text(raw["ledger_id"]),
            boot_id=_text(raw["boot_id"]),
            committed_bytes=_count(raw["committed_bytes"]),
            adds=_count(raw["adds"]),
            clock=_count(raw["clock"]),
            reserved={_text(k): _count(v) for k, v in dict(raw["reserved"]).items()},
            healed_at=_count(raw["healed_at"]),
        )
    except (ValueError, TypeError, KeyError):
        return fresh_state(boot_id, "unreadable")
    if state.boot_id != boot_id:
        state.heal_reason = "written in another boot"
    return state


def _copy(s: LedgerState) -> LedgerState:
    return LedgerState(
        s.ledger_id, s.boot_id, s.committed_bytes, s.adds, s.clock, dict(s.reserved), s.healed_at
    )


def _count(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"not a count: {value!r}")
    return value


def _text(value: object) -> str:
    if not isinstance(value, str) or not value:
        raise ValueError(f"not a name: {value!r}")
    return value


class Ledger:
    """The ledger file of one folder, as one open tier uses it.

    Args:
        root: the folder.
        boot_id: this boot's id.
        file_mode: permission bits of the ledger if this process creates it.
        make_root: recreates the folder if it was deleted.
    """

    def __init__(
        self, root: Path, boot_id: str, file_mode: int, make_root: Callable[[], None]
    ) -> None:
        self.path = root / LEDGER_NAME
        self._boot_id = boot_id
        self._file_mode = file_mode
        self._make_root = make_root
        # flock excludes other open files, not other threads using ours.
        self._thread_lock = threading.Lock()
        self._fd = [-1]
        self._finalizer = weakref.finalize(self, _close_fd, self._fd)
        self._last: tuple[bytes, LedgerState] | None = None  # what we last wrote or kept

    @contextmanager
    def locked(self) -> Iterator[LedgerState]:
        """Hold the folder's lock; the state yielded is written back when the block ends.

        Yields:
            The ledger's state (check ``heal_reason``).

        Raises:
            TierUnavailableError: the ledger cannot be opened (permissions, not a folder) or
                is of a newer format.
        """
        with self._thread_lock:
            fd = self._lock_current()
            try:
                data = _io(os.pread, fd, _MAX_LEDGER_BYTES, 0)
                if self._last is not None and self._last[0] == data:
                    state = _copy(self._last[1])  # nobody wrote since we did: no parse
                else:
                    state = decode_state(data, self._boot_id)
                try:
                    yield state
                finally:
                    # Written even if the holder failed half-way: the files it evicted or
                    # renamed are gone or in place whatever happened next. Not if it left the
                    # state unhealed: an empty count must never replace a damaged one.
                    if state.heal_reason is None:
                        out = encode_state(state)
                        if out != data:
                            _io(os.pwrite, fd, out, 0)
                            if len(out) < len(data):
                                _io(os.ftruncate, fd, len(out))
                        self._last = (out, _copy(state))
            finally:
                fcntl.flock(fd, fcntl.LOCK_UN)

    def _lock_current(self) -> int:
        # The ledger may be deleted (the whole folder removed) while we hold it open: after
        # taking the lock, check that the path still names our file, else open the new one.
        for _ in range(100):
            if self._fd[0] < 0:
                self._fd[0] = self._open()
            fd = self._fd[0]
            fcntl.flock(fd, fcntl.LOCK_EX)
            try:
                if os.stat(self.path).st_ino == os.fstat(fd).st_ino:
                    return fd
            except FileNotFoundError:
                pass
            fcntl.flock(fd, fcntl.LOCK_UN)
            self.close()
        raise TierUnavailableError(f"{self.path} keeps being replaced")

    def _open(self) -> int:
        try:
            for _ in range(100):
                try:
                    fd = os.open(self.path, os.O_RDWR | os.O_CLOEXEC)
                    return fd
                except FileNotFoundError:
                    pass
                try:
                    flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
                    fd = os.open(self.path, flags, self._file_mode)
                except FileExistsError:
                    continue  # another process created it first: open theirs
                except FileNotFoundError:
                    self._make_root()
                    continue
                if self._file_mode & 0o077:  # the usual umasks only take these bits away
                    os.fchmod(fd, self._file_mode)
                return fd
            raise FileNotFoundError(f"{self.path} keeps vanishing")
        except OSError as e:
            raise TierUnavailableError(
                f"cannot open the disk tier ledger {self.path}: {e}. Every process sharing "
                "the folder must be able to read and write it (file_mode 0660 and dir_mode 0770 "
                "for processes of one group)"
            ) from e

    def close(self) -> None:
        """Close the ledger file (it is reopened by the next ``locked``)."""
        _close_fd(self._fd)
        self._fd[0] = -1


def _io(fn: Callable[..., _T], *args: object) -> _T:
    """``fn(*args)`` with an ``OSError`` (EIO, a full disk) as a ``TierUnavailableError``."""
    try:
        return fn(*args)
    except OSError as e:
        raise TierUnavailableError(f"the disk tier ledger failed: {e}") from e


def _close_fd(holder: list[int]) -> None:
    if holder[0] >= 0:
        try:
            os.close(holder[0])
        except OSError:
            pass
