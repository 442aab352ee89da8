"""The record guard on a real CPU tier over a real disk tier: what of a restore may be used, by
writer and by each record's own tokens, and what is quarantined and deleted."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest

from cachetier.guard import GuardConfig, GuardSampler
from cachetier.guard.first_layer import FirstLayer
from cachetier.guard.record_check import RecordCheck
from cachetier.record import KVBlock, writer_name
from cachetier.store.record_guard import RecordGuard
from cachetier.store.tiered import TieredStore
from tests.cachetier.guard_records import (
    BLOCK,
    FIRST_LAYER_FORGERIES,
    forged,
    model_kv,
    namespace_of,
    records_of,
)

TOKENS = [int(t) for t in np.random.default_rng(5).integers(0, 256, size=6 * BLOCK)]
HONEST, BUGGY = b"h" * 16, b"b" * 16


@pytest.fixture
def store(cpu_disk_store: TieredStore) -> TieredStore:
    return cpu_disk_store


@pytest.fixture(scope="module")
def kv(tiny_model_dir: Path) -> np.ndarray:
    return model_kv(tiny_model_dir, TOKENS)


def _guard(store: TieredStore, model_dir: Path, first_hits: int = 1) -> RecordGuard:
    sampler = GuardSampler(GuardConfig(first_hits=first_hits, fraction=0.0))
    return RecordGuard(store, RecordCheck(FirstLayer.from_folder(model_dir)), sampler)


def _restore(store: TieredStore, guard: RecordGuard, records: list[KVBlock]) -> tuple[int, str]:
    ns = namespace_of_records(records)
    got = store.restore_prefix(ns, [r.key for r in records])
    admitted = guard.admit(ns, got.blocks, got.sources, TOKENS, 0)
    return admitted.count, admitted.cause or ""


def namespace_of_records(records: list[KVBlock]) -> str:
    return NS_IDS[records[0].fingerprint]


NS_IDS: dict[bytes, str] = {}


def _put(store: TieredStore, kv: np.ndarray, records: list[KVBlock]) -> str:
    ns = namespace_of(kv)
    NS_IDS[ns.fingerprint] = ns.id
    store.tiers[1].put_many(ns.id, records)
    return ns.id


def test_a_new_writer_is_verified_first_then_trusted(
    store: TieredStore, tiny_model_dir: Path, kv: np.ndarray
) -> None:
    records = records_of(kv, TOKENS, writer=HONEST)
    _put(store, kv, records)
    guard = _guard(store, tiny_model_dir)
    assert _restore(store, guard, records) == (0, "new_writer")  # computed and compared
    # Trust is per tier: the read promoted the records into the CPU tier, where the writer is
    # new too; after that its first hit in each tier is behind it.
    assert _restore(store, guard, records) == (0, "new_writer")
    assert _restore(store, guard, records) == (6, "")
    assert guard.stats.new_writer_verifications == 2


def test_own_records_are_not_drawn_as_a_new_writer(
    store: TieredStore, tiny_model_dir: Path, kv: np.ndarray
) -> None:
    records = records_of(kv, TOKENS)  # made here: this process's writer
    _put(store, kv, records)
    assert _restore(store, _guard(store, tiny_model_dir), records) == (6, "")


@pytest.mark.parametrize("name", sorted(FIRST_LAYER_FORGERIES))
def test_a_trusted_writers_forged_record_is_caught_and_only_its_writer_quarantined(
    store: TieredStore,
    tiny_model_dir: Path,
    kv: np.ndarray,
    name: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    # The mixed folder: an honest writer's records and a buggy writer's, the first hit honest.
    honest = records_of(kv, TOKENS, writer=HONEST)
    buggy = records_of(kv, TOKENS, writer=BUGGY)
    records = honest[:3] + [forged(r, FIRST_LAYER_FORGERIES[name]) for r in buggy[3:]]
    ns = _put(store, kv, records)
    guard = _guard(store, tiny_model_dir, first_hits=0)  # no writer drawn: the check alone
    with caplog.at_level(logging.WARNING, logger="cachetier.store.record_guard"):
        assert _restore(store, guard, records) == (3, "record_check")
    for tier in ("cpu", "disk"):  # the read promoted its records: held back everywhere
        assert store.quarantines.holds_writer(tier, ns, writer_name(BUGGY))
        assert not store.quarantines.holds_writer(tier, ns, writer_name(HONEST))
        assert not store.quarantines.holds(tier, ns)  # not the whole namespace
    assert "not the KV of its tokens" in caplog.text and writer_name(BUGGY) in caplog.text
    # The bad record is gone from its tier. The buggy writer's other copies (promoted into the
    # CPU tier by the read, or on disk) are refused and deleted as each is met; the engine
    # computes those blocks and saves them, until the honest writer's serve the whole prompt.
    assert store.tiers[1].get_many(ns, [records[3].key]) == [None]
    causes = []
    for _ in range(4):
        count, cause = _restore(store, guard, honest)
        if count == 6:
            break
        causes.append(cause)
        store.tiers[1].put_many(ns, honest[count:])
    assert count == 6 and set(causes) == {"quarantined_writer"}


def test_a_quarantined_writers_records_are_refused_and_deleted(
    store: TieredStore, tiny_model_dir: Path, kv: np.ndarray
) -> None:
    records = records_of(kv, TOKENS[: 2 * BLOCK], writer=HONEST)
    records += records_of(kv, TOKENS, writer=BUGGY)[2:]
    ns = _put(store, kv, records)
    store.quarantines.add("disk", ns, "found bad", writer_name(BUGGY))
    guard = _guard(store, tiny_model_dir, first_hits=0)
    assert _restore(store, guard, records) == (2, "quarantined_writer")
    assert guard.stats.quarantined_writer_records == 4
    assert store.tiers[1].get_many(ns, [r.key for r in records[2:]]) == [None] * 4
    # A quarantine of the whole namespace holds back every writer.
    store.quarantines.add("disk", ns, "operator")
    assert store.quarantines.holds_writer("disk", ns, writer_name(HONEST))


def test_records_are_checked_at_their_place_in_the_sequence(
    store: TieredStore, tiny_model_dir: Path, kv: np.ndarray
) -> None:
    records = records_of(kv, TOKENS, writer=HONEST)
    ns = _put(store, kv, records)
    guard = _guard(store, tiny_model_dir, first_hits=0)
    got = store.restore_prefix(ns, [r.key for r in records[2:]])
    assert guard.admit(ns, got.blocks, got.sources, TOKENS[2 * BLOCK :], 2 * BLOCK).count == 4
    # The same records claimed at position 0 are not those tokens' KV there.
    assert guard.admit(ns, got.blocks, got.sources, TOKENS[2 * BLOCK :], 0).count == 0
