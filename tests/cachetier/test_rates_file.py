"""cachetier.store.rates_file: the disk tier's measured speed outlives the process, and a bad file
is
a clean miss."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cachetier.record import KVBlock
from cachetier.store.config import StoreConfig, build_store
from cachetier.store.rates_file import MAX_BYTES, RATES_FILE_NAME, RatesFile
from cachetier.store.tiered import TieredStore

KEYS = [bytes([i]) * 32 for i in range(8)]


def _store(folder: Path) -> TieredStore:
    return build_store(StoreConfig(cpu_bytes=0, disk_path=str(folder), fsync=False))


def _read_blocks(store: TieredStore) -> None:
    blocks = [KVBlock(k, b"f" * 32, "float32", (1024,), 16, bytes(4096)) for k in KEYS]
    store.tiers[-1].put_many("ns", blocks)
    hit = store.lookup("ns", KEYS)
    assert len(store.restore_prefix("ns", KEYS, hit=hit).blocks) == 8


def test_a_new_store_on_the_folder_starts_from_the_last_measured_speed(tmp_path: Path) -> None:
    first = _store(tmp_path)
    assert first.rates.get("disk") is None  # nothing kept yet: unmeasured
    _read_blocks(first)
    measured = first.rates.get("disk")
    first.close()
    assert measured is not None and measured.seconds_per_byte is not None
    kept = json.loads((tmp_path / RATES_FILE_NAME).read_text())
    assert kept["tier"] == "disk" and kept["seconds_per_byte"] > 0
    with _store(tmp_path) as second:
        adopted = second.rates.get("disk")
        assert adopted is not None
        assert adopted.seconds_per_byte == pytest.approx(measured.seconds_per_byte)
        assert adopted.latency_s == pytest.approx(measured.latency_s)
        assert adopted.num_reads == measured.num_reads


def test_a_store_that_never_read_leaves_the_kept_speed_alone(tmp_path: Path) -> None:
    path = tmp_path / RATES_FILE_NAME
    doc = {"version": 1, "tier": "disk", "latency_s": 1e-4, "seconds_per_byte": 1e-9}
    path.write_text(json.dumps({**doc, "num_reads": 3}))
    before = path.read_bytes()
    _store(tmp_path).close()
    assert path.read_bytes() == before


@pytest.mark.parametrize(
    "content",
    [
        b"",
        b"not json",
        b"[]",
        b'{"version": 2, "tier": "disk", "latency_s": 0, "seconds_per_byte": 1e-9, "num_reads": 1}',
        b'{"version": 1, "tier": "redis", "latency_s": 0, "seconds_per_byte": 1e-9, '
        b'"num_reads": 1}',
        b'{"version": 1, "tier": "disk", "latency_s": 0, "seconds_per_byte": NaN, "num_reads": 1}',
        b'{"version": 1, "tier": "disk", "latency_s": -1, "seconds_per_byte": 1e-9, '
        b'"num_reads": 1}',
        b'{"version": 1, "tier": "disk", "latency_s": 0, "seconds_per_byte": 0, "num_reads": 1}',
        b'{"version": 1, "tier": "disk", "latency_s": 0, "seconds_per_byte": "fast", '
        b'"num_reads": 1}',
        b'{"version": 1, "tier": "disk", "latency_s": true, "seconds_per_byte": 1e-9, '
        b'"num_reads": 1}',
        b'{"version": 1, "tier": "disk"}',
        b'{"version": 1, "tier": "disk", "latency_s": 0, "seconds_per_byte": 1e-9, '
        b'"num_reads": 1, "pad": "' + b"x" * MAX_BYTES + b'"}',
    ],
)
def test_a_bad_file_is_ignored_and_replaced_by_a_real_measure(
    tmp_path: Path, content: bytes
) -> None:
    (tmp_path / RATES_FILE_NAME).write_bytes(content)
    store = _store(tmp_path)
    assert store.rates.get("disk") is None
    _read_blocks(store)
    store.close()
    assert RatesFile(tmp_path / RATES_FILE_NAME, "disk").load() is not None


def test_a_file_that_cannot_be_written_is_only_logged(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    store = _store(tmp_path)
    rates = RatesFile(tmp_path / "no-such-folder" / RATES_FILE_NAME, "disk")
    _read_blocks(store)
    rates.save(store.rates.get("disk"), force=True)
    assert "could not keep the disk tier's rate" in caplog.text
    assert rates.load() is None
    store.close()
