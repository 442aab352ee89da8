"""One process's view of a disk tier folder that other processes may share: the folder's files,
the ledger of its byte budget and this process's index of the records, opened together and kept
in step with each other.

Opening reads one way: the view opens the folder's files (``files.FolderFiles``: the root, the
boot id, this process's owner mark), then the ledger (``budget``), then the index (``index``),
each with what it needs, once. ``index_folder`` then fills the index from a scan of the files.

The index is rebuilt from the folder whenever the ledger is healed (``budget`` says when), and
refreshed by a rescan when the folder (``folder``) is about to evict a record stamped after the
last moment this process knew every file of the folder.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

from cachetier.pins.pinset import PinSet
from cachetier.tiers.disk.budget import Ledger, LedgerState
from cachetier.tiers.disk.config import DiskTierConfig
from cachetier.tiers.disk.files import SUFFIX, FolderFiles
from cachetier.tiers.disk.index import LocalIndex, Slot
from cachetier.tiers.stats import TierStats

# A process killed while it evicts leaves the ledger counting the files it removed: whoever
# takes the lock next after this long rebuilds the count from the folder (~0.3 s for 100k
# records, under the lock).
HEAL_INTERVAL_S = 600.0


class FolderView:
    """The folder's files, its ledger and this process's index of it.

    Args:
        config: the tier's configuration.
        stats: the tier's counters (evictions and errors met here are added to them).
    """

    def __init__(self, config: DiskTierConfig, stats: TierStats) -> None:
        self._config = config
        self._stats = stats
        self.files = FolderFiles(config)
        self.root = self.files.root
        self._root_str = str(self.root)
        self._ledger = Ledger(self.root, self.files.boot_id, config.file_mode, self.files.make_root)
        self.lock = threading.Lock()  # guards the index and the fields below
        max_pinned = int(config.capacity_bytes * config.max_pinned_fraction)
        self.index = LocalIndex(config.policy, PinSet(max_pinned, "disk"))
        # Completeness of the index: while the ledger still shows (ledger id, adds) as last
        # seen, every record of the folder is in the index; otherwise every record stamped up
        # to ``_synced_clock`` is (or is gone).
        self._seen: tuple[str, int] | None = None
        self._synced_clock = 0
        # Bytes this process reserved in the ledger: its batches not yet committed and its
        # spare files. A heal keeps them.
        self._reserved = 0
        self.heals = 0

    @property
    def owner_id(self) -> str:
        return self.files.owner_id

    def path(self, slot: Slot) -> str:
        """Where ``slot``'s record lives, for every caller (the tier's reads and puts too)."""
        # A string, not a Path: pathlib's joins cost a noticeable share of a small get, and
        # every get, put, delete and eviction builds one.
        name = slot[1].hex()
        return f"{self._root_str}/{slot[0]}/{name[:2]}/{name}{SUFFIX}"

    def close(self) -> None:
        self.files.close()
        self._ledger.close()

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

    def index_folder(self) -> None:
        """At open: heal the ledger if needed, index the records, remove orphans."""
        with self.locked(check_owners=True) as state:
            healed = self.heals > 0
            snapshot = (state.ledger_id, state.adds, state.clock)
        if not healed:
            # The usual open: the ledger is sound, so the folder is scanned without holding
            # up other processes' puts; records renamed in meanwhile are found by a rescan.
            scan = self.files.scan()
            self.files.remove_orphans(scan.temps)
            with self.lock:
                self.index.rebuild(scan.records, keep_after=None)
                self._seen, self._synced_clock = snapshot[:2], snapshot[2]
        self.files.reap_dead_marks()

    def _dead_reservations(self, state: LedgerState) -> bool:
        return any(
            owner != self.owner_id and not self.files.owner_alive(owner) for owner in state.reserved
        )

    def _heal_locked(self, state: LedgerState) -> None:
        """Rebuild the ledger (and the index) from the folder; the caller holds the lock, so
        no record is renamed in or evicted meanwhile and the count is exact."""
        scan = self.files.scan()
        self.files.mark.ensure()  # the folder may have been deleted, the mark with it
        live: dict[str, int] = {}
        if state.heal_reason is None:  # unreadable: live writers' reservations are lost
            live = {
                owner: n
                for owner, n in state.reserved.items()
                if owner != self.owner_id and self.files.owner_alive(owner)
            }
        if self._reserved:
            live[self.owner_id] = self._reserved
        state.reserved = live
        state.committed_bytes = scan.record_bytes
        state.boot_id = self.files.boot_id
        state.clock = max([state.clock] + [stamp for stamp, _, _, _ in scan.records[-1:]])
        state.heal_reason = None
        state.healed_at = time.time_ns()
        self.files.remove_orphans(scan.temps)
        with self.lock:
            self.index.rebuild(scan.records, keep_after=None)
            self._seen, self._synced_clock = (state.ledger_id, state.adds), state.clock
        self.heals += 1

    def _rescan(self) -> None:
        """Learn the records other processes wrote since the index last saw the folder."""
        with self.locked() as state:
            ledger_id, adds, clock = state.ledger_id, state.adds, state.clock
        scan = self.files.scan()
        with self.lock:
            self.index.rebuild(scan.records, keep_after=clock)
            self._seen, self._synced_clock = (ledger_id, adds), clock
