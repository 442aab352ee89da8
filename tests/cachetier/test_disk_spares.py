"""Spare files of the disk tier: records it evicts or deletes are written over by its next puts
instead of new files (``cachetier.tiers.disk.spares``), within the folder's budget, and never
at the cost of a reader: one whose record is written over under it gets a miss."""

from __future__ import annotations

import os
import stat
import time
from dataclasses import replace
from pathlib import Path

import pytest

import cachetier.tiers.disk.reads as reads_module
from cachetier.primitives.keys import Namespace
from cachetier.record import encode_record
from cachetier.tiers.disk.files import TMP_PREFIX
from cachetier.tiers.disk.spares import SparePool
from cachetier.tiers.disk.tier import DiskTier, DiskTierConfig
from tests.children import run_python
from tests.support import SMALL_LAYOUT, make_blocks


def _tier(root: Path, capacity: int, **settings: object) -> DiskTier:
    return DiskTier(DiskTierConfig(str(root), capacity, fsync=False, **settings))  # type: ignore[arg-type]


def _temps(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob(f"{TMP_PREFIX}*") if p.is_file())


def _record_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in root.glob("*/*/*.ctkv"))


def test_a_put_after_a_delete_writes_over_the_deleted_file(
    tmp_path: Path, namespace: Namespace
) -> None:
    a, b = make_blocks(namespace, 2)
    size = len(encode_record(a))
    tier = _tier(tmp_path, 1 << 20)
    tier.put_many(namespace.id, [a])
    inode = tier.path_of(namespace.id, a.key).stat().st_ino
    assert tier.delete(namespace.id, [a.key]) == 1
    assert tier.get_many(namespace.id, [a.key]) == [None]
    assert tier.spare_bytes == size
    assert tier.folder_bytes() == size  # the budget still counts the spare's bytes
    assert [p.stat().st_ino for p in _temps(tmp_path)] == [inode]
    # b's shard folder does not exist yet: the spare lies in a's, and is renamed into b's.
    assert not tier.path_of(namespace.id, b.key).parent.exists()
    assert tier.put_many(namespace.id, [b]) == 1
    path = tier.path_of(namespace.id, b.key)
    assert path.stat().st_ino == inode  # written over, not a new file
    assert path.read_bytes() == encode_record(b)
    assert (tier.spare_bytes, tier.folder_bytes(), _temps(tmp_path)) == (0, size, [])
    [got] = tier.get_many(namespace.id, [b.key])
    assert got is not None and bytes(got.data) == b.data


def test_a_full_tier_writes_its_new_records_over_the_ones_it_evicts(
    tmp_path: Path, namespace: Namespace
) -> None:
    blocks = make_blocks(namespace, 6)
    size = len(encode_record(blocks[0]))
    tier = _tier(tmp_path, 2 * size, spare_bytes=size)  # the default cap: an eighth of 2
    tier.put_many(namespace.id, blocks[:2])
    inodes = {tier.path_of(namespace.id, b.key).stat().st_ino for b in blocks[:2]}
    for block in blocks[2:]:
        assert tier.put_many(namespace.id, [block]) == 1
        assert tier.folder_bytes() == _record_bytes(tmp_path) <= 2 * size
    found = [g is not None for g in tier.get_many(namespace.id, [b.key for b in blocks])]
    assert found == [False] * 4 + [True] * 2
    now = {tier.path_of(namespace.id, b.key).stat().st_ino for b in blocks[4:]}
    assert now == inodes  # every put wrote over the file it evicted
    assert tier.stats()["evictions"] == 4
    assert (tier.spare_bytes, _temps(tmp_path)) == (0, [])


def test_a_batch_evicting_for_itself_keeps_within_the_capacity(
    tmp_path: Path, namespace: Namespace
) -> None:
    blocks = make_blocks(namespace, 9)
    size = len(encode_record(blocks[0]))
    tier = _tier(tmp_path, 4 * size, spare_bytes=4 * size)
    tier.put_many(namespace.id, blocks[:4])
    inodes = {tier.path_of(namespace.id, b.key).stat().st_ino for b in blocks[:3]}
    tier.put_many(namespace.id, blocks[4:7])  # three victims written over, one record stays
    assert {tier.path_of(namespace.id, b.key).stat().st_ino for b in blocks[4:7]} == inodes
    assert tier.folder_bytes() == _record_bytes(tmp_path) == 4 * size
    tier.delete(namespace.id, [blocks[3].key, blocks[4].key])  # two spares before a batch
    assert tier.spare_bytes == 2 * size
    assert tier.put_many(namespace.id, blocks[7:]) == 2  # writes over both: evicts nothing
    assert tier.stats()["evictions"] == 3
    assert tier.folder_bytes() == _record_bytes(tmp_path) == 4 * size
    assert (tier.spare_bytes, _temps(tmp_path)) == (0, [])


def test_spares_are_capped(tmp_path: Path, namespace: Namespace) -> None:
    blocks = make_blocks(namespace, 3)
    size = len(encode_record(blocks[0]))
    tier = _tier(tmp_path, 1 << 20, spare_bytes=size + size // 2)
    tier.put_many(namespace.id, blocks)
    assert tier.delete(namespace.id, [b.key for b in blocks]) == 3
    assert (tier.spare_bytes, len(_temps(tmp_path))) == (size, 1)
    assert tier.folder_bytes() == size
    none = _tier(tmp_path / "none", 1 << 20, spare_bytes=0)
    none.put_many(namespace.id, blocks)
    none.delete(namespace.id, [b.key for b in blocks])
    assert (none.spare_bytes, none.folder_bytes(), _temps(tmp_path / "none")) == (0, 0, [])


def test_the_default_cap_is_an_eighth_of_the_capacity_at_most_256_mib() -> None:
    assert DiskTierConfig("x", 8 << 20).spare_limit == 1 << 20
    assert DiskTierConfig("x", 100 << 30).spare_limit == 256 << 20
    assert DiskTierConfig("x", 100 << 30, spare_bytes=5).spare_limit == 5
    assert DiskTierConfig("x", 1, spare_idle_s=60, orphan_temp_age_s=10).spare_idle_limit_s == 5
    for bad in (-1, 1.5, True, "1"):
        with pytest.raises(ValueError, match="spare_bytes"):
            DiskTierConfig("x", 1, spare_bytes=bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="spare_idle_s"):
        DiskTierConfig("x", 1, spare_idle_s=0)


def test_idle_spares_are_removed_and_their_room_given_back(
    tmp_path: Path, namespace: Namespace
) -> None:
    a, b = make_blocks(namespace, 2)
    size = len(encode_record(a))
    tier = _tier(tmp_path, 1 << 20, spare_idle_s=0.05)
    tier.put_many(namespace.id, [a])
    old_inode = tier.path_of(namespace.id, a.key).stat().st_ino
    tier.delete(namespace.id, [a.key])
    time.sleep(0.2)
    tier.put_many(namespace.id, [b])  # finds the spare idle for too long: removed first
    assert tier.path_of(namespace.id, b.key).stat().st_ino != old_inode
    assert (tier.spare_bytes, tier.folder_bytes(), _temps(tmp_path)) == (0, size, [])


def test_close_removes_the_spares(tmp_path: Path, namespace: Namespace) -> None:
    blocks = make_blocks(namespace, 2)
    tier = _tier(tmp_path, 1 << 20)
    tier.put_many(namespace.id, blocks)
    tier.delete(namespace.id, [b.key for b in blocks])
    assert len(_temps(tmp_path)) == 2
    tier.close()
    assert _temps(tmp_path) == []
    again = _tier(tmp_path, 1 << 20)
    assert (again.folder_bytes(), len(again)) == (0, 0)


_DIES_HOLDING_SPARES = """
import os, sys
from cachetier.primitives.keys import Namespace
from cachetier.tiers.disk.tier import DiskTier, DiskTierConfig
from tests.support import SMALL_LAYOUT, make_blocks
ns = Namespace("test-model", SMALL_LAYOUT)
blocks = make_blocks(ns, 2)
tier = DiskTier(DiskTierConfig(sys.argv[1], 1 << 20, fsync=False))
tier.put_many(ns.id, blocks)
tier.delete(ns.id, [b.key for b in blocks])
print(tier.spare_bytes, flush=True)
os._exit(0)  # killed: no close
"""


def test_the_spares_of_a_dead_process_are_removed_and_uncounted_at_the_next_open(
    tmp_path: Path,
) -> None:
    held = int(run_python(_DIES_HOLDING_SPARES, tmp_path))
    assert held > 0 and len(_temps(tmp_path)) == 2
    tier = _tier(tmp_path, 1 << 20)
    assert _temps(tmp_path) == []
    assert tier.folder_bytes() == 0  # the dead owner's reservation went with its spares


def test_a_smaller_record_leaves_nothing_of_the_larger_one_it_writes_over(
    tmp_path: Path, namespace: Namespace
) -> None:
    [big] = make_blocks(namespace, 1, seed=1)
    half = Namespace("test-model", replace(SMALL_LAYOUT, block_size=8))
    [small] = make_blocks(half, 1, seed=2)
    assert len(encode_record(small)) < len(encode_record(big))
    tier = _tier(tmp_path, 1 << 20)
    tier.put_many(namespace.id, [big])
    tier.delete(namespace.id, [big.key])
    tier.put_many(half.id, [small])
    path = tier.path_of(half.id, small.key)
    assert path.read_bytes() == encode_record(small)
    assert tier.folder_bytes() == path.stat().st_size


def test_a_spare_takes_the_file_mode_of_the_tier_writing_over_it(
    tmp_path: Path, namespace: Namespace
) -> None:
    a, b = make_blocks(namespace, 2)
    shared = _tier(tmp_path, 1 << 20, file_mode=0o640)
    shared.put_many(namespace.id, [a])
    private = _tier(tmp_path, 1 << 20)  # 0o600
    private.delete(namespace.id, [a.key])
    assert private.spare_bytes > 0
    private.put_many(namespace.id, [b])
    assert stat.S_IMODE(private.path_of(namespace.id, b.key).stat().st_mode) == 0o600


def test_only_a_regular_file_of_this_user_becomes_a_spare(tmp_path: Path) -> None:
    path = tmp_path / "record"
    path.write_bytes(b"x" * 100)
    pool = SparePool("owner", 1 << 20, 30.0)
    st = os.lstat(path)
    fields = list(st[:10])
    fields[4] = st.st_uid + 1  # as another user's file would be
    assert not pool.keep(str(path), os.stat_result(fields))
    fields[4], fields[0] = st.st_uid, stat.S_IFLNK | 0o777
    assert not pool.keep(str(path), os.stat_result(fields))
    assert path.exists() and len(pool) == 0
    assert pool.keep(str(path), st)
    assert not path.exists() and len(pool) == 1 and pool.held_bytes == 100


def test_a_reader_whose_record_is_written_over_under_it_gets_a_miss(
    tmp_path: Path, namespace: Namespace, monkeypatch: pytest.MonkeyPatch
) -> None:
    x, y = make_blocks(namespace, 2)
    reader = _tier(tmp_path, 1 << 20)
    writer = _tier(tmp_path, 1 << 20)  # another process's tier on the same folder
    writer.put_many(namespace.id, [x])
    real_read = reads_module.read_record

    def read_after_reuse(*args: object, **kwargs: object) -> object:
        # The reader has the file open: now its record is deleted and y written over it.
        writer.delete(namespace.id, [x.key])
        assert writer.spare_bytes > 0
        writer.put_many(namespace.id, [y])
        assert writer.spare_bytes == 0
        return real_read(*args, **kwargs)

    monkeypatch.setattr(reads_module, "read_record", read_after_reuse)
    assert reader.get_many(namespace.id, [x.key]) == [None]
    monkeypatch.setattr(reads_module, "read_record", real_read)
    assert reader.stats()["corrupt"] == 0  # a miss, not a damaged record
    [got] = reader.get_many(namespace.id, [y.key])  # y was not removed as corrupt
    assert got is not None and bytes(got.data) == y.data
