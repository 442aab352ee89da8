from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

from cachetier.primitives.keys import Namespace
from cachetier.record import KVBlock
from cachetier.store.config import StoreConfig, build_store
from cachetier.store.tiered import TieredStore
from cachetier.store.writer import AGED_AFTER_S
from cachetier.tiers.cpu import CPUTier, CPUTierConfig
from cachetier.tiers.disk.tier import DiskTier, DiskTierConfig
from cachetier.util.parallel import map_in_threads
from tests.support import SMALL_LAYOUT, keys_of, make_blocks

BIG = 1 << 30


def _stack(tmp_path: Path, cpu_bytes: int = BIG) -> TieredStore:
    return TieredStore(
        [
            CPUTier(CPUTierConfig(cpu_bytes)),
            DiskTier(DiskTierConfig(str(tmp_path / "disk"), BIG, fsync=False)),
        ]
    )


@pytest.fixture
def store(tmp_path: Path) -> Iterator[TieredStore]:
    """A CPU tier over a disk tier in ``tmp_path``; closed afterwards."""
    stack = _stack(tmp_path)
    yield stack
    stack.close()


def _put_and_flush(store: TieredStore, namespace: Namespace, num_blocks: int) -> list[KVBlock]:
    """Put ``num_blocks`` blocks and wait until every tier holds them."""
    blocks = make_blocks(namespace, num_blocks)
    assert store.put_many(namespace.id, blocks) == num_blocks
    assert store.flush(timeout=10)
    return blocks


def test_put_writes_through_to_lower_tiers(store: TieredStore, namespace: Namespace) -> None:
    blocks = _put_and_flush(store, namespace, 3)
    disk = store.tiers[1]
    assert disk.contains_prefix(namespace.id, [b.key for b in blocks]) == 3


def test_lookup_spans_tiers_and_restores_the_leading_run(
    store: TieredStore, namespace: Namespace
) -> None:
    cpu, disk = store.tiers
    blocks = make_blocks(namespace, 6)
    keys = [b.key for b in blocks]
    cpu.put_many(namespace.id, blocks[:2])
    disk.put_many(namespace.id, blocks[2:4])
    cpu.put_many(namespace.id, [blocks[5]])  # after a gap: not part of the prefix
    hit = store.lookup(namespace.id, keys)
    assert hit.num_blocks == 4
    assert hit.spans == ((0, 0, 2), (1, 2, 4))
    assert hit.blocks_per_tier() == {"cpu": 2, "disk": 2}
    restored = store.restore_prefix(namespace.id, keys, fingerprint=namespace.fingerprint)
    assert [b.key for b in restored.blocks] == keys[:4]
    assert restored.sources == ("cpu", "cpu", "disk", "disk")
    # The disk hits were promoted to the CPU tier.
    assert cpu.contains_prefix(namespace.id, keys) == 4


def test_blocks_of_another_namespace_fingerprint_are_misses(
    store: TieredStore, namespace: Namespace
) -> None:
    blocks = _put_and_flush(store, namespace, 2)
    other = Namespace("other", SMALL_LAYOUT)
    restored = store.restore_prefix(
        namespace.id, [b.key for b in blocks], fingerprint=other.fingerprint
    )
    assert restored.blocks == ()
    assert store.stats()["corrupt"] == 4  # each tier's copy of each block was refused


def test_a_read_that_fails_after_lookup_ends_the_prefix(
    store: TieredStore, namespace: Namespace
) -> None:
    blocks = _put_and_flush(store, namespace, 4)
    disk = store.tiers[1]
    assert isinstance(disk, DiskTier)
    store.tiers[0].delete(namespace.id, [blocks[1].key])
    disk.path_of(namespace.id, blocks[1].key).write_bytes(b"torn")
    restored = store.restore_prefix(namespace.id, [b.key for b in blocks])
    assert [b.key for b in restored.blocks] == [blocks[0].key]


def test_restart_of_the_stack_finds_blocks_on_disk(tmp_path: Path, namespace: Namespace) -> None:
    blocks = make_blocks(namespace, 5)
    keys = [b.key for b in blocks]
    with _stack(tmp_path) as store:
        store.put_many(namespace.id, blocks)
    with _stack(tmp_path) as store:  # close() flushed the background writes
        restored = store.restore_prefix(namespace.id, keys)
        assert [bytes(b.data) for b in restored.blocks] == [bytes(b.data) for b in blocks]
        assert set(restored.sources) == {"disk"}


class _SlowTier(CPUTier):
    """A lower tier that blocks until released: stands in for a stalled Redis."""

    name = "slow"

    def __init__(self) -> None:
        super().__init__(CPUTierConfig(BIG))
        self.release = threading.Event()

    def put_many(self, namespace: str, blocks: Sequence[KVBlock]) -> int:
        self.release.wait(timeout=30)
        return super().put_many(namespace, blocks)


def test_a_stalled_lower_tier_never_blocks_puts_and_overflow_is_counted(
    namespace: Namespace,
) -> None:
    slow = _SlowTier()
    store = TieredStore([CPUTier(CPUTierConfig(BIG)), slow], write_queue_blocks=4)
    blocks = make_blocks(namespace, 10)
    for block in blocks:  # each returns at once although the lower tier is stuck
        assert store.put_many(namespace.id, [block]) == 1
    assert store.flush(timeout=0.05) is False
    assert store.stats()["rejected"] >= 5
    slow.release.set()
    assert store.flush(timeout=10)
    assert store.stats()["pending_writes"] == {"slow": 0}
    store.close()


class _StarvedTier(CPUTier):
    """A lower tier whose puts hang on the writer's own thread, as a writer at idle priority
    hangs on a node whose cores other processes keep busy; a put on any other thread passes."""

    name = "starved"

    def __init__(self) -> None:
        super().__init__(CPUTierConfig(BIG))
        self.release = threading.Event()
        self.threads: list[str] = []

    def put_many(self, namespace: str, blocks: Sequence[KVBlock]) -> int:
        name = threading.current_thread().name
        self.threads.append(name)
        if name.startswith("cachetier-writer-"):
            self.release.wait(timeout=60)
        return super().put_many(namespace, blocks)


def test_a_flush_applies_what_a_starved_writer_thread_does_not(namespace: Namespace) -> None:
    starved = _StarvedTier()
    store = TieredStore([CPUTier(CPUTierConfig(BIG)), starved])
    blocks = make_blocks(namespace, 6)
    for block in blocks:
        assert store.put_many(namespace.id, [block]) == 1
    flushed: list[bool] = []
    flusher = threading.Thread(target=lambda: flushed.append(store.flush(timeout=60)))
    flusher.start()
    deadline = time.monotonic() + 60
    while len(starved.threads) < len(blocks) and time.monotonic() < deadline:
        time.sleep(0.01)
    try:
        # The writer thread holds the first put; the flushing thread applied the other five
        # (or the aged-backlog thread some, had the flusher waited a second).
        assert starved.threads[0] == "cachetier-writer-starved"
        assert flusher.name in starved.threads[1:]
        assert set(starved.threads[1:]) <= {flusher.name, "cachetier-aged-writer-starved"}
        assert starved.get_many(namespace.id, keys_of(blocks[1:])) == blocks[1:]
        assert flushed == []  # the held put is not applied yet
    finally:
        starved.release.set()
        flusher.join(timeout=60)
    assert flushed == [True]
    assert store.stats()["pending_writes"] == {"starved": 0}
    assert starved.get_many(namespace.id, keys_of(blocks)) == blocks
    store.close()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="a thread's own nice is Linux's")
def test_puts_a_starved_idle_writer_leaves_are_applied_once_aged(namespace: Namespace) -> None:
    # An engine that spins on every core never lets an idle-class writer run: without a flush,
    # the aged-backlog thread (nice 19, normal class) must still write what waited a second.
    starved = _StarvedTier()
    seen: list[tuple[int, int]] = []
    put_many = starved.put_many

    def noting(namespace_id: str, blocks: Sequence[KVBlock]) -> int:
        if threading.current_thread().name.startswith("cachetier-aged-writer-"):
            nice = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
            seen.append((nice, os.sched_getscheduler(0)))
        return put_many(namespace_id, blocks)

    starved.put_many = noting  # type: ignore[method-assign]
    store = TieredStore([CPUTier(CPUTierConfig(BIG)), starved])
    blocks = make_blocks(namespace, 4)
    try:
        started = time.monotonic()
        for block in blocks:
            assert store.put_many(namespace.id, [block]) == 1
        deadline = started + 60
        while len(starved.threads) < len(blocks) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert time.monotonic() - started >= AGED_AFTER_S  # not before they aged
        assert starved.threads[0] == "cachetier-writer-starved"
        assert starved.threads[1:] == ["cachetier-aged-writer-starved"] * (len(blocks) - 1)
        assert starved.get_many(namespace.id, keys_of(blocks[1:])) == blocks[1:]
        assert seen == [(19, os.SCHED_OTHER)] * (len(blocks) - 1)
    finally:
        starved.release.set()
        store.close()


class _WatchedTier(CPUTier):
    """A lower tier that notes the priority and the threads its puts run on."""

    name = "watched"

    def __init__(self) -> None:
        super().__init__(CPUTierConfig(BIG))
        self.seen: list[tuple[int, set[str]]] = []
        self.policies: list[int] = []

    def put_many(self, namespace: str, blocks: Sequence[KVBlock]) -> int:
        nice = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
        self.policies.append(os.sched_getscheduler(0))
        # What a disk tier's batched write does: fan out over the data threads, if allowed.
        names = map_in_threads(lambda _: threading.current_thread().name, list(range(4)))
        self.seen.append((nice, set(names)))  # type: ignore[arg-type]
        return super().put_many(namespace, blocks)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="a thread's own nice is Linux's")
@pytest.mark.parametrize("writer_nice", [19, 0])
def test_background_writes_run_at_the_lowest_priority_on_their_own_thread(
    namespace: Namespace, writer_nice: int
) -> None:
    # Writes to lower tiers must not preempt an engine that keeps every core busy: at nice 19
    # they use what it leaves idle, and they never take the data threads reads wait on.
    watched = _WatchedTier()
    store = TieredStore([CPUTier(CPUTierConfig(BIG)), watched], writer_nice=writer_nice)
    before = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    policy_before = os.sched_getscheduler(0)
    try:
        assert store.put_many(namespace.id, make_blocks(namespace, 3)) == 3
        assert store.flush(timeout=10)
    finally:
        store.close()
    assert watched.seen == [(max(before, writer_nice), {"cachetier-writer-watched"})]
    # At the lowest setting the writer runs only on cores nothing else wants.
    want = os.SCHED_IDLE if writer_nice == 19 else policy_before
    assert watched.policies == [want]
    # The caller's own thread keeps its priority and its class.
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == before
    assert os.sched_getscheduler(0) == policy_before
    with pytest.raises(ValueError, match="writer_nice"):
        StoreConfig(writer_nice=20)


def test_config_builds_the_embedded_default(tmp_path: Path, namespace: Namespace) -> None:
    config = StoreConfig.from_env(
        {"CACHETIER_CPU_BYTES": "1000000", "CACHETIER_DISK_PATH": str(tmp_path / "d")}
    )
    assert config.cpu_bytes == 1_000_000 and config.redis_url is None
    with build_store(config) as store:
        assert [t.name for t in store.tiers] == ["cpu", "disk"]
        store.put_many(namespace.id, make_blocks(namespace, 1))


def test_config_rejects_nonsense() -> None:
    with pytest.raises(ValueError, match="at least one tier"):
        StoreConfig(cpu_bytes=0)
    with pytest.raises(ValueError, match="compression"):
        StoreConfig(compression="zstd")
    with pytest.raises(ValueError, match="CACHETIER_CPU_BYTES='lots' is not an integer"):
        StoreConfig.from_env({"CACHETIER_CPU_BYTES": "lots"})


def test_empty_store_is_refused() -> None:
    with pytest.raises(ValueError):
        TieredStore([])
