"""Adaptive admission through a real store (``build_store``: a CPU tier over a real disk tier in
a folder): the default policy, a switch to a filter under one-hit traffic that the disk then
sees as refused writes, and a restarted store that admits as it learnt from the state file."""

from __future__ import annotations

import json
from pathlib import Path

from cachetier.admission import STATE_FILE_NAME, AdmissionConfig
from cachetier.primitives.keys import Namespace
from cachetier.record import KVBlock
from cachetier.store.config import StoreConfig, build_store
from cachetier.store.tiered import TieredStore
from tests.support import SMALL_LAYOUT, make_blocks

NS = Namespace("adaptive-model", SMALL_LAYOUT)
BLOCK_BYTES = make_blocks(NS, 1)[0].nbytes
NUM_REQUESTS = 2_500


def _store(folder: Path) -> TieredStore:
    config = StoreConfig(
        cpu_bytes=40 * BLOCK_BYTES,
        disk_path=str(folder),
        disk_bytes=100 * (BLOCK_BYTES + 512),  # a record is the payload and its header
        fsync=False,
        admission=AdmissionConfig(admission_tracked_keys=20_000),
    )
    assert config.admission.admission_policy == "adaptive"  # the default
    return build_store(config)


def _scan_requests() -> list[list[KVBlock]]:
    """One of 60 reused blocks, then three blocks never put again, per request."""
    reused = make_blocks(NS, 60, seed=1)
    fresh = iter(make_blocks(NS, 3 * NUM_REQUESTS, seed=2))
    return [[reused[i % 60], next(fresh), next(fresh), next(fresh)] for i in range(NUM_REQUESTS)]


def test_a_store_switches_to_a_filter_and_a_restart_keeps_it(tmp_path: Path) -> None:
    folder = tmp_path / "disk"
    with _store(folder) as store:
        for blocks in _scan_requests():
            store.put_many(NS.id, blocks)
        assert store.flush(timeout=60)
        admission = store.stats()["admission"]
    assert admission["policy"] == "adaptive"
    disk = admission["tiers"]["disk"]
    assert disk["admitted"] + disk["refused"] == 4 * NUM_REQUESTS
    assert disk["refused"] > NUM_REQUESTS  # most one-hit blocks kept off the disk
    kept = json.loads((folder / STATE_FILE_NAME).read_text())
    assert kept["tiers"]["disk"]["choice"] in ("second_hit", "tinylfu")

    new = make_blocks(NS, 2, seed=3)
    with _store(folder) as store:
        store.put_many(NS.id, new)
        assert store.flush(timeout=10)
        on_disk = store.tiers[1].get_many(NS.id, [b.key for b in new])
        assert on_disk == [None, None]  # first sightings: refused at once, as learnt
        assert store.tiers[0].get_many(NS.id, [new[0].key])[0] is not None  # the CPU has it
        assert store.stats()["admission"]["tiers"]["disk"]["refused"] == 2


def test_a_fresh_store_writes_first_sightings(tmp_path: Path) -> None:
    (tmp_path / "disk").mkdir()
    (tmp_path / "disk" / STATE_FILE_NAME).write_text('{"version": 1, "tiers": {"disk": 1}}')
    blocks = make_blocks(NS, 3, seed=4)
    with _store(tmp_path / "disk") as store:  # a state file that is not valid: store-all
        store.put_many(NS.id, blocks)
        assert store.flush(timeout=10)
        got = store.tiers[1].get_many(NS.id, [b.key for b in blocks])
        assert [g.key if g else None for g in got] == [b.key for b in blocks]
