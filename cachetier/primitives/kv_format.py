"""The one KV block format every engine stores and restores: cachetier's canonical block.

A record's payload is one block of tokens, every attention layer, in this order::

    attention with K and V (MHA, GQA, MQA):  [num_layers, 2, block_size, num_kv_heads, head_dim]
                                              (index 0 of dim 1 is K, index 1 is V)
    MLA (one latent per token, DeepSeek):     [num_layers, 1, block_size, 1, latent_dim]

C-contiguous, in the KV dtype, keys after RoPE (what every engine caches). It is the order our
engine's pool keeps a block in, so our engine saves and restores with one whole-block copy;
every other engine (vLLM's CPU and CUDA backends, HF ``DynamicCache``, SGLang's host pools)
converts between its paged memory and this order inside the copy
(``cachetier.kernels.paged_layouts``), never through a second full-size buffer.

An fp8 block also carries its scales in the record's ``aux``: ``[num_layers, 2]`` little-endian
float32 (K then V per layer; ``[num_layers, 1]`` for MLA), an element being ``fp8 * scale``. An
engine with one scale per layer (vLLM) writes that scale for every block and re-scales a block
whose scales differ from its own on restore.

The namespace is the model fingerprint plus this format (dtype, record size in tokens, layer
and head counts, the arrangement name): the same prompt on the same model and dtype gives the
same keys and the same bytes in every engine, so a block saved by one restores into another.

A record holds ``record_tokens`` tokens, one setting for the whole deployment, never the
engine's block size: an engine whose block is ``n`` times that size reads and writes ``n``
records per block (``cachetier.kernels.records`` splits and joins them), so HF at 16, vLLM at 16 or
32 and our engine share one cache. Engines with other record sizes (a deployment that changed the
setting) never share keys, since the record size is in the namespace: a clean miss, never a
re-chunked record.
"""

from __future__ import annotations

CANONICAL_ARRANGEMENT = "layer,kv,token,head,dim"
"""Arrangement name of the canonical K/V block (``KVLayout``'s default)."""

MLA_ARRANGEMENT = "layer,latent,token,head,dim"
"""Arrangement name of the canonical MLA block: one latent vector per token, ``num_kv_heads``
1, ``head_dim`` the latent size (``kv_lora_rank + rope dim`` in DeepSeek models)."""

NATIVE_PREFIX = "native:"
"""Prefix of a non-portable arrangement: an engine layout cachetier cannot read, stored whole
as one plane per layer (``[num_layers, 1, block_size, num_kv_heads, C]``, C the cell size) and
restored only by the same engine on the same layout. Its name keeps it out of every canonical
namespace."""

DEFAULT_RECORD_TOKENS = 16
"""Tokens per record unless a deployment says otherwise: the block size of vLLM on GPUs and of
HF and our engine by default, and a divisor of the other common sizes (32, 64, 128, 256).
Smaller records share more (a block size of 8 would need 8) but pay a record's fixed costs
(header, checksum, one file or key each) more often: ``benchmarks/portable.py`` measures
that per-record cost."""

SCALE_DTYPE = "<f4"
"""numpy dtype of the fp8 scales in a record's ``aux``."""


def planes(arrangement: str) -> int:
    """How many tensors per layer a block of this arrangement holds: 2 (K, V) or 1 (MLA).

    Args:
        arrangement: a ``KVLayout.arrangement``.

    Returns:
        1 for ``MLA_ARRANGEMENT`` and native arrangements, 2 for the canonical K/V one.
    """
    return 1 if arrangement == MLA_ARRANGEMENT or arrangement.startswith(NATIVE_PREFIX) else 2


def canonical_shape(
    arrangement: str, num_layers: int, block_size: int, num_kv_heads: int, head_dim: int
) -> tuple[int, int, int, int, int]:
    """The shape of one canonical payload (see the module docstring).

    Args:
        arrangement: ``CANONICAL_ARRANGEMENT``, ``MLA_ARRANGEMENT`` or a native name.
        num_layers: attention layers.
        block_size: tokens per block.
        num_kv_heads: KV heads per layer (1 for MLA).
        head_dim: elements per head (the latent size for MLA).

    Returns:
        ``(num_layers, planes, block_size, num_kv_heads, head_dim)``.
    """
    native = arrangement.startswith(NATIVE_PREFIX) and len(arrangement) > len(NATIVE_PREFIX)
    if arrangement not in (CANONICAL_ARRANGEMENT, MLA_ARRANGEMENT) and not native:
        raise ValueError(
            f"arrangement {arrangement!r} is not canonical; blocks are stored as "
            f"{CANONICAL_ARRANGEMENT!r}, {MLA_ARRANGEMENT!r} or '{NATIVE_PREFIX}<engine layout>'"
        )
    return (num_layers, planes(arrangement), block_size, num_kv_heads, head_dim)
