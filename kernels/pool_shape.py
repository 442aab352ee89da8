"""``PoolShape``, the sizes of the paged KV pool tensor, and the checks every kernel wrapper runs
on its inputs. (``cachetier.primitives.keys.KVLayout`` is another thing: how one stored block is
laid out.)

The pool is block-major so that one block (all layers, K and V) is one contiguous run of
memory, and offloading or restoring a block is a single whole-block copy:

    kv_cache: [num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]
              (index 0 of dim 2 is K, index 1 is V)

The checks are cheap (shape and dtype reads plus one min/max per index tensor) so the wrappers
can always run them; they raise ``ValueError`` with a message that says what to change.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

KV_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
INDEX_DTYPES = (torch.int32, torch.int64)


@dataclass(frozen=True, slots=True)
class PoolShape:
    """The sizes of a paged KV pool tensor, read from its shape (``from_cache`` checks it)."""

    num_blocks: int
    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int

    @property
    def block_numel(self) -> int:
        """Elements in one block across all layers, K and V."""
        return self.num_layers * 2 * self.block_size * self.num_kv_heads * self.head_dim

    @property
    def num_slots(self) -> int:
        """Token slots in the pool; a slot is ``block_id * block_size + offset``."""
        return self.num_blocks * self.block_size

    @classmethod
    def from_cache(cls, kv_cache: torch.Tensor) -> PoolShape:
        """Checks that ``kv_cache`` has the pool layout and returns its sizes.

        Args:
            kv_cache: ``[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]``,
                contiguous, float32/float16/bfloat16.

        Returns:
            The sizes of ``kv_cache``.
        """
        check_tensor("kv_cache", kv_cache, ndim=6, dtypes=KV_DTYPES)
        if kv_cache.shape[2] != 2:
            raise ValueError(
                "kv_cache dim 2 must have size 2 (K, V); expected layout [num_blocks, "
                f"num_layers, 2, block_size, num_kv_heads, head_dim], got {tuple(kv_cache.shape)}"
            )
        if not kv_cache.is_contiguous():
            # Whole-block copies treat a block as one flat row, which needs a contiguous pool.
            raise ValueError("kv_cache must be contiguous; allocate the pool with torch.empty")
        num_blocks, num_layers, _, block_size, num_kv_heads, head_dim = kv_cache.shape
        if min(num_layers, block_size, num_kv_heads, head_dim) == 0:
            raise ValueError(f"kv_cache has an empty dimension: {tuple(kv_cache.shape)}")
        return cls(num_blocks, num_layers, block_size, num_kv_heads, head_dim)

    def check_layer(self, layer: int) -> None:
        """Raises ``ValueError`` unless ``0 <= layer < num_layers``."""
        if isinstance(layer, bool) or not isinstance(layer, int):
            raise TypeError(f"layer must be an int, got {type(layer).__name__}")
        if not 0 <= layer < self.num_layers:
            raise ValueError(f"layer must be in [0, {self.num_layers}), got {layer}")


@dataclass(frozen=True, slots=True)
class DecodeInputs:
    """One decode-attention step's inputs, as every path (reference, torch, Triton) takes them.

    Args:
        query: ``[batch, num_heads, head_dim]``, the pool's dtype.
        kv_cache: the pool, ``[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]``.
        layer: which layer's K/V to read.
        block_tables: ``[batch, max_blocks_per_seq]`` int32/int64 pool block ids.
        context_lens: ``[batch]`` int32/int64 cached tokens per sequence.
        scale: softmax scale.
    """

    query: torch.Tensor
    kv_cache: torch.Tensor
    layer: int
    block_tables: torch.Tensor
    context_lens: torch.Tensor
    scale: float

    def unpack(
        self,
    ) -> tuple[torch.Tensor, torch.Tensor, int, torch.Tensor, torch.Tensor, float]:
        """The six fields in order, for ``query, kv_cache, ... = inputs.unpack()``."""
        return (
            self.query,
            self.kv_cache,
            self.layer,
            self.block_tables,
            self.context_lens,
            self.scale,
        )


def check_tensor(
    name: str,
    tensor: object,
    *,
    ndim: int,
    dtypes: tuple[torch.dtype, ...],
) -> None:
    """Raises ``TypeError``/``ValueError`` unless ``tensor`` is a tensor of this rank and dtype."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.ndim != ndim:
        raise ValueError(f"{name} must have {ndim} dims, got shape {tuple(tensor.shape)}")
    if tensor.dtype not in dtypes:
        names = ", ".join(str(d).removeprefix("torch.") for d in dtypes)
        raise ValueError(f"{name} dtype must be one of ({names}), got {tensor.dtype}")


def check_same_dtype(name: str, tensor: torch.Tensor, kv_cache: torch.Tensor) -> None:
    """Raises ``ValueError`` unless ``tensor`` has the pool's dtype (no silent casts)."""
    if tensor.dtype != kv_cache.dtype:
        raise ValueError(
            f"{name} dtype {tensor.dtype} does not match kv_cache dtype {kv_cache.dtype}"
        )


def check_index_range(name: str, index: torch.Tensor, low: int, high: int) -> None:
    """Raises ``ValueError`` unless every entry of ``index`` lies in ``[low, high)``."""
    if index.numel() == 0:
        return
    lo, hi = torch.aminmax(index)
    lo_i, hi_i = int(lo), int(hi)
    if lo_i < low or hi_i >= high:
        raise ValueError(
            f"{name} entries must lie in [{low}, {high}), got min {lo_i} and max {hi_i}"
        )
