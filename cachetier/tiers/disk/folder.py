"""One process's handle on a disk tier folder that other processes may share: room made in the
shared byte budget by eviction across processes, batches committed, records removed. What the
process knows of the folder (its files, ledger and index, opened and kept in step) is ``view``.

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
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from cachetier.errors import TierUnavailableError
from cachetier.tiers.disk.budget import LedgerState
from cachetier.tiers.disk.config import DiskTierConfig
from cachetier.tiers.disk.files import unlink_quietly
from cachetier.tiers.disk.index import Slot
from cachetier.tiers.disk.spares import Spare, SparePool
from cachetier.tiers.disk.view import FolderView
from cachetier.tiers.stats import TierStats

_ADMIT_POLL_S = 0.002

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


class SharedFolder(FolderView):
    """The folder's budget spent by this process: room made and reserved for its batches by
    evicting across processes, the batches renamed in, records removed, spare files kept.

    Args:
        config: the tier's configuration.
        stats: the tier's counters (evictions and errors met here are added to them).
    """

    def __init__(self, config: DiskTierConfig, stats: TierStats) -> None:
        super().__init__(config, stats)
        self.spares = SparePool(self.owner_id, config.spare_limit, config.spare_idle_limit_s)
        # Told the (namespace, key) slots this process evicts (``DiskTier.listen_evictions``).
        self.on_evicted: Callable[[list[tuple[Slot, int]]], None] | None = None

    def close(self) -> None:
        if len(self.spares):
            try:
                with self.locked() as state:
                    self._drop_spares(state, everything=True)
            except TierUnavailableError:
                for spare in self.spares.expired(everything=True):  # orphans for the next open
                    unlink_quietly(spare.path)
        super().close()

    def _drop_spares(self, state: LedgerState, *, everything: bool = False) -> None:
        """Unlink the spares unused for too long (or all) and give their bytes back."""
        gone = self.spares.expired(everything=everything)
        for spare in gone:
            unlink_quietly(spare.path)
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

    def recover(self) -> None:
        """Open the folder: heal the ledger if needed, index the records, remove orphans, and
        evict what a folder opened with a smaller capacity holds beyond this one."""
        self.index_folder()
        self.settle()

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
        gone: list[tuple[Slot, int]] = []  # with their mtimes, for the eviction listener
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
                    gone.append((slot, st.st_mtime_ns))
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
                gone.append((slot, st.st_mtime_ns))
            return "ok"
        finally:
            if evicted:
                self._stats.add(evictions=evicted)
            if gone and self.on_evicted is not None:
                self.on_evicted(gone)

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
                with self.lock:
                    stale = self._seen is None  # records were added since our last look
            if outcome == "scan":
                self._rescan()
                rescanned = True
                continue
            if time.monotonic() > deadline:
                return None
            if not others_writing:
                if not stale:
                    return None
                # Stuck on an old look: the batches we waited for landed after our last scan
                # and are evictable now. Giving up here lost a put whenever its writer was the
                # last one waiting.
                rescanned = False
                continue
            # Other batches in flight hold all the room; they land (and become evictable)
            # within moments. Each look after the wait starts afresh, for the same reason.
            time.sleep(_ADMIT_POLL_S)
            rescanned = False

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
                    unlink_quietly(tmp)
        if outcome == "scan":
            self.settle()
        return done

    def _rename_in(self, tmp: str, path: str) -> None:
        """Rename a written file to its record's name, under the lock. A spare is written over
        where it lies, in whichever shard, so the record's own shard may not exist yet: it is
        made then, and the rename tried again. Cheaper than making sure of the shard before
        each write: a stat per record costs more, after an idle moment, than the rare
        failed rename and mkdir."""
        try:
            os.replace(tmp, path)
        except FileNotFoundError:
            folder = os.path.dirname(path)
            if os.path.isdir(folder):
                raise  # the written file itself is gone (taken for a stuck write)
            self.files.ensure_dir(folder)
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
            for path in self.files.namespace_records(namespace):
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
