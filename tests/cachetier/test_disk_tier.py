"""What only the disk tier does: a put of a key it already holds refreshes the record instead
of writing it again (whatever record the put brings: the shared tier suite); one
folder shared by several tiers (one capacity, eviction by use across them, orphan temp files
only removed); private file modes; a damaged or lying ledger rebuilt from the folder."""

from __future__ import annotations

import json
import logging
import os
import shutil
import stat
import struct
import tempfile
import time
import zlib
from pathlib import Path

import pytest

from cachetier.errors import TierUnavailableError
from cachetier.primitives.keys import Namespace
from cachetier.record import encode_record
from cachetier.store.config import StoreConfig, build_tiers
from cachetier.tiers.disk.budget import LEDGER_NAME, decode_state, encode_state
from cachetier.tiers.disk.files import read_boot_id, temp_name
from cachetier.tiers.disk.tier import DiskTier, DiskTierConfig
from cachetier.util.mounts import MEMORY_FILESYSTEMS, mount_fstype
from tests.children import run_python
from tests.support import SMALL_LAYOUT, make_blocks


def _tier(root: Path, capacity: int) -> DiskTier:
    return DiskTier(DiskTierConfig(str(root), capacity, fsync=False))


def test_a_block_put_again_is_not_rewritten_but_counts_as_used(
    tmp_path: Path, namespace: Namespace
) -> None:
    a, b, c = make_blocks(namespace, 3)
    size = len(encode_record(a))
    tier = _tier(tmp_path, capacity=2 * size)
    assert tier.put_many(namespace.id, [a, b]) == 2
    path = tier.path_of(namespace.id, a.key)
    before = path.stat()
    assert tier.put_many(namespace.id, [a]) == 1  # held: refreshed, not written
    assert path.stat().st_ino == before.st_ino  # a write would have renamed a new file in
    assert tier.used_bytes == 2 * size
    tier.put_many(namespace.id, [c])  # over capacity: b is now the least recently used
    assert [g is not None for g in tier.get_many(namespace.id, [a.key, b.key, c.key])] == [
        True,
        False,
        True,
    ]


def test_a_block_whose_file_went_missing_or_bad_is_written_again(
    tmp_path: Path, namespace: Namespace
) -> None:
    [block] = make_blocks(namespace, 1)
    tier = _tier(tmp_path, capacity=1 << 20)
    tier.put_many(namespace.id, [block])
    path = tier.path_of(namespace.id, block.key)
    path.unlink()  # removed behind the tier's back
    assert tier.put_many(namespace.id, [block]) == 1
    assert path.read_bytes() == encode_record(block)
    damaged = bytearray(path.read_bytes())
    damaged[-1] ^= 1
    path.write_bytes(bytes(damaged))
    assert tier.get_many(namespace.id, [block.key]) == [None]  # found bad: removed
    assert tier.put_many(namespace.id, [block]) == 1
    [got] = tier.get_many(namespace.id, [block.key])
    assert got is not None and bytes(got.data) == block.data


# ---- one folder, several tiers (each its own owner, as separate processes are) ----------


def _record_files(root: Path) -> list[Path]:
    return sorted(root.glob("*/*/*.ctkv"))


def test_tiers_sharing_a_folder_share_one_capacity(tmp_path: Path, namespace: Namespace) -> None:
    blocks = make_blocks(namespace, 6)
    size = len(encode_record(blocks[0]))
    a, b = _tier(tmp_path, 4 * size), _tier(tmp_path, 4 * size)  # both open before any put
    assert a.put_many(namespace.id, blocks[:3]) == 3
    assert b.put_many(namespace.id, blocks[3:5]) == 2
    # b evicted the folder's oldest record although a wrote it and b's index never saw it.
    assert [a.path_of(namespace.id, blk.key).is_file() for blk in blocks] == [
        False,
        True,
        True,
        True,
        True,
        False,
    ]
    assert b.stats()["evictions"] == 1 and a.stats()["evictions"] == 0
    on_disk = sum(p.stat().st_size for p in _record_files(tmp_path))
    assert a.folder_bytes() == b.folder_bytes() == on_disk == 4 * size
    a.close()
    b.close()


def test_eviction_follows_use_by_any_tier_of_the_folder(
    tmp_path: Path, namespace: Namespace
) -> None:
    blocks = make_blocks(namespace, 5)
    size = len(encode_record(blocks[0]))
    a, b = _tier(tmp_path, 4 * size), _tier(tmp_path, 4 * size)
    a.put_many(namespace.id, blocks[:4])
    assert b.get_many(namespace.id, [blocks[0].key])[0] is not None  # b uses a's oldest
    a.put_many(namespace.id, [blocks[4]])  # a must evict: 1 is now the least recently used
    present = [g is not None for g in a.get_many(namespace.id, [blk.key for blk in blocks])]
    assert present == [True, False, True, True, True]
    a.close()
    b.close()


def test_a_record_another_tier_wrote_is_refreshed_not_rewritten(
    tmp_path: Path, namespace: Namespace
) -> None:
    [block] = make_blocks(namespace, 1)
    a, b = _tier(tmp_path, 1 << 20), _tier(tmp_path, 1 << 20)
    a.put_many(namespace.id, [block])
    path = a.path_of(namespace.id, block.key)
    inode = path.stat().st_ino
    assert b.put_many(namespace.id, [block]) == 1
    assert path.stat().st_ino == inode
    assert len(b) == 1 and b.folder_bytes() == path.stat().st_size
    a.close()
    b.close()


_DEAD_OWNER = """
import sys
from cachetier.tiers.disk.tier import DiskTier, DiskTierConfig
print(DiskTier(DiskTierConfig(sys.argv[1], 1 << 20)).owner_id)  # exits without closing
"""


def test_an_open_removes_orphan_temp_files_only(tmp_path: Path, namespace: Namespace) -> None:
    [block] = make_blocks(namespace, 1)
    live = _tier(tmp_path, 1 << 20)
    live.put_many(namespace.id, [block])
    shard = live.path_of(namespace.id, block.key).parent
    dead_owner = run_python(_DEAD_OWNER, tmp_path)
    old_boot_owner = "f" * 32 + "-12-0badc0de"
    names = {
        "live": temp_name(live.owner_id),
        "dead": temp_name(dead_owner),
        "old boot": temp_name(old_boot_owner),
        "legacy": ".tmp-" + "a" * 32,  # an older cachetier's: no owner in the name
        "live, stuck": temp_name(live.owner_id),
        "legacy, stuck": ".tmp-" + "b" * 32,
    }
    two_hours_ago = time.time_ns() - 7200 * 10**9
    for what, name in names.items():
        (shard / name).write_bytes(b"in flight")
        if "stuck" in what:
            os.utime(shard / name, ns=(two_hours_ago, two_hours_ago))
    _tier(tmp_path, 1 << 20).close()
    kept = {what for what, name in names.items() if (shard / name).exists()}
    assert kept == {"live", "legacy"}
    live.close()


def test_files_and_folders_are_private_by_default(tmp_path: Path, namespace: Namespace) -> None:
    [block] = make_blocks(namespace, 1)
    root = tmp_path / "new"
    with DiskTier(DiskTierConfig(str(root), 1 << 20)) as tier:
        tier.put_many(namespace.id, [block])
        path = tier.path_of(namespace.id, block.key)
        assert _mode(path) == _mode(root / ".ledger") == 0o600
        assert _mode(path.parent) == _mode(path.parent.parent) == _mode(root) == 0o700


def test_modes_are_set_whatever_the_umask(tmp_path: Path, namespace: Namespace) -> None:
    [block] = make_blocks(namespace, 1)
    root = tmp_path / "group"
    old = os.umask(0o077)
    try:
        config = DiskTierConfig(str(root), 1 << 20, file_mode=0o640, dir_mode=0o750)
        with DiskTier(config) as tier:
            tier.put_many(namespace.id, [block])
            path = tier.path_of(namespace.id, block.key)
    finally:
        os.umask(old)
    assert _mode(path) == _mode(root / ".ledger") == 0o640
    assert _mode(path.parent) == _mode(path.parent.parent) == _mode(root) == 0o750


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("file_mode", 0o1000),
        ("file_mode", -1),
        ("file_mode", True),
        ("file_mode", "0640"),
        ("file_mode", 0o440),  # the tier could not write its own files
        ("dir_mode", 0o600),
        ("orphan_temp_age_s", 0),
        ("admit_wait_s", 0),
        ("admit_wait_s", -1.0),
    ],
)
def test_bad_disk_settings_are_value_errors(tmp_path: Path, name: str, value: object) -> None:
    with pytest.raises(ValueError, match=name):
        DiskTierConfig(str(tmp_path), 1 << 20, **{name: value})  # type: ignore[arg-type]


# ---- the shared ledger: bad input heals from the folder ----------------------------------


def _ledger_with(root: Path, **changes: object) -> bytes:
    """The ledger's bytes with some fields changed (a valid file that tells lies)."""
    state = decode_state((root / LEDGER_NAME).read_bytes(), read_boot_id())
    for name, value in changes.items():
        setattr(state, name, value)
    return encode_state(state)


def _damaged(root: Path, how: str) -> bytes:
    data = (root / LEDGER_NAME).read_bytes()
    if how == "empty":
        return b""
    if how == "truncated":
        return data[: len(data) // 2]
    if how == "bit-flip":
        flipped = bytearray(data)
        flipped[-3] ^= 0x04
        return bytes(flipped)
    if how == "garbage":
        return os.urandom(len(data))
    if how == "older-format":
        body = json.dumps({"used": 1}).encode()
        return b"CTLEDGER" + struct.pack("<HI", 0, zlib.crc32(body)) + body
    if how == "another-boot":
        return _ledger_with(root, boot_id="f" * 32, committed_bytes=10**12)
    if how == "dead-writer":
        return _ledger_with(root, reserved={read_boot_id() + "-99999-0badc0de": 10**9})
    if how == "stale-overcount":  # a process killed while it evicted, long ago
        return _ledger_with(root, committed_bytes=10**9, healed_at=1)
    raise AssertionError(how)


LEDGER_DAMAGE = [
    "empty",
    "truncated",
    "bit-flip",
    "garbage",
    "older-format",
    "another-boot",
    "dead-writer",
    "stale-overcount",
]


@pytest.mark.parametrize("how", LEDGER_DAMAGE)
def test_a_bad_ledger_is_rebuilt_from_the_folder(
    tmp_path: Path, namespace: Namespace, how: str
) -> None:
    blocks = make_blocks(namespace, 4)
    with _tier(tmp_path, 1 << 20) as tier:
        tier.put_many(namespace.id, blocks)
    (tmp_path / LEDGER_NAME).write_bytes(_damaged(tmp_path, how))
    with _tier(tmp_path, 1 << 20) as tier:
        assert tier.heals == 1
        on_disk = sum(p.stat().st_size for p in _record_files(tmp_path))
        assert tier.folder_bytes() == on_disk
        got = tier.get_many(namespace.id, [b.key for b in blocks])
        assert all(g is not None and bytes(g.data) == b.data for g, b in zip(got, blocks))


def test_a_ledger_of_a_newer_format_is_refused(tmp_path: Path, namespace: Namespace) -> None:
    _tier(tmp_path, 1 << 20).close()
    body = b"{}"
    newer = b"CTLEDGER" + struct.pack("<HI", 99, zlib.crc32(body)) + body
    (tmp_path / LEDGER_NAME).write_bytes(newer)
    with pytest.raises(TierUnavailableError, match="newer"):
        _tier(tmp_path, 1 << 20)
    assert (tmp_path / LEDGER_NAME).read_bytes() == newer  # not overwritten


def test_records_removed_behind_the_ledgers_back_are_healed(
    tmp_path: Path, namespace: Namespace
) -> None:
    blocks = make_blocks(namespace, 4)
    size = len(encode_record(blocks[0]))
    with _tier(tmp_path, 3 * size) as tier:
        tier.put_many(namespace.id, blocks[:3])
        for path in _record_files(tmp_path):
            path.unlink()  # the ledger still counts a full folder
        heals = tier.heals
        assert tier.put_many(namespace.id, [blocks[3]]) == 1
        assert tier.heals == heals + 1 and tier.folder_bytes() == size
        assert tier.get_many(namespace.id, [blocks[3].key])[0] is not None


def test_modes_come_from_the_environment_in_octal(tmp_path: Path, namespace: Namespace) -> None:
    env = {
        "CACHETIER_CPU_BYTES": "0",
        "CACHETIER_DISK_PATH": str(tmp_path / "pods"),
        "CACHETIER_DISK_FILE_MODE": "0640",
        "CACHETIER_DISK_DIR_MODE": "0o750",
    }
    config = StoreConfig.from_env(env)
    assert (config.disk_file_mode, config.disk_dir_mode) == (0o640, 0o750)
    [tier] = build_tiers(config)
    assert isinstance(tier, DiskTier)
    [block] = make_blocks(namespace, 1)
    tier.put_many(namespace.id, [block])
    path = tier.path_of(namespace.id, block.key)
    assert (_mode(path), _mode(path.parent)) == (0o640, 0o750)
    tier.close()
    with pytest.raises(ValueError, match="octal"):
        StoreConfig.from_env({**env, "CACHETIER_DISK_FILE_MODE": "0699"})
    with pytest.raises(ValueError, match="disk_dir_mode"):
        StoreConfig.from_env({**env, "CACHETIER_DISK_DIR_MODE": "0600"})


def test_a_folder_in_memory_is_allowed_but_named_in_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    shm = Path(tempfile.mkdtemp(prefix="cachetier-test-", dir="/dev/shm"))  # a real tmpfs
    try:
        with caplog.at_level(logging.WARNING, logger="cachetier.tiers.disk.tier"):
            in_memory = _tier(shm / "cache", 1 << 20)
        try:
            assert in_memory.filesystem == "tmpfs"
            assert f"{shm / 'cache'} is on tmpfs" in caplog.text
            ns = Namespace("m", SMALL_LAYOUT)
            (block,) = make_blocks(ns, 1)
            assert in_memory.put_many(ns.id, [block]) == 1  # it still works as a disk tier
        finally:
            in_memory.close()
    finally:
        shutil.rmtree(shm, ignore_errors=True)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="cachetier.tiers.disk.tier"):
        on_disk = _tier(tmp_path / "cache", 1 << 20)
    on_disk.close()
    assert on_disk.filesystem == mount_fstype(tmp_path)
    assert ("is on" in caplog.text) == (on_disk.filesystem in MEMORY_FILESYSTEMS)
