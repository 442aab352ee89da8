"""cachetier as SGLang's HiCache storage backend, loaded the way SGLang loads it.

Every backend here is made by SGLang's own ``StorageBackendFactory`` on its ``dynamic`` path
(``--hicache-storage-backend dynamic``), from SGLang's ``HiCacheStorageConfig``; its host pools
are ``tests.connectors.sglang_pool``'s (SGLang's own page methods; that module says why the
pool classes themselves cannot be imported here).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

from cachetier.connectors.sglang.storage import CacheTierStorage
from tests.children import run_python
from tests.connectors.sglang_pool import make_mha_pool, make_mla_pool
from tests.server.live import TOKENS, ThreadServer, test_config
from tests.support import refusing_port

PAGE, PAGES, LAYERS, HEADS, DIM, LATENT = 4, 6, 3, 2, 8, 16
MHA_LAYOUTS = ("layer_first", "page_first", "page_first_direct", "page_head")
MLA_LAYOUTS = ("layer_first", "page_first", "page_first_direct")
FINGERPRINT = "sglang-test-model"
BACKEND = {
    "backend_name": "cachetier",
    "module_path": "cachetier.connectors.sglang.storage",
    "class_name": "CacheTierStorage",
    "interface_v1": 1,
}


def storage_config(extra: dict[str, Any], **fields: Any) -> HiCacheStorageConfig:
    values: dict[str, Any] = dict(
        tp_rank=0,
        tp_size=1,
        pp_rank=0,
        pp_size=1,
        attn_cp_rank=0,
        attn_cp_size=1,
        is_mla_model=False,
        enable_storage_metrics=False,
        is_page_first_layout=False,
        model_name=None,
        extra_config={**BACKEND, "model_fingerprint": FINGERPRINT, **extra},
    )
    values.update(fields)
    return HiCacheStorageConfig(**values)


def mha_pool(layout: str = "layer_first", dtype: torch.dtype = torch.float16) -> Any:
    return make_mha_pool(
        layout,
        page_size=PAGE,
        num_pages=PAGES,
        num_layers=LAYERS,
        num_heads=HEADS,
        head_dim=DIM,
        dtype=dtype,
    )


def mla_pool(layout: str = "layer_first") -> Any:
    return make_mla_pool(
        layout, page_size=PAGE, num_pages=PAGES, num_layers=LAYERS, kv_cache_dim=LATENT
    )


@pytest.fixture
def make_backend(tmp_path: Path) -> Iterator[Callable[..., CacheTierStorage]]:
    """Backends through SGLang's factory, each registered with its host pool; closed after."""
    made: list[CacheTierStorage] = []

    def make(pool: Any, extra: dict[str, Any] | None = None, **fields: Any) -> CacheTierStorage:
        extra = {"cpu_bytes": 0, "disk_path": str(tmp_path / "kv"), **(extra or {})}
        config = storage_config(extra, **fields)
        backend = StorageBackendFactory.create_backend("dynamic", config, pool)
        backend.register_mem_pool_host(pool)  # what SGLang's controller does next
        made.append(backend)
        return backend

    yield make
    for backend in made:
        backend.close()


def fill(pool: Any, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    pool.kv_buffer.copy_(torch.randn(pool.kv_buffer.shape, generator=gen).to(pool.kv_buffer.dtype))


def slots(pages: list[int]) -> torch.Tensor:
    """SGLang's host indices of whole pages."""
    return torch.cat([torch.arange(p * PAGE, (p + 1) * PAGE) for p in pages])


def page(pool: Any, index: int) -> torch.Tensor:
    return pool.get_data_page(index * PAGE, flat=True).clone()


def keys(*names: str) -> list[str]:
    return [f"{name:0>64}" for name in names]


def test_dynamic_backend_is_ours(make_backend: Callable[..., CacheTierStorage]) -> None:
    backend = make_backend(mha_pool())
    assert isinstance(backend, CacheTierStorage)
    assert backend.namespace is not None
    assert backend.namespace.layout.payload_shape == (LAYERS, 2, PAGE, HEADS, DIM)


@pytest.mark.parametrize(
    "mla,layout", [(False, x) for x in MHA_LAYOUTS] + [(True, x) for x in MLA_LAYOUTS]
)
def test_v1_pages_round_trip_into_other_pages(
    make_backend: Callable[..., CacheTierStorage], mla: bool, layout: str
) -> None:
    pool = mla_pool(layout) if mla else mha_pool(layout)
    backend = make_backend(pool, is_mla_model=mla)
    fill(pool, 1)
    want = [page(pool, 2), page(pool, 0)]
    names = keys("a1", "a2")
    assert backend.batch_set_v1(names, slots([2, 0])) == [True, True]
    pool.kv_buffer.zero_()
    assert backend.batch_exists(names) == 2
    assert backend.batch_get_v1(names, slots([5, 3])) == [True, True]
    assert torch.equal(page(pool, 5), want[0]) and torch.equal(page(pool, 3), want[1])
    assert not page(pool, 2).any(), "a get wrote outside its pages"


@pytest.mark.parametrize("layout", MHA_LAYOUTS)
def test_key_based_pages_round_trip(
    make_backend: Callable[..., CacheTierStorage], layout: str
) -> None:
    pool = mha_pool(layout)
    backend = make_backend(pool)
    fill(pool, 2)
    names = keys("b1", "b2")
    assert backend.batch_set(names, [pool.get_data_page(PAGE), pool.get_data_page(4 * PAGE)])
    targets = [pool.get_dummy_flat_data_page() for _ in names]
    got = backend.batch_get(names, targets)
    for target, result, index in zip(targets, got, (1, 4)):
        assert result is target
        pool.set_from_flat_data_page(0, result)  # SGLang's generic get path, its own code
        assert torch.equal(page(pool, 0), page(pool, index))
    assert backend.get(keys("b3")[0], pool.get_dummy_flat_data_page()) is None
    assert backend.exists(names[1]) and not backend.exists(keys("b3")[0])


def test_records_are_canonical_across_host_layouts(
    make_backend: Callable[..., CacheTierStorage],
) -> None:
    """A page stored from one layout reads into every other: the record is the canonical
    block, not SGLang's page bytes."""
    source = mha_pool("page_head")
    fill(source, 3)
    make_backend(source).batch_set_v1(keys("c1"), slots([1]))
    readers = {layout: mha_pool(layout) for layout in MHA_LAYOUTS}
    for layout, pool in readers.items():
        assert make_backend(pool).batch_get_v1(keys("c1"), slots([4])) == [True], layout
    # Each reader's page 4, stored again from that layout, reads back into page_head as the
    # source's page 1.
    for layout, pool in readers.items():
        make_backend(pool).batch_set_v1(keys(f"d-{layout}"), slots([4]))
        check = mha_pool("page_head")
        assert make_backend(check).batch_get_v1(keys(f"d-{layout}"), slots([0])) == [True]
        assert torch.equal(page(check, 0), page(source, 1)), layout


def test_the_record_is_the_canonical_block(make_backend: Callable[..., CacheTierStorage]) -> None:
    pool = mha_pool("layer_first")
    fill(pool, 4)
    backend = make_backend(pool)
    backend.batch_set_v1(keys("e1"), slots([3]))
    record = backend.store.get_many(backend.namespace.id, backend._keys(keys("e1")))[0]
    payload = torch.frombuffer(bytearray(record.data), dtype=torch.float16)
    # layer_first is [2, layers, slots, heads, dim]: canonical is [layers, 2, tokens, heads, dim]
    want = pool.kv_buffer[:, :, 3 * PAGE : 4 * PAGE].transpose(0, 1).contiguous()
    assert torch.equal(payload.view(want.shape), want)


@pytest.mark.parametrize(
    "change",
    [
        {"extra": {"model_fingerprint": "another-model"}},
        {"extra": {"tenant": "another-tenant"}},
        {"fields": {"tp_rank": 1, "tp_size": 2}},
        {"fields": {"pp_rank": 0, "pp_size": 2}},
    ],
)
def test_models_tenants_and_shards_never_meet(
    make_backend: Callable[..., CacheTierStorage], change: dict[str, dict[str, Any]]
) -> None:
    pool = mha_pool()
    fill(pool, 5)
    assert make_backend(pool).batch_set_v1(keys("f1"), slots([0])) == [True]
    other = make_backend(mha_pool(), change.get("extra"), **change.get("fields", {}))
    assert other.batch_exists(keys("f1")) == 0
    assert other.batch_get_v1(keys("f1"), slots([0])) == [False]


def test_mla_pages_are_shared_by_tp_ranks_and_written_by_one(
    make_backend: Callable[..., CacheTierStorage],
) -> None:
    rank1 = make_backend(mla_pool(), is_mla_model=True, tp_rank=1, tp_size=2)
    assert rank1.batch_set_v1(keys("g1"), slots([0])) == [True]
    assert rank1.batch_exists(keys("g1")) == 0  # rank 1 does not write MLA pages
    pool = mla_pool()
    fill(pool, 6)
    rank0 = make_backend(pool, is_mla_model=True, tp_rank=0, tp_size=2)
    assert rank0.batch_set_v1(keys("g1"), slots([2])) == [True]
    assert rank1.batch_get_v1(keys("g1"), slots([1])) == [True]


def test_batch_exists_counts_the_leading_run(
    make_backend: Callable[..., CacheTierStorage],
) -> None:
    backend = make_backend(mha_pool())
    backend.batch_set_v1(keys("h1", "h2", "h4"), slots([0, 1, 2]))
    assert backend.batch_exists(keys("h1", "h2", "h3", "h4")) == 2
    # Only the leading run is read: SGLang uses no page after a miss.
    assert backend.batch_get_v1(keys("h1", "h3", "h4"), slots([3, 4, 5])) == [True, False, False]


@pytest.mark.parametrize("tier", ["disk", "redis", "sidecar", "cpu"])
def test_any_tier_stack_behind_it(
    make_backend: Callable[..., CacheTierStorage],
    tmp_path: Path,
    redis_url: str,
    redis_prefix: str,
    monkeypatch: pytest.MonkeyPatch,
    tier: str,
) -> None:
    server = None
    if tier == "disk":
        extra: dict[str, Any] = {}
    elif tier == "redis":
        extra = {"disk_path": None, "redis_url": redis_url, "redis_key_prefix": redis_prefix}
    elif tier == "cpu":
        extra = {"disk_path": None, "cpu_bytes": 1 << 24}
    else:
        server = ThreadServer(test_config(tmp_path / "server")).start()
        extra = {"disk_path": None, "remote_url": server.url}
        monkeypatch.setenv("CACHETIER_REMOTE_TOKEN", TOKENS["alice"])
    try:
        pool = mha_pool()
        fill(pool, 7)
        want = page(pool, 1)
        backend = make_backend(pool, extra)
        assert backend.batch_set_v1(keys("i1"), slots([1])) == [True]
        backend.store.flush()
        pool.kv_buffer.zero_()
        assert backend.batch_get_v1(keys("i1"), slots([2])) == [True]
        assert torch.equal(page(pool, 2), want)
    finally:
        if server is not None:
            server.stop()


WRITE_THEN_EXIT = """
import sys, torch
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory
from tests.connectors.test_sglang_storage import fill, keys, mha_pool, slots, storage_config
pool = mha_pool("page_first")
fill(pool, 8)
backend = StorageBackendFactory.create_backend(
    "dynamic", storage_config({"cpu_bytes": 1 << 24, "disk_path": sys.argv[1]}), pool)
backend.register_mem_pool_host(pool)
print(all(backend.batch_set_v1(keys(*map(str, range(6))), slots(list(range(6))))))
backend.close()  # flushes the disk writes queued behind the CPU tier
"""
READ_AFTER_RESTART = """
import sys, torch
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory
from tests.connectors.test_sglang_storage import fill, keys, mha_pool, page, slots
from tests.connectors.test_sglang_storage import storage_config
want = mha_pool("page_first")
fill(want, 8)
pool = mha_pool("page_first")
backend = StorageBackendFactory.create_backend(
    "dynamic", storage_config({"cpu_bytes": 1 << 24, "disk_path": sys.argv[1]}), pool)
backend.register_mem_pool_host(pool)
names = keys(*map(str, range(6)))
found = backend.batch_exists(names)
got = backend.batch_get_v1(names, slots(list(range(6))))
same = all(torch.equal(page(pool, i), page(want, i)) for i in range(6))
print(found, sum(got), same)
"""


@pytest.mark.slow(reason="runs two fresh processes that each import SGLang and torch")
def test_pages_survive_a_restart(tmp_path: Path) -> None:
    folder = tmp_path / "kv"
    assert run_python(WRITE_THEN_EXIT, folder) == "True"
    assert run_python(READ_AFTER_RESTART, folder) == f"{PAGES} {PAGES} True"


def test_a_corrupt_record_is_a_miss(make_backend: Callable[..., CacheTierStorage]) -> None:
    pool = mha_pool()
    fill(pool, 9)
    backend = make_backend(pool)
    backend.batch_set_v1(keys("j1", "j2"), slots([0, 1]))
    second = backend._keys(keys("j2"))[0].hex()
    (record,) = Path(backend.config.store.disk_path).rglob(f"{second}.ctkv")
    raw = bytearray(record.read_bytes())
    raw[-5] ^= 0xFF  # one payload byte: the checksum no longer matches
    record.write_bytes(raw)
    pool.kv_buffer.zero_()
    assert backend.batch_get_v1(keys("j1", "j2"), slots([2, 3])) == [True, False]
    assert page(pool, 2).any() and not page(pool, 3).any(), "a corrupt page reached the pool"


def test_redis_down_is_a_miss(
    make_backend: Callable[..., CacheTierStorage], redis_prefix: str
) -> None:
    dead = "redis://127.0.0.1:1/0"  # nothing listens on port 1
    backend = make_backend(mha_pool(), {"disk_path": None, "redis_url": dead})
    assert backend.batch_exists(keys("k1")) == 0
    assert backend.batch_get_v1(keys("k1"), slots([0])) == [False]


def test_bad_calls_and_settings_are_refused(make_backend: Callable[..., CacheTierStorage]) -> None:
    backend = make_backend(mha_pool())
    with pytest.raises(ValueError, match="whole pages"):
        backend.batch_get_v1(keys("l1"), torch.arange(1, PAGE + 1))
    with pytest.raises(ValueError, match="pages of"):
        backend.batch_set_v1(keys("l1", "l2"), slots([0]))
    with pytest.raises(ValueError, match="past the pool"):
        backend.batch_get_v1(keys("l1"), slots([PAGES]))
    with pytest.raises(ValueError, match="elements"):
        backend.batch_set(keys("l1"), [torch.zeros(7, dtype=torch.float16)])
    with pytest.raises(ValueError, match="unknown --hicache-storage-backend-extra-config"):
        make_backend(mha_pool(), {"disk_pth": "/tmp"})
    with pytest.raises(ValueError, match="decode-context-parallel"):
        make_backend(
            mla_pool(), is_mla_model=True, dcp_size=2, dcp_rank=0, tp_size=2, logical_page_size=4
        )
    unified = mha_pool()
    unified.layout = "page_unified"
    with pytest.raises(ValueError, match="not one of"):
        make_backend(unified)


def test_secrets_come_from_the_environment_never_the_logged_json(
    make_backend: Callable[..., CacheTierStorage], monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(ValueError, match="CACHETIER_REMOTE_TOKEN") as refused:
        make_backend(mha_pool(), {"remote_url": "http://127.0.0.1:9", "remote_token": "s3cret"})
    assert "s3cret" not in str(refused.value)
    with pytest.raises(ValueError, match="CACHETIER_REDIS_URL") as refused:
        make_backend(mha_pool(), {"redis_url": "redis://:hunter2@127.0.0.1:6379/0"})
    assert "hunter2" not in str(refused.value)
    monkeypatch.setenv("CACHETIER_REMOTE_TOKEN", "from-the-env-0123456789")
    backend = make_backend(mha_pool(), {"remote_url": "http://127.0.0.1:9"})
    assert backend.config.store.remote_token == "from-the-env-0123456789"
    assert "from-the-env" not in repr(backend.config)


def test_model_fingerprint_comes_from_sglangs_model_folder(
    make_backend: Callable[..., CacheTierStorage], tiny_model_dir: Path
) -> None:
    extra = {"model_fingerprint": None}
    named = make_backend(mha_pool(), extra, model_name=str(tiny_model_dir))
    assert named.model_fingerprint and named.model_fingerprint != FINGERPRINT
    with pytest.raises(ValueError, match="model_fingerprint"):
        make_backend(mha_pool(), extra, model_name=os.fspath(tiny_model_dir / "absent"))


def test_a_bad_config_stops_sglang_loudly(
    make_backend: Callable[..., CacheTierStorage], caplog: pytest.LogCaptureFixture
) -> None:
    # SGLang's factory re-raises a dynamic backend's error, and its scheduler exits on it.
    with caplog.at_level(logging.ERROR), pytest.raises(ValueError, match="disk_pth"):
        make_backend(mha_pool(), {"disk_pth": "/tmp/kv"})
    ours = [r for r in caplog.records if r.name == "cachetier.connectors.config"]
    assert len(ours) == 1 and ours[0].levelno == logging.ERROR
    assert "SGLang is not started" in ours[0].getMessage()
    assert "disk_pth" in ours[0].getMessage()


def test_an_unreachable_redis_is_said_as_sglang_starts(
    make_backend: Callable[..., CacheTierStorage], caplog: pytest.LogCaptureFixture
) -> None:
    # SGLang starts (a tier that is down answers misses), and says so once, at ERROR.
    with refusing_port() as port, caplog.at_level(logging.WARNING, logger="cachetier"):
        backend = make_backend(mha_pool(), {"redis_url": f"redis://127.0.0.1:{port}/0"})
        errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert backend.running
    assert len(errors) == 1 and f"redis://127.0.0.1:{port}/0 cannot be reached" in errors[0]


def test_fail_on_start_error_false_serves_without_cachetier(
    make_backend: Callable[..., CacheTierStorage],
    caplog: pytest.LogCaptureFixture,
    tmp_path: Path,
) -> None:
    pool = mha_pool()
    fill(pool, 5)
    extra = {"disk_pth": str(tmp_path / "typo"), "fail_on_start_error": False}
    with caplog.at_level(logging.ERROR):
        backend = make_backend(pool, extra)
    ours = [r for r in caplog.records if r.name == "cachetier.connectors.config"]
    assert [r.levelno for r in ours] == [logging.ERROR]
    assert "SGLang is running WITHOUT cachetier" in ours[0].getMessage()
    assert not backend.running
    # Writes are taken and dropped (a refusal would make SGLang warn on each), reads miss.
    assert backend.batch_set_v1(keys("w1", "w2"), slots([0, 1])) == [True, True]
    assert backend.batch_set(keys("w3"), [page(pool, 2)])
    assert backend.batch_exists(keys("w1", "w2")) == 0
    assert backend.batch_get_v1(keys("w1"), slots([3])) == [False]
    assert backend.batch_get(keys("w3"), [page(pool, 4)]) == [None]
    assert not (tmp_path / "kv").exists() and not (tmp_path / "typo").exists()


def test_a_corrupt_page_is_logged_once_and_no_longer_counted(
    make_backend: Callable[..., CacheTierStorage], caplog: pytest.LogCaptureFixture
) -> None:
    pool = mha_pool()
    fill(pool, 11)
    backend = make_backend(pool)
    names = keys("c1", "c2", "c3")
    backend.batch_set_v1(names, slots([0, 1, 2]))
    for name in names[:2]:
        record_key = backend._keys([name])[0].hex()
        (record,) = Path(backend.config.store.disk_path).rglob(f"{record_key}.ctkv")
        raw = bytearray(record.read_bytes())
        raw[-5] ^= 0xFF  # one payload byte: the checksum no longer matches
        record.write_bytes(raw)
    assert backend.batch_exists(names) == 3  # not known to be corrupt until a read checks it
    with caplog.at_level(logging.WARNING):
        assert backend.batch_get_v1(names[:1], slots([3])) == [False]
        assert backend.batch_get_v1(names[1:2], slots([4])) == [False]  # within the interval
    lines = [r.getMessage() for r in caplog.records if "is corrupt" in r.getMessage()]
    assert len(lines) == 1, lines
    assert "cachetier disk tier" in lines[0]
    assert backend._keys(names[:1])[0].hex()[:16] in lines[0]
    assert backend.batch_exists(names) == 0
    assert backend.batch_exists(names[2:]) == 1
