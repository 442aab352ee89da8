"""Disk faults: a full disk, unreadable, truncated and bit-flipped records, and a data folder
deleted under a running tier and server. Each gives clean misses and counted errors; no crash,
and no block that differs from what was stored is ever served.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from cachetier.primitives.keys import KVLayout, Namespace
from cachetier.record import KVBlock
from cachetier.tiers.disk.tier import DiskTier, DiskTierConfig
from cachetier.tiers.remote import RemoteTier, RemoteTierConfig
from tests.server.live import TOKENS, ThreadServer, test_config
from tests.support import SMALL_LAYOUT, make_blocks

ROOT = Path(__file__).resolve().parents[2]
BIG_LAYOUT = KVLayout("float16", block_size=16, num_layers=4, num_kv_heads=4, head_dim=64)


def _tier(root: Path, **config: object) -> DiskTier:
    return DiskTier(DiskTierConfig(root=str(root), capacity_bytes=1 << 30, **config))  # type: ignore[arg-type]


def _served_wrong(got: list[KVBlock | None], blocks: list[KVBlock]) -> int:
    return sum(
        1
        for b, want in zip(got, blocks)
        if b is not None and (bytes(b.data) != bytes(want.data) or bytes(b.key) != bytes(want.key))
    )


_FULL_DISK_CHILD = """
import json, resource, signal, sys
from cachetier.primitives.keys import KVLayout, Namespace
from cachetier.tiers.disk.tier import DiskTier, DiskTierConfig
from tests.support import SMALL_LAYOUT, make_blocks
# A write past the limit fails with EFBIG instead of killing the process, as ENOSPC would.
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (32 << 10, 32 << 10))
big = KVLayout("float16", block_size=16, num_layers=4, num_kv_heads=4, head_dim=64)
tier = DiskTier(DiskTierConfig(root=sys.argv[1], capacity_bytes=1 << 30))
small = make_blocks(Namespace("full-disk", SMALL_LAYOUT), 4, seed=1)
large = make_blocks(Namespace("full-disk", big), 4, seed=2)
stored = [tier.put_many(Namespace("full-disk", SMALL_LAYOUT).id, small),
          tier.put_many(Namespace("full-disk", big).id, large)]
print(json.dumps({"stored": stored, "stats": tier.stats()}))
"""


def test_a_full_disk_fails_puts_cleanly(tmp_path: Path, fault_figures) -> None:
    root = tmp_path / "disk"
    done = subprocess.run(
        [sys.executable, "-c", _FULL_DISK_CHILD, str(root)],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout.strip().splitlines()[-1])
    # 2 KiB records fit under the limit; 64 KiB ones cannot be written at all.
    assert report["stored"] == [4, 0]
    assert report["stats"]["errors"] == 4
    leftovers = [n for _, _, names in os.walk(root) for n in names if n.startswith(".tmp-")]
    assert leftovers == [], "a failed write must not leave its temp file behind"
    small = make_blocks(Namespace("full-disk", SMALL_LAYOUT), 4, seed=1)
    large = make_blocks(Namespace("full-disk", BIG_LAYOUT), 4, seed=2)
    with _tier(root) as tier:
        assert len(tier) == 4
        got_small = tier.get_many(Namespace("full-disk", SMALL_LAYOUT).id, [b.key for b in small])
        got_large = tier.get_many(Namespace("full-disk", BIG_LAYOUT).id, [b.key for b in large])
    assert all(got_small) and got_large == [None] * 4
    fault_figures.add("corrupt_served", _served_wrong(got_small, small))


def test_a_capacity_smaller_than_a_block_rejects_it(tmp_path: Path, namespace: Namespace) -> None:
    [block] = make_blocks(namespace, 1)
    with DiskTier(DiskTierConfig(root=str(tmp_path), capacity_bytes=100)) as tier:
        assert tier.put_many(namespace.id, [block]) == 0
        assert tier.get_many(namespace.id, [block.key]) == [None]
        assert tier.stats()["rejected"] == 1 and len(tier) == 0


def _damage(path: Path, how: str) -> None:
    data = bytearray(path.read_bytes())
    if how.startswith("truncate"):
        keep = {"truncate-empty": 0, "truncate-header": 10, "truncate-half": len(data) // 2}.get(
            how, len(data) - 1
        )
        path.write_bytes(data[:keep])
    elif how.startswith("flip"):
        where = {"flip-first": 0, "flip-header": 9, "flip-middle": len(data) // 2}.get(
            how, len(data) - 1
        )
        data[where] ^= 0x10
        path.write_bytes(data)
    elif how == "extend":
        path.write_bytes(data + b"\0" * 64)
    elif how == "directory":  # unreadable even for root: open() fails with EISDIR
        path.unlink()
        path.mkdir()
    elif how == "garbage":
        path.write_bytes(os.urandom(len(data)))
    else:
        raise AssertionError(how)


DAMAGE = [
    "truncate-empty",
    "truncate-header",
    "truncate-half",
    "truncate-last-byte",
    "flip-first",
    "flip-header",
    "flip-middle",
    "flip-last",
    "extend",
    "directory",
    "garbage",
]


@pytest.mark.parametrize("how", DAMAGE)
@pytest.mark.parametrize("compression", ["none", "lz4"])
def test_damaged_records_are_clean_misses(
    tmp_path: Path, namespace: Namespace, how: str, compression: str, fault_figures
) -> None:
    blocks = make_blocks(namespace, 3)
    with _tier(tmp_path, compression=compression) as tier:
        assert tier.put_many(namespace.id, blocks) == 3
        _damage(tier.path_of(namespace.id, blocks[1].key), how)
        keys = [b.key for b in blocks]
        got = tier.get_many(namespace.id, keys)
        into = [memoryview(bytearray(len(b.data))) for b in blocks]
        got_into = tier.get_into(namespace.id, keys, into)
        stats = tier.stats()
    wrong = _served_wrong(got, blocks) + _served_wrong(got_into, blocks)
    fault_figures.add("corrupt_served", wrong)
    assert wrong == 0
    assert got[1] is None and got_into[1] is None
    assert got[0] is not None and got[2] is not None
    assert stats["corrupt"] + stats["errors"] >= 1


@pytest.mark.parametrize("how", DAMAGE)
def test_damage_is_found_after_a_restart(
    tmp_path: Path, namespace: Namespace, how: str, fault_figures
) -> None:
    # The damage happens while no process runs; the next one indexes the file, then reads it.
    blocks = make_blocks(namespace, 2)
    with _tier(tmp_path) as tier:
        tier.put_many(namespace.id, blocks)
        path = tier.path_of(namespace.id, blocks[0].key)
    _damage(path, how)
    with _tier(tmp_path) as tier:
        got = tier.get_many(namespace.id, [b.key for b in blocks])
        assert tier.contains_prefix(namespace.id, [blocks[1].key]) == 1
    fault_figures.add("corrupt_served", _served_wrong(got, blocks))
    assert got[0] is None and got[1] is not None


def test_a_data_folder_deleted_under_a_running_tier(tmp_path: Path, namespace: Namespace) -> None:
    blocks = make_blocks(namespace, 4)
    with _tier(tmp_path / "disk") as tier:
        assert tier.put_many(namespace.id, blocks[:2]) == 2
        shutil.rmtree(tmp_path / "disk")
        assert tier.get_many(namespace.id, [b.key for b in blocks[:2]]) == [None, None]
        assert tier.contains_prefix(namespace.id, [blocks[0].key]) == 0
        # Writing again recreates what it needs; the index forgot the vanished blocks.
        assert tier.put_many(namespace.id, blocks[2:]) == 2
        assert all(tier.get_many(namespace.id, [b.key for b in blocks[2:]]))
        assert len(tier) == 2
        assert tier.used_bytes == sum(
            tier.path_of(namespace.id, b.key).stat().st_size for b in blocks[2:]
        )


def test_a_data_folder_deleted_under_a_running_server(tmp_path: Path, fault_figures) -> None:
    namespace = Namespace("deleted-folder-model", SMALL_LAYOUT)
    blocks = make_blocks(namespace, 6)
    # No CPU tier: every read goes to the disk folder the test deletes.
    server = ThreadServer(test_config(tmp_path / "server", cpu_bytes=0)).start()
    client = RemoteTier(RemoteTierConfig(url=server.url, token=TOKENS["alice"]))
    try:
        assert client.put_many(namespace.id, blocks[:3]) == 3
        shutil.rmtree(tmp_path / "server")
        got = client.get_many(namespace.id, [b.key for b in blocks[:3]])
        assert got == [None, None, None]
        assert client.contains_prefix(namespace.id, [b.key for b in blocks[:3]]) == 0
        assert client.put_many(namespace.id, blocks[3:]) == 3
        again = client.get_many(namespace.id, [b.key for b in blocks[3:]])
        fault_figures.add("corrupt_served", _served_wrong(again, blocks[3:]))
        assert all(again)
        assert client.stats()["errors"] == 0, "misses are not transport errors"
    finally:
        client.close()
        server.stop()
