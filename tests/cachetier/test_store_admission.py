"""The store's admission, on a real CPU tier over a real disk tier (``StoreConfig`` as a user
writes it): the CPU tier takes every block, the disk only what the policy admits, pinned blocks
always, and every decision is counted per tier in the store's stats, the sidecar's
``/metrics`` families and the report's counters table."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client.core import Metric

from cachetier.admission import AdmissionConfig
from cachetier.primitives.keys import Namespace
from cachetier.record import KVBlock
from cachetier.report.counters import counters_table
from cachetier.server.metrics import admission_families
from cachetier.store.config import StoreConfig, build_store
from cachetier.store.tiered import TieredStore
from tests.support import SMALL_LAYOUT, make_blocks

NS = Namespace("admitted-model", SMALL_LAYOUT)


def _store(folder: Path, **admission: object) -> TieredStore:
    config = StoreConfig(
        cpu_bytes=1 << 30,
        disk_path=str(folder),
        fsync=False,
        admission=AdmissionConfig(**admission),  # type: ignore[arg-type]
    )
    return build_store(config)


@pytest.fixture
def second_hit(tmp_path: Path) -> Iterator[TieredStore]:
    store = _store(tmp_path / "disk", admission_policy="second_hit")
    yield store
    store.close()


def _on_disk(store: TieredStore, blocks: list[KVBlock]) -> int:
    assert store.flush(timeout=10)
    got = store.tiers[1].get_many(NS.id, [b.key for b in blocks])
    return sum(r is not None for r in got)


def test_store_all_writes_every_block_and_counts_it(tmp_path: Path) -> None:
    with _store(tmp_path / "disk", admission_policy="all") as store:
        blocks = make_blocks(NS, 4)
        store.put_many(NS.id, blocks)
        assert _on_disk(store, blocks) == 4
        admission = store.stats()["admission"]
        assert admission["policy"] == "all"
        assert admission["tiers"]["disk"]["admitted"] == 4
        assert admission["tiers"]["disk"]["bytes_admitted"] == sum(b.nbytes for b in blocks)


def test_second_hit_writes_a_block_to_disk_on_its_second_put(second_hit: TieredStore) -> None:
    blocks = make_blocks(NS, 3)
    second_hit.put_many(NS.id, blocks)
    assert _on_disk(second_hit, blocks) == 0
    assert second_hit.lookup(NS.id, [b.key for b in blocks]).blocks_per_tier() == {"cpu": 3}
    second_hit.put_many(NS.id, blocks)  # computed again: used twice now
    assert _on_disk(second_hit, blocks) == 3
    counts = second_hit.stats()["admission"]["tiers"]["disk"]
    assert (counts["refused"], counts["admitted"]) == (3, 3)
    assert counts["bytes_refused"] == sum(b.nbytes for b in blocks)


def test_pinned_blocks_are_always_written(second_hit: TieredStore) -> None:
    blocks = make_blocks(NS, 3)
    second_hit.pin_keys(NS.id, [blocks[0].key])
    second_hit.put_many(NS.id, blocks)
    assert _on_disk(second_hit, blocks[:1]) == 1 and _on_disk(second_hit, blocks[1:]) == 0


def test_generated_blocks_follow_their_own_setting(tmp_path: Path) -> None:
    with _store(tmp_path / "d", admission_policy="second_hit", admission_generated="admit") as s:
        blocks = make_blocks(NS, 4)
        s.put_many(NS.id, blocks, generated=[False, False, True, True])
        assert _on_disk(s, blocks[:2]) == 0 and _on_disk(s, blocks[2:]) == 2
        with pytest.raises(ValueError, match="generated flags"):
            s.put_many(NS.id, blocks, generated=[True])


def test_decisions_reach_metrics_and_the_report(second_hit: TieredStore) -> None:
    blocks = make_blocks(NS, 2)
    second_hit.put_many(NS.id, blocks)
    stats = second_hit.stats()
    families: dict[str, Metric] = {f.name: f for f in admission_families(stats)}
    refused = families["cachetier_admission_refused"].samples
    assert [(s.labels, s.value) for s in refused] == [({"tier": "disk"}, 2)]
    table = counters_table(stats, "store")
    disk = next(row for row in table["rows"] if row[1] == "disk")
    assert disk[table["columns"].index("refused")] == 2
    assert disk[table["columns"].index("admitted")] == 0


def test_an_unknown_policy_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="admission_policy must be one of"):
        AdmissionConfig(admission_policy="lfu")  # type: ignore[arg-type]
