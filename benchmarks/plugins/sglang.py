"""cachetier behind SGLang's HiCache, for ``benchmarks.plugins``: restart and get speed against
SGLang's own ``HiCacheFile`` backend, both made by SGLang's ``StorageBackendFactory``.

Pages: SmolLM2-135M's KV (30 layers, 3 KV heads, 64 dims, fp16), 64 tokens a page (1.4 MiB),
random-normal, in SGLang's default host layout (``page_first``). The host pools are
``tests.connectors.sglang_pool``'s: SGLang's own page methods (that module says why SGLang's
pool classes cannot be imported here).

A timed get is what SGLang's prefetch does for one batch of pages (``cache_controller``):

- ours: ``batch_get_v1(keys, host_indices)`` (``interface_v1``: the zero-copy path);
- HiCacheFile: ``batch_get(keys, dummy pages)`` then ``set_from_flat_data_page`` per page (its
  only path: HiCacheFile has no v1 API);
- ours_generic: ours through that same generic path.

Our tier is a disk tier alone (no CPU tier), so both sides read files of the same folder's
disk from the page cache, which the writes left warm for both. Each side reads into its own
pool, checked page for page against the source after its clock stops.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

from benchmarks.support.timing import interleaved_medians, settle
from tests.children import run_python
from tests.connectors.sglang_pool import make_mha_pool
from tests.connectors.test_sglang_storage import storage_config

SHAPE = dict(page_size=64, num_layers=30, num_heads=3, head_dim=64)
LAYOUT = "page_first"


def make_pool(num_pages: int, seed: int | None = None) -> Any:
    pool = make_mha_pool(LAYOUT, num_pages=num_pages, dtype=torch.float16, **SHAPE)
    if seed is not None:
        gen = torch.Generator().manual_seed(seed)
        pool.kv_buffer.copy_(torch.randn(pool.kv_buffer.shape, generator=gen))
    return pool


def page_keys(num_pages: int) -> list[str]:
    return [f"{i:064x}" for i in range(1, num_pages + 1)]


def host_indices(num_pages: int) -> torch.Tensor:
    return torch.arange(num_pages * SHAPE["page_size"])


def ours(pool: Any, folder: Path) -> HiCacheStorage:
    extra = {"cpu_bytes": 0, "disk_path": str(folder), "fsync": False}
    backend = StorageBackendFactory.create_backend("dynamic", storage_config(extra), pool)
    backend.register_mem_pool_host(pool)
    return backend


def hicache_file(pool: Any, folder: Path) -> HiCacheStorage:
    config = storage_config({"file_storage_path": str(folder)})
    backend = StorageBackendFactory.create_backend("file", config, pool)
    backend.register_mem_pool_host(pool)
    return backend


def generic_get(backend: HiCacheStorage, pool: Any, keys: list[str]) -> int:
    """SGLang's ``_generic_page_get`` for one batch: pages found, in order."""
    pages = backend.batch_get(keys, [pool.get_dummy_flat_data_page() for _ in keys])
    found = 0
    for i, data in enumerate(pages):
        if data is None:
            break
        pool.set_from_flat_data_page(i * SHAPE["page_size"], data)
        found += 1
    return found


def same_pages(pool: Any, want: Any) -> bool:
    return bool(torch.equal(pool.kv_buffer, want.kv_buffer))


def roundtrip_and_speed(num_pages: int, repeats: int, work: Path) -> dict[str, Any]:
    source = make_pool(num_pages, seed=1)
    keys, slots = page_keys(num_pages), host_indices(num_pages)
    ours_backend = ours(source, work / "ours")
    file_backend = hicache_file(source, work / "hicache-file")
    assert all(ours_backend.batch_set_v1(keys, slots)), "ours refused a page"
    assert file_backend.batch_set(keys, [source.get_data_page(int(i)) for i in slots[::64]])
    mine, theirs, generic = make_pool(num_pages), make_pool(num_pages), make_pool(num_pages)
    ours_into = ours(mine, work / "ours")
    ours_generic = ours(generic, work / "ours")
    file_into = hicache_file(theirs, work / "hicache-file")
    roundtrip = all(ours_into.batch_get_v1(keys, slots)) and same_pages(mine, source)
    settle()
    medians = interleaved_medians(
        {
            "ours": lambda: ours_into.batch_get_v1(keys, slots),
            "hicache_file": lambda: generic_get(file_into, theirs, keys),
            "ours_generic": lambda: generic_get(ours_generic, generic, keys),
        },
        repeats,
    )
    for pool, who in ((mine, "ours"), (theirs, "HiCacheFile"), (generic, "ours generic")):
        if not same_pages(pool, source):
            raise AssertionError(f"{who}: the pages read are not the pages stored")
    for backend in (ours_backend, ours_into, ours_generic):
        backend.close()
    return {
        "sglang_pages": num_pages,
        "sglang_page_bytes": source.kv_buffer.nbytes // num_pages,
        "sglang_roundtrip_identical": roundtrip,
        "sglang_get_vs_hicache_file": medians["hicache_file"] / medians["ours"],
        "sglang_generic_get_vs_hicache_file": medians["hicache_file"] / medians["ours_generic"],
        "sglang_get_ms": {k: 1e3 * v for k, v in medians.items()},
    }


WRITE = """
import sys
from pathlib import Path
from benchmarks.plugins.sglang import host_indices, make_pool, ours, page_keys
n = int(sys.argv[2])
pool = make_pool(n, seed=2)
backend = ours(pool, Path(sys.argv[1]))
print(sum(backend.batch_set_v1(page_keys(n), host_indices(n))))
backend.close()
"""
READ = """
import sys
from pathlib import Path
from benchmarks.plugins.sglang import host_indices, make_pool, ours, page_keys, same_pages
n = int(sys.argv[2])
pool = make_pool(n)
backend = ours(pool, Path(sys.argv[1]))
found = backend.batch_exists(page_keys(n))
read = sum(backend.batch_get_v1(page_keys(n), host_indices(n)))
print(found if read == found and same_pages(pool, make_pool(n, seed=2)) else -1)
"""


def restart(num_pages: int, work: Path) -> dict[str, Any]:
    """Pages stored by one process, found (and byte-identical) by a fresh one."""
    folder = work / "restart"
    stored = int(run_python(WRITE, folder, num_pages, timeout=600))
    found = int(run_python(READ, folder, num_pages, timeout=600))
    return {"sglang_stored_before_restart": stored, "sglang_found_after_restart": found}


def measure(work: Path | None = None, num_pages: int = 64, repeats: int = 15) -> dict[str, Any]:
    """Every SGLang figure of ``benchmarks.plugins``."""
    with tempfile.TemporaryDirectory(dir=work) as tmp:
        out = roundtrip_and_speed(num_pages, repeats, Path(tmp))
        out.update(restart(num_pages, Path(tmp)))
    return out
