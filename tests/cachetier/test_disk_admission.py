"""Room for a put in a disk tier folder shared with other processes
(``cachetier.tiers.disk.folder.SharedFolder.admit``): a put that waits for other writers'
batches gets its room once they land, whatever it saw before it waited.

Each tier below is its own owner of the folder, as a separate process is. The interleavings
that a loaded node produces by chance are made here on purpose, by running the other tiers'
work at the points where the waiting put looks at the folder.
"""

from __future__ import annotations

import time
from pathlib import Path
from types import SimpleNamespace

import pytest

import cachetier.tiers.disk.folder as folder_module
from cachetier.primitives.keys import Namespace
from cachetier.record import encode_record
from cachetier.tiers.disk.tier import DiskTier, DiskTierConfig
from tests.support import make_blocks


def _tier(root: Path, capacity: int) -> DiskTier:
    return DiskTier(DiskTierConfig(str(root), capacity, fsync=False, spare_bytes=0))


def test_a_put_that_waited_takes_the_room_of_batches_that_landed_after_its_last_look(
    tmp_path: Path, namespace: Namespace, monkeypatch: pytest.MonkeyPatch
) -> None:
    blocks = make_blocks(namespace, 6)
    size = len(encode_record(blocks[0]))
    waiter = _tier(tmp_path, 2 * size)
    other = _tier(tmp_path, 10 * size)  # another process, opened with a larger capacity
    holder = _tier(tmp_path, 10 * size)
    # A batch in flight in a third process holds more than the waiter's whole capacity.
    held = holder._folder.admit(4 * size, 4)
    assert held is not None
    other.put_many(namespace.id, blocks[:1])  # the waiter's index has not seen this one

    real_rescan = waiter._folder._rescan
    rescans = []

    def rescan_then_another_lands() -> None:
        real_rescan()
        if not rescans:  # a record renamed in just after the waiter's scan: found by a heal
            other.put_many(namespace.id, blocks[1:2])
        rescans.append(1)

    sleeps = []

    def sleep_while_the_others_land(seconds: float) -> None:
        if not sleeps:
            # While the waiter sleeps, the other process lands more than the waiter's capacity
            # and the held batch is given back: no batch is in flight any more.
            other.put_many(namespace.id, blocks[2:5])
            holder._folder.commit([], held.reserved)
        sleeps.append(seconds)

    monkeypatch.setattr(waiter._folder, "_rescan", rescan_then_another_lands)
    monkeypatch.setattr(
        folder_module,
        "time",
        SimpleNamespace(monotonic=time.monotonic, sleep=sleep_while_the_others_land),
    )
    assert waiter.put_many(namespace.id, blocks[5:]) == 1
    assert sleeps, "the put never waited: the interleaving was not made"
    assert waiter.stats()["rejected"] == 0
    assert waiter.folder_bytes() <= 2 * size
    [got] = waiter.get_many(namespace.id, [blocks[5].key])
    assert got is not None and bytes(got.data) == bytes(blocks[5].data)
    for tier in (waiter, other, holder):
        tier.close()


def test_a_put_with_nothing_to_evict_and_nobody_writing_is_refused_at_once(
    tmp_path: Path, namespace: Namespace, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The other side of the rule: a current look that finds no room and no batch in flight
    # does not wait out ``admit_wait_s``.
    [block] = make_blocks(namespace, 1)
    size = len(encode_record(block))
    tier = _tier(tmp_path, 2 * size)
    sleeps = []
    monkeypatch.setattr(
        folder_module, "time", SimpleNamespace(monotonic=time.monotonic, sleep=sleeps.append)
    )
    assert tier._folder.admit(3 * size, 3) is not None  # alone and stuck: one batch may exceed
    assert sleeps == []
    tier.close()
