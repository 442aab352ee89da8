"""One process's handle on a disk tier folder that other processes may share: the shared byte
budget, eviction across processes, recovery at open, and this process's index of the records.

Eviction is global. The victim is the least recently used record of the folder, whoever wrote
it, by the files' mtimes: every rename in and every use stamps one. Before removing a victim
its mtime is checked (newer than we knew: another process used it, so it goes back in its
place), and before evicting a record stamped after the last moment this process knew every
file of the folder, the folder is rescanned (without holding the lock), so an older record
written by another process goes first. One rescan serves until the records it found are gone,
about one capacity's worth of evictions.

A record this process evicts to make room for a batch, or deletes, may become a spare file
(``spares``) that its next batch writes over; its bytes stay counted, as this process's
reservation, until then.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from cachetier.errors import TierUnavailableError
from cachetier.pins.pinset import PinSet
from cachetier.tiers.disk.budget import Ledger, LedgerState
from cachetier.tiers.disk.config import DiskTierConfig
from cachetier.tiers.disk.files import (
    SUFFIX,
    OwnerMark,
    ensure_dir,
    is_orphan_temp,
    namespace_records,
    new_owner_id,
    owner_alive,
    read_boot_id,
    reap_dead_marks,
    scan_folder,
)
from cachetier.tiers.disk.index import LocalIndex, Slot
from cachetier.tiers.disk.spares import Spare, SparePool
from cachetier.tiers.stats import TierStats

_ADMIT_POLL_S = 0.002
# A process killed while it evicts leaves the ledger counting the files it removed: whoever
# takes the lock next after this long rebuilds the count from the folder (~0.3 s for 100k
# records, under the lock).
HEAL_INTERVAL_S = 600.0

Landing = tuple[Slot, str, str, int]
"""(slot, final path, temp path, size) of a record written and waiting to be renamed in."""


@dataclass(frozen=True, slots=True)
class Admission:
    """Room reserved for a batch.

    Args:
        reserved: the bytes reserved for it (pass them to ``commit``, which releases them).
        spares: spare files to write the batch's records over, at most one per record; their
            bytes are part of ``reserved``.
    """

    reserved: int
    spares: list[Spare]


class SharedFolder:
    """The folder, its ledger and this process's index of it.

    Args:
        config: the tier's configuration.
        stats: the tier's counters (evictions and errors met here are added to them).
    """

    def __init__(self, config: DiskTierConfig, stats: TierStats) -> None:
        self._config = config
        self._stats = stats
        self.root = Path(config.root).resolve()
        self._root_str = str(self.root)
        self._make_root()
        self._boot_id = read_boot_id()
        owner_id = new_owner_id(self._boot_id)
        self._mark = OwnerMark(self.root, owner_id, config.file_mode, config.dir_mode)
        self._ledger = Ledger(self.root, self._boot_id, config.file_mode, self._make_root)
        self.lock = threading.Lock()  # guards the index and the fields below
        max_pinned = int(config.capacity_bytes * config.max_pinned_fraction)
        self.index = LocalIndex(config.policy, PinSet(max_pinned, "disk"))
        # Completeness of the index: while the ledger still shows (ledger id, adds) as last
        # seen, every record of the folder is in the index; otherwise every record stamped up
        # to ``_synced_clock`` is (or is gone).
        self._seen: tuple[str, int] | None = None
        self._synced_clock = 0
        # Bytes this process reserved in the ledger: its batches not yet committed and its
        # spare files.
        self._reserved = 0
        self.spares = SparePool(owner_id, config.spare_limit, config.spare_idle_limit_s)
        self.heals = 0

    @property
    def owner_id(self) -> str:
        return self._mark.owner_id

    def path(self, slot: Slot) -> str:
        """Where ``slot``'s record lives, for every caller (the tier's reads and puts too)."""
        # A string, not a Path: pathlib's joins cost ~25 us a record, a sixth of a one-chunk
        # get of a 512 KiB block, and every get, put, delete and eviction builds one.
        name = slot[1].hex()
        return f"{self._root_str}/{slot[0]}/{name[:2]}/{name}{SUFFIX}"

    def _make_root(self) -> None:
        try:
            ensure_dir(self.root, self._config.dir_mode, self._config.fsync)
        except OSError as e:
            raise TierUnavailableError(
                f"cannot create the disk tier folder {self.root}: {e}"
            ) from e
        if not self.root.is_dir():
            raise TierUnavailableError(f"the disk tier folder {self.root} is not a folder")

    def close(self) -> None:
        if len(self.spares):
            try:
                with self.locked() as state:
                    self._drop_spares(state, everything=True)
            except TierUnavailableError:
                for spare in self.spares.expired(everything=True):  # orphans for the next open
                    _unlink_quietly(spare.path)
        self._mark.close()
        self._ledger.close()

    def _drop_spares(self, state: LedgerState, *, everything: bool = False) -> None:
        """Unlink the spares unused for too long (or all) and give their bytes back."""
        gone = self.spares.expired(everything=everything)
        for spare in gone:
            _unlink_quietly(spare.path)
        freed = sum(spare.size for spare in gone)
        if freed:
            state.release(self.owner_id, freed)
            with self.lock:
                self._reserved -= freed

    def _keep_spare(self, path: str, st: os.stat_result, state: LedgerState) -> bool:
        """Keep a record file being removed as a spare: its bytes move from the records to
        this process's reservation. ``False``: not kept, the caller unlinks it."""
        if not self.spares.keep(path, st):
            return False
        state.committed_bytes -= min(st.st_size, state.committed_bytes)
        state.reserve(self.owner_id, st.st_size)
        with self.lock:
            self._reserved += st.st_size
        return True

    @contextmanager
    def locked(self, *, check_owners: bool = False) -> Iterator[LedgerState]:
        """The ledger under its lock, healed first if it cannot be trusted (or, with
        ``check_owners``, if it holds a reservation of a process that is gone)."""
        with self._ledger.locked() as state:
            if (
                state.heal_reason is not None
                or time.time_ns() - state.healed_at > HEAL_INTERVAL_S * 1e9
                or (check_owners and self._dead_reservations(state))
            ):
                self._heal_locked(state)
            with self.lock:
                if self._seen == (state.ledger_id, state.adds):
                    self._synced_clock = state.clock
                else:
                    self._seen = None
            yield state

    def recover(self) -> None:
        """Open the folder: heal the ledger if needed, index the records, remove orphans."""
        with self.locked(check_owners=True) as state:
            healed = self.heals > 0
            snapshot = (state.ledger_id, state.adds, state.clock)
        if not healed:
            # The usual open: the ledger is sound, so the folder is scanned without holding
            # up other processes' puts; records renamed in meanwhile are found by a rescan.
            scan = scan_folder(self.root)
            self._remove_orphans(scan.temps)
            with self.lock:
                self.index.rebuild(scan.records, keep_after=None)
                self._seen, self._synced_clock = snapshot[:2], snapshot[2]
        reap_dead_marks(self.root)
        self.settle()  # a folder over this capacity (opened with a smaller one) shrinks now

    def _dead_reservations(self, state: LedgerState) -> bool:
        return any(
            owner != self.owner_id and not owner_alive(self.root, owner, self._boot_id)
            for owner in state.reserved
        )

    def _heal_locked(self, state: LedgerState) -> None:
        """Rebuild the ledger (and the index) from the folder; the caller holds the lock, so
        no record is renamed in or evicted meanwhile and the count is exact."""
        scan = scan_folder(self.root)
        self._mark.ensure()  # the folder may have been deleted, the mark with it
        live: dict[str, int] = {}
        if state.heal_reason is None:  # unreadable: live writers' reservations are lost
            live = {
                owner: n
                for owner, n in state.reserved.items()
                if owner != self.owner_id and owner_alive(self.root, owner, self._boot_id)
            }
        if self._reserved:
            live[self.owner_id] = self._reserved
        state.reserved = live
        state.committed_bytes = scan.record_bytes
        state.boot_id = self._boot_id
        state.clock = max([state.clock] + [stamp for stamp, _, _, _ in scan.records[-1:]])
        state.heal_reason = None
        state.healed_at = time.time_ns()
        self._remove_orphans(scan.temps)
        with self.lock:
            self.index.rebuild(scan.records, keep_after=None)
            self._seen, self._synced_clock = (state.ledger_id, state.adds), state.clock
        self.heals += 1

    def _remove_orphans(self, temps: list[tuple[str, str, int]]) -> None:
        max_age_s = self._config.orphan_temp_age_s
        for path, name, mtime_ns in temps:
            if is_orphan_temp(self.root, name, mtime_ns, self._boot_id, max_age_s):
                _unlink_quietly(path)

    def _rescan(self) -> None:
        """Learn the records other processes wrote since the index last saw the folder."""
        with self.locked() as state:
            ledger_id, adds, clock = state.ledger_id, state.adds, state.clock
        scan = scan_folder(self.root)
        with self.lock:
            self.index.rebuild(scan.records, keep_after=clock)
            self._seen, self._synced_clock = (ledger_id, adds), clock

    def _evict_locked(
        self, state: LedgerState, *, rescanned: bool, room: int = 0, records: int = 0
    ) -> str:
        """Evict until the folder's records and in-flight batches fit the capacity with
        ``room`` bytes to spare.

        With ``records`` (room for a batch of that many records about to be written), the
        spares it will write over count as room made, and victims become spares while the
        spares do not cover ``room``.

        Returns:
            ``"ok"``; ``"scan"`` if the folder must be rescanned first (files the index has
            not seen may be older than its victim); ``"stuck"`` if no known record is left.
        """
        evicted = 0
        spared: set[Slot] = set()
        try:
            spares = self.spares
            while True:
                covered = spares.cover(records, room)  # room the batch's spares already make
                if state.used_bytes + max(0, room - covered) <= self._config.capacity_bytes:
                    break
                with self.lock:
                    popped = self.index.pop_victim()
                    complete, synced = self._seen is not None, self._synced_clock
                if popped is None:
                    return "stuck" if complete or rescanned else "scan"
                slot, entry = popped
                path = self.path(slot)
                try:
                    st = os.lstat(path)
                except FileNotFoundError:
                    continue  # evicted or deleted by another process, which counted it
                except OSError:
                    self._stats.add(errors=1)
                    continue
                if st.st_mtime_ns > entry.stamp and slot not in spared:
                    # Used (or replaced) by another process since we last looked: put it in
                    # its place instead. ``spared``: a file touched all the time goes anyway.
                    spared.add(slot)
                    with self.lock:
                        self.index.add(slot, st.st_size, st.st_mtime_ns)
                    continue
                if not (complete or rescanned or entry.stamp <= synced):
                    with self.lock:  # the rescan puts it back in its place
                        self.index.add(slot, entry.size, entry.stamp)
                    return "scan"
                if covered < room and len(spares) < records and self._keep_spare(path, st, state):
                    evicted += 1
                    continue
                try:
                    os.unlink(path)
                except FileNotFoundError:
                    continue
                except OSError:
                    self._stats.add(errors=1)
                    continue
                state.committed_bytes -= min(st.st_size, state.committed_bytes)
                evicted += 1
            return "ok"
        finally:
            if evicted:
                self._stats.add(evictions=evicted)

    def admit(self, nbytes: int, count: int = 1) -> Admission | None:
        """Make room for a batch of ``count`` records, ``nbytes`` in all, and reserve it.

        The room is made before the batch is written, so the folder stays within its
        capacity. When that cannot be (the batch alone, or with other processes' in-flight
        batches, is larger than the capacity), it is enough that everything else fits: the
        folder then exceeds the capacity by this one batch at most, until the commits evict.

        Args:
            nbytes: the batch's record bytes.
            count: its number of records (at most one spare file is handed out for each).

        Returns:
            The reservation, with the spare files to write over; ``None`` if no room came
            (other processes' in-flight batches held it all for longer than the config's
            ``admit_wait_s``): then nothing is reserved.
        """
        rescanned = healed = False
        deadline = time.monotonic() + self._config.admit_wait_s
        while True:
            with self.locked() as state:
                self._drop_spares(state)
                outcome = self._evict_locked(state, rescanned=rescanned, room=nbytes, records=count)
                if outcome == "stuck" and not healed:
                    if state.committed_bytes or self._dead_reservations(state):
                        # We know no record left, yet the ledger counts some: records removed
                        # behind its back, written since our rescan, or a dead writer's
                        # reservation. Count the folder again (exact: we hold the lock).
                        self._heal_locked(state)
                        healed = rescanned = True
                        continue
                capacity = self._config.capacity_bytes
                # Stuck (no record left to evict): admitted if all the rest fits, the spares
                # this batch writes over counting as its own.
                if outcome == "ok" or (
                    outcome == "stuck"
                    and state.used_bytes - self.spares.cover(count, nbytes) <= capacity
                ):
                    spares = self.spares.take(count, nbytes)
                    covered = sum(spare.size for spare in spares)
                    extra = max(0, nbytes - covered)  # the spares' bytes are reserved already
                    state.reserve(self.owner_id, extra)
                    with self.lock:
                        self._reserved += extra
                    return Admission(extra + covered, spares)
                # Batches in flight (ours from other threads too), not our idle spares.
                others_writing = (
                    any(owner != self.owner_id for owner in state.reserved)
                    or self._reserved > self.spares.held_bytes
                )
            if outcome == "scan":
                self._rescan()
                rescanned = True
                continue
            if not others_writing or time.monotonic() > deadline:
                return None
            # Other batches in flight hold all the room; they land (and become evictable)
            # within moments.
            time.sleep(_ADMIT_POLL_S)

    def settle(self) -> None:
        """Evict until the folder fits again (after a commit, or at open)."""
        rescanned = False
        for _ in range(3):
            with self.locked() as state:
                outcome = self._evict_locked(state, rescanned=rescanned)
            if outcome != "scan":
                return
            self._rescan()
            rescanned = True

    def commit(self, landings: Sequence[Landing], reserved: int) -> list[bool]:
        """Rename written temp files into place and turn the reservation into committed bytes.

        Done under the lock: an eviction of the same key by another process then cannot slip
        between our look at the old file and the rename, so no byte is counted twice. Temp
        files that could not be renamed are removed.

        Args:
            landings: the records written.
            reserved: the bytes ``admit`` reserved for them (released here in any case).

        Returns:
            Per landing, whether it is now in place.
        """
        done = [False] * len(landings)
        outcome = "ok"
        try:
            with self.locked() as state:
                was_complete = self._seen is not None
                for i, (slot, path, tmp, size) in enumerate(landings):
                    stamp = state.next_stamp()
                    try:
                        os.utime(tmp, ns=(stamp, stamp))  # the LRU stamp every process reads
                        try:
                            old = os.lstat(path).st_size
                        except FileNotFoundError:
                            old = 0
                        self._rename_in(tmp, path)
                    except OSError:
                        continue
                    done[i] = True
                    state.committed_bytes = max(0, state.committed_bytes + size - old)
                    state.adds += 1
                    with self.lock:
                        self.index.add(slot, size, stamp)
                state.release(self.owner_id, reserved)
                self._drop_spares(state)
                with self.lock:
                    if was_complete:  # every add since our last look was ours
                        self._seen, self._synced_clock = (state.ledger_id, state.adds), state.clock
                outcome = self._evict_locked(state, rescanned=False)
        except TierUnavailableError:
            pass  # the ledger keeps our reservation: it counts too much until healed
        finally:
            with self.lock:
                self._reserved -= reserved
            for (_, _, tmp, _), ok in zip(landings, done, strict=True):
                if not ok:
                    _unlink_quietly(tmp)
        if outcome == "scan":
            self.settle()
        return done

    def _rename_in(self, tmp: str, path: str) -> None:
        """Rename a written file to its record's name, under the lock. A spare is written over
        where it lies, in whichever shard, so the record's own shard may not exist yet: it is
        made then, and the rename tried again. Cheaper than making sure of the shard before
        each write: a stat of it per record was 10 us here, after the idle moment before a
        sidecar's put (a mkdir that fails, 41 us)."""
        try:
            os.replace(tmp, path)
        except FileNotFoundError:
            folder = os.path.dirname(path)
            if os.path.isdir(folder):
                raise  # the written file itself is gone (taken for a stuck write)
            ensure_dir(Path(folder), self._config.dir_mode, self._config.fsync)
            os.replace(tmp, path)

    def remove(self, slots: Sequence[Slot]) -> int:
        """Delete records (from the folder, the ledger and the index).

        Returns:
            How many files were there and removed.
        """
        removed = 0
        with self.locked() as state:
            for slot in slots:
                with self.lock:
                    self.index.forget(slot)
                removed += self._unlink_counted(self.path(slot), state)
        return removed

    def remove_namespace(self, namespace: str) -> int:
        """Delete every record of ``namespace``; folders and in-flight temp files stay, for
        the processes that may be writing into them right now.

        Returns:
            How many record files were removed.
        """
        removed = 0
        with self.locked() as state:
            with self.lock:
                for slot in self.index.slots_of(namespace):
                    self.index.forget(slot)
            for path in namespace_records(self.root, namespace):
                removed += self._unlink_counted(path, state)
        return removed

    def drop_corrupt(self, slot: Slot, inode: int) -> None:
        """Remove a record found corrupt, unless its file was replaced since it was read."""
        with self.lock:
            self.index.forget(slot)
        path = self.path(slot)
        with self.locked() as state:
            try:
                if os.lstat(path).st_ino == inode:
                    # Never a spare: a file that went bad may sit on a bad sector.
                    self._unlink_counted(path, state, keep=False)
            except FileNotFoundError:
                pass

    def _unlink_counted(self, path: str, state: LedgerState, *, keep: bool = True) -> bool:
        """Remove a record file (kept as a spare if ``keep`` and there is room among them)."""
        try:
            st = os.lstat(path)
            if keep and self._keep_spare(path, st, state):
                return True
            os.unlink(path)
        except FileNotFoundError:
            return False
        except OSError:
            self._stats.add(errors=1)
            return False
        state.committed_bytes -= min(st.st_size, state.committed_bytes)
        return True


def _unlink_quietly(path: str | Path) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass
