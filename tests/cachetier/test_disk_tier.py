"""What only the disk tier does: a put of the record it already holds refreshes it instead of
writing it again (another record under the key still replaces it: the shared tier suite)."""

from __future__ import annotations

from pathlib import Path

from cachetier.keys import Namespace
from cachetier.record import encode_record
from cachetier.tiers.disk import DiskTier, DiskTierConfig
from tests.support import make_blocks


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
