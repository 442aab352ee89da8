"""The first layer's K and V of any token, from its id and position alone: a check of a restored
record cheap enough to run on every restore.

In a Llama-family model the first layer's K and V of a token depend on nothing but the token and
its position: its embedding row, the first RMSNorm, the K and V projections (and their biases,
Qwen2) and the rotary embedding of K. So a record's claim to hold the KV of its tokens can be
checked in part without the prefill: recompute the first layer's K and V of a few of its tokens
and compare them with the record's (``RecordCheck``). Another prompt's KV, K and V swapped, heads
permuted or a first layer zeroed all move them by about their own size; deeper layers are not
seen here (``cachetier.guard.sampling`` verifies those by recomputing whole requests).

The weights come from the engine's own tensors (``FirstLayer.from_tensors``) or, for a
connector that has none, straight from the model folder's safetensors, only these few
(``FirstLayer.from_folder``).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cachetier.primitives.rope import rope_settings

if TYPE_CHECKING:  # torch is imported where it is used: the sidecar installs without it
    import torch

EMBED, NORM = "model.embed_tokens.weight", "model.layers.0.input_layernorm.weight"
PROJ = "model.layers.0.self_attn.{}_proj.{}"


def rope_inv_freq(head_dim: int, theta: float, scaling: Mapping[str, Any] | None) -> torch.Tensor:
    """The rotary embedding's inverse frequencies ``[head_dim / 2]`` (float32), with linear or
    llama3 scaling as transformers applies them.

    Raises:
        ValueError: another kind of scaling.
    """
    import torch

    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling is None:
        return inv_freq
    kind = scaling.get("rope_type")
    if kind == "linear":
        return inv_freq / float(scaling["factor"])
    if kind == "llama3":
        factor = float(scaling["factor"])
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old_len = float(scaling["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        mid = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        return torch.where(medium, mid, scaled)
    raise ValueError(f"rope_type {kind!r} is not supported (default, linear and llama3 are)")


LLAMA_FAMILY = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
}
"""The model types whose first layer is what ``FirstLayer`` computes (by their architecture
names too, for a config that gives only those)."""


def check_family(config: Mapping[str, Any]) -> None:
    """Raise ``ValueError`` for a model of another family than ``LLAMA_FAMILY``: Gemma scales
    its embeddings and norms by ``1 + weight``, Qwen3 norms its keys, and so on, so this check
    would call every honest record of theirs forged. A config naming neither a model type nor
    an architecture is let through (the engine's own, built by its loader, checks those)."""
    model_type = config.get("model_type")
    architectures = config.get("architectures") or []
    known = model_type in LLAMA_FAMILY or any(a in LLAMA_FAMILY.values() for a in architectures)
    if (model_type is not None or architectures) and not known:
        name = model_type if model_type is not None else architectures[0]
        raise ValueError(
            f"the first-layer record check follows Llama-family models "
            f"({', '.join(LLAMA_FAMILY)}), not {name!r}, whose first layer differs; turn "
            "record_check off to serve this model without it"
        )


# The most memory the table of each token's K (before RoPE) and V may take: a vocabulary whose
# table is larger (an 8B model's is about 1 GiB) computes every check's tokens afresh.
TABLE_BYTES = 256 << 20


class _Table:
    """Each token's first-layer K (before RoPE) and V, filled as tokens are first checked:
    natural text reuses its tokens, so a long prompt's check computes only the few it has not
    seen (a restore of 4,096 tokens checks a few hundred). Filling races are benign: two
    threads write the same values."""

    def __init__(self, vocab: int, width: int) -> None:
        import torch

        self.rows = torch.empty(vocab, width)
        self.have = torch.zeros(vocab, dtype=torch.bool)


@dataclass(frozen=True, slots=True)
class FirstLayer:
    """What the first layer's K and V are computed from, in float32 (the embedding in its own
    dtype: only the rows asked for are widened).

    Args:
        embed: ``[vocab, hidden]``.
        norm: the first RMSNorm's weight ``[hidden]``.
        kv_proj: the K then V projections ``[2 * kv_heads * head_dim, hidden]``.
        kv_bias: their biases ``[2 * kv_heads * head_dim]``, ``None`` without.
        eps: the RMSNorm's epsilon.
        inv_freq: the rotary embedding's inverse frequencies (``rope_inv_freq``).
        num_kv_heads: KV heads.
        head_dim: elements per head.
    """

    embed: torch.Tensor
    norm: torch.Tensor
    kv_proj: torch.Tensor
    kv_bias: torch.Tensor | None
    eps: float
    inv_freq: torch.Tensor
    num_kv_heads: int
    head_dim: int
    _table: list[_Table | None] = field(default_factory=lambda: [None], repr=False, compare=False)

    @classmethod
    def from_tensors(
        cls, config: Mapping[str, Any], tensor: Callable[[str], torch.Tensor | None]
    ) -> FirstLayer:
        """From a model's ``config.json`` and a lookup of its tensors by Hugging Face name.

        Raises:
            ValueError: a tensor it needs is missing, or a setting it cannot follow.
        """
        import torch

        def need(name: str) -> torch.Tensor:
            found = tensor(name)
            if found is None:
                raise ValueError(f"the model has no weight {name!r}")
            return found.detach().to("cpu")

        check_family(config)
        heads = int(config["num_attention_heads"])
        kv_heads = int(config.get("num_key_value_heads") or heads)
        head_dim = int(config.get("head_dim") or int(config["hidden_size"]) // heads)
        proj = torch.cat([need(PROJ.format(n, "weight")).float() for n in "kv"])
        bias = None
        if tensor(PROJ.format("k", "bias")) is not None:
            bias = torch.cat([need(PROJ.format(n, "bias")).float() for n in "kv"])
        return cls(
            embed=need(EMBED),
            norm=need(NORM).float(),
            kv_proj=proj.contiguous(),
            kv_bias=bias,
            eps=float(config.get("rms_norm_eps", 1e-6)),
            inv_freq=rope_inv_freq(head_dim, *rope_settings(config)),
            num_kv_heads=kv_heads,
            head_dim=head_dim,
        )

    @classmethod
    def from_folder(cls, folder: str | Path) -> FirstLayer:
        """From a model folder: its ``config.json`` and, of its safetensors, only the tensors
        the first layer's K and V need (a few megabytes and the embedding).

        Raises:
            ValueError: the folder has no config, no safetensors, or lacks a tensor.
        """
        from safetensors import safe_open

        folder = Path(folder)
        try:
            config = json.loads((folder / "config.json").read_text())
        except (OSError, ValueError) as exc:
            raise ValueError(f"{folder} has no readable config.json: {exc}") from None
        where: dict[str, Path] = {}
        for path in sorted(folder.glob("*.safetensors")):
            with safe_open(str(path), framework="pt") as f:
                where.update(dict.fromkeys(f.keys(), path))
        if not where:
            raise ValueError(f"{folder} has no *.safetensors file")

        def tensor(name: str) -> torch.Tensor | None:
            path = where.get(name)
            if path is None:
                return None
            with safe_open(str(path), framework="pt") as f:
                return f.get_tensor(name)

        return cls.from_tensors(config, tensor)

    @property
    def vocab_size(self) -> int:
        return int(self.embed.shape[0])

    def kv(self, token_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The first layer's K (after RoPE) and V of ``token_ids`` at ``positions``.

        Args:
            token_ids: ``[n]`` int64, each below ``vocab_size``.
            positions: ``[n]`` int64.

        Returns:
            ``[2, n, num_kv_heads, head_dim]`` float32: K then V.
        """
        import torch

        kv = self._unrotated(token_ids)
        n, hk, d = token_ids.numel(), self.num_kv_heads, self.head_dim
        k, v = kv[:, : hk * d].view(n, hk, d), kv[:, hk * d :].view(n, hk, d)
        angles = positions.float()[:, None] * self.inv_freq[None, :]  # [n, d/2]
        cos, sin = angles.cos()[:, None, :], angles.sin()[:, None, :]
        half = d // 2
        k1, k2 = k[..., :half], k[..., half:]
        rotated = torch.cat([k1 * cos - k2 * sin, k2 * cos + k1 * sin], dim=-1)
        return torch.stack([rotated, v])

    def _unrotated(self, token_ids: torch.Tensor) -> torch.Tensor:
        """``[n, 2 * kv_heads * head_dim]``: K (before RoPE) then V of each token, from the
        table where it fits (``TABLE_BYTES``), filling the rows it lacks."""
        table = self._table[0]
        width = self.kv_proj.shape[0]
        if table is None and self.vocab_size * width * 4 <= TABLE_BYTES:
            table = self._table[0] = _Table(self.vocab_size, width)
        if table is None:
            return self._computed(token_ids)
        missing = token_ids[~table.have[token_ids]].unique()
        if missing.numel():
            table.rows[missing] = self._computed(missing)
            table.have[missing] = True
        return table.rows[token_ids]

    def _computed(self, token_ids: torch.Tensor) -> torch.Tensor:
        import torch

        x = self.embed[token_ids].float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.norm
        return torch.nn.functional.linear(x, self.kv_proj, self.kv_bias)
