"""``read_each``: checked records land in an engine's memory; anything else is a miss."""

from __future__ import annotations

import threading
from pathlib import Path

import torch

from cachetier.connectors.reads import ThreadScratch, read_each
from cachetier.connectors.records import payload_block
from cachetier.primitives.keys import KVLayout, Namespace, hash_block
from cachetier.store.config import StoreConfig, build_store
from cachetier.store.tiered import TieredStore

LAYOUT = KVLayout("float32", 4, 2, 2, 8)
NS = Namespace("reads-test-model", LAYOUT)


def keys(n: int) -> list[bytes]:
    return [hash_block(NS.fingerprint, [i] * LAYOUT.block_size) for i in range(n)]


def payload(seed: int) -> torch.Tensor:
    return torch.full(LAYOUT.payload_shape, float(seed))


def put(store: TieredStore, namespace: Namespace, which: list[bytes]) -> None:
    blocks = [
        payload_block(key, namespace.fingerprint, LAYOUT, payload(i)) for i, key in enumerate(which)
    ]
    store.put_many(namespace.id, blocks)


def disk_store(path: Path) -> TieredStore:
    return build_store(StoreConfig(cpu_bytes=0, disk_path=str(path), fsync=False))


def test_each_payload_lands_once_at_its_position(tmp_path: Path) -> None:
    wanted = keys(6)
    landed: dict[int, torch.Tensor] = {}
    threads: set[int] = set()

    def land(position: int, data: torch.Tensor) -> int:
        landed[position] = data.clone()  # the scratch buffer is reused after land returns
        threads.add(threading.get_ident())
        return position

    with disk_store(tmp_path) as store:
        put(store, NS, wanted[:4])
        got = read_each(store, NS, LAYOUT, wanted, land, ThreadScratch())
    assert got == [0, 1, 2, 3, None, None]
    assert sorted(landed) == [0, 1, 2, 3]
    for position, data in landed.items():
        assert torch.equal(data, payload(position))


def test_a_record_of_another_namespace_or_layout_never_lands(tmp_path: Path) -> None:
    other_ns = Namespace("another-model", LAYOUT)
    wanted = keys(2)
    calls: list[int] = []
    with disk_store(tmp_path) as store:
        put(store, other_ns, wanted)
        # Same namespace id, other fingerprint in the record: the tiers hand it back, the
        # check refuses it.
        store.put_many(NS.id, [payload_block(wanted[0], other_ns.fingerprint, LAYOUT, payload(0))])
        got = read_each(store, NS, LAYOUT, wanted, lambda p, d: calls.append(p), ThreadScratch())
    assert got == [None, None] and calls == []


def test_scratch_is_one_buffer_per_thread_reused() -> None:
    scratch = ThreadScratch()
    first = scratch.block(64)
    assert scratch.block(64) is first
    assert scratch.block(128).nbytes == 128
    seen: list[int] = []
    worker = threading.Thread(target=lambda: seen.append(scratch.block(64).nbytes))
    worker.start()
    worker.join()
    assert seen == [64] and scratch.block(128).nbytes == 128
