"""KV-cache kernels for the paged engine: plain-torch references and Triton kernels.

The pool layout is ``[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]`` (see
``cachetier.kernels.pool_shape``). Every public function takes ``backend="auto" | "torch" |
"triton"``; ``"auto"`` runs Triton on GPU tensors and plain torch otherwise. Importing this package
never imports Triton: the Triton modules load on the first call that needs them.
"""

from cachetier.kernels.backend import BACKENDS, resolve_backend
from cachetier.kernels.cache_ops import (
    gather_blocks,
    gather_blocks_ref,
    scatter_blocks,
    scatter_blocks_ref,
    store_kvcache,
    store_kvcache_ref,
)
from cachetier.kernels.paged_attention import paged_attention_decode, paged_attention_decode_ref
from cachetier.kernels.pool_shape import DecodeInputs, PoolShape
from cachetier.kernels.torch_paged_attention import common_prefix_blocks, merge_attention

__all__ = [
    "BACKENDS",
    "DecodeInputs",
    "PoolShape",
    "common_prefix_blocks",
    "gather_blocks",
    "gather_blocks_ref",
    "merge_attention",
    "paged_attention_decode",
    "paged_attention_decode_ref",
    "resolve_backend",
    "scatter_blocks",
    "scatter_blocks_ref",
    "store_kvcache",
    "store_kvcache_ref",
]
