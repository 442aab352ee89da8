"""The disk tier's configuration (``DiskTier`` takes it; ``cachetier.store.config`` builds it)."""

from __future__ import annotations

from dataclasses import dataclass

from cachetier.util.checks import fraction, positive_int

DEFAULT_FILE_MODE = 0o600
DEFAULT_DIR_MODE = 0o700
MAX_DEFAULT_SPARE_BYTES = 256 << 20


@dataclass(frozen=True, slots=True)
class DiskTierConfig:
    """Settings of a ``DiskTier``: its folder, capacity and how it writes.

    Args:
        root: folder that holds the tier (created if missing). Any number of processes of one
            node may open the same folder: they share its capacity.
        capacity_bytes: most record bytes kept in the folder, for all processes together (give
            them all the same value: the smallest is what the folder ends up holding). At any
            instant the folder may exceed it by the one batch being written.
        policy: eviction policy name.
        compression: ``"none"`` or ``"lz4"`` for stored payloads.
        fsync: fsync each record before it is renamed into place, and its folder after
            (durable across power loss; a killed process loses nothing either way).
        file_mode: permission bits of the files the tier creates. KV reveals the prompt, so only
            the owner reads them by default; ``0o640`` lets a group read them, ``0o660`` (with
            ``dir_mode`` ``0o770``) lets processes of several users in one group share the folder.
        dir_mode: permission bits of the folders the tier creates (an existing root is left as
            it is).
        orphan_temp_age_s: a temp file older than this is removed when a tier opens the folder,
            even if its writer still runs (a write that old is stuck); a dead writer's temp file
            is removed at once.
        max_pinned_fraction: share of ``capacity_bytes`` pinned records may hold, in [0, 1)
            (0: nothing can be pinned). Pins live in the process that made them: another
            process sharing the folder evicts by its own pins, so give every process the same
            pins (the sidecar owns its folder alone).
        admit_wait_s: longest a put waits for other processes' in-flight batches to land when
            they hold all the room; after it the put is refused (counted in ``rejected``). A
            slow disk or a loaded node may need more.
        spare_bytes: most bytes of evicted or deleted record files this process keeps, for a
            short while, to write its next puts over instead of creating new files (cheaper:
            ``spares``). They count against ``capacity_bytes``. ``None``: an eighth of the
            capacity, at most 256 MiB; 0 keeps none.
        spare_idle_s: a spare unused for this long is removed by the process's next put (and
            every spare at ``close``); at most half of ``orphan_temp_age_s`` is used, so that
            no other process takes a spare for a stuck write.
    """

    root: str
    capacity_bytes: int
    policy: str = "lru"
    compression: str = "none"
    fsync: bool = True
    file_mode: int = DEFAULT_FILE_MODE
    dir_mode: int = DEFAULT_DIR_MODE
    orphan_temp_age_s: float = 3600.0
    max_pinned_fraction: float = 0.5
    admit_wait_s: float = 5.0
    spare_bytes: int | None = None
    spare_idle_s: float = 30.0

    def __post_init__(self) -> None:
        if not self.root:
            raise ValueError("root must name a folder")
        positive_int("capacity_bytes", self.capacity_bytes)
        if self.compression not in ("none", "lz4"):
            raise ValueError(f"compression must be 'none' or 'lz4', got {self.compression!r}")
        check_mode("file_mode", self.file_mode, needs=0o600)
        check_mode("dir_mode", self.dir_mode, needs=0o700)
        if not self.orphan_temp_age_s > 0:
            raise ValueError(f"orphan_temp_age_s must be positive, got {self.orphan_temp_age_s}")
        fraction("max_pinned_fraction", self.max_pinned_fraction)
        if not self.admit_wait_s > 0:
            raise ValueError(f"admit_wait_s must be positive, got {self.admit_wait_s}")
        if self.spare_bytes is not None and (
            isinstance(self.spare_bytes, bool)
            or not isinstance(self.spare_bytes, int)
            or self.spare_bytes < 0
        ):
            raise ValueError(f"spare_bytes must be None or >= 0, got {self.spare_bytes!r}")
        if not self.spare_idle_s > 0:
            raise ValueError(f"spare_idle_s must be positive, got {self.spare_idle_s}")

    @property
    def spare_limit(self) -> int:
        """``spare_bytes`` resolved: the bytes of spare files a process may keep."""
        if self.spare_bytes is not None:
            return self.spare_bytes
        return min(self.capacity_bytes // 8, MAX_DEFAULT_SPARE_BYTES)

    @property
    def spare_idle_limit_s(self) -> float:
        """``spare_idle_s``, kept under half the age at which temp files count as stuck."""
        return min(self.spare_idle_s, self.orphan_temp_age_s / 2)


def check_mode(name: str, mode: object, *, needs: int) -> int:
    """Validate permission bits.

    Args:
        name: the setting's name, for the message.
        mode: the bits, e.g. ``0o640``.
        needs: bits the tier itself needs (its owner must read and write its own files).

    Returns:
        ``mode`` unchanged.
    """
    if isinstance(mode, bool) or not isinstance(mode, int) or not 0 <= mode <= 0o777:
        raise ValueError(f"{name} must be permission bits 0o000-0o777, got {mode!r}")
    if mode & needs != needs:
        raise ValueError(
            f"{name} {mode:#o} lacks {needs:#o}: the tier must be able to use what it creates"
        )
    return mode
