"""``ModelSpec``: the numbers of a model folder's config.json that the engine's math depends on.

It reads the config alone (no weights, no torch), so the pool can be sized and a folder refused
before anything large is loaded.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cachetier.primitives.rope import rope_settings

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
_ARCHITECTURE_OF_MODEL_TYPE = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
}


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _is_positive_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and value > 0


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """What the engine must know of a Llama-family model to run it and to size its KV cache.

    ``rope_scaling`` is None for plain RoPE, else the scaling dict (with ``rope_type``).
    ``attention_bias`` is True for Qwen2 (q/k/v projections carry a bias). ``sliding_window``
    is the config's window (None where the model has none, as transformers sets it);
    ``layer_windows`` says which layers use it: one entry a layer, None for full attention, else
    ``sliding_window`` (a query at position p sees keys p - window + 1 .. p). A model whose
    every layer attends fully has ``()`` (entries all None are stored so), so specs compare
    equal however they were built.
    """

    architecture: str
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    attention_bias: bool = False
    sliding_window: int | None = None
    layer_windows: tuple[int | None, ...] = ()

    def __post_init__(self) -> None:
        _check_architecture(self.architecture)
        for name in (
            "num_layers",
            "hidden_size",
            "intermediate_size",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "vocab_size",
            "max_position_embeddings",
        ):
            if not _is_count(getattr(self, name)):
                raise ValueError(f"{name} must be a positive int, got {getattr(self, name)!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads "
                f"({self.num_kv_heads}) for grouped-query attention"
            )
        for name in ("rms_norm_eps", "rope_theta"):
            if not _is_positive_number(getattr(self, name)):
                raise ValueError(f"{name} must be a positive number, got {getattr(self, name)!r}")
        if self.rope_scaling is not None and not isinstance(self.rope_scaling, dict):
            raise TypeError(f"rope_scaling must be a dict or None, got {self.rope_scaling!r}")
        if not isinstance(self.eos_token_ids, tuple):
            raise TypeError(f"eos_token_ids must be a tuple, got {self.eos_token_ids!r}")
        bos = () if self.bos_token_id is None else (self.bos_token_id,)
        for token_id in bos + self.eos_token_ids:
            if not isinstance(token_id, int) or not 0 <= token_id < self.vocab_size:
                raise ValueError(
                    f"bos/eos token id {token_id!r} must be an int below vocab_size "
                    f"({self.vocab_size})"
                )
        if self.sliding_window is not None and not _is_count(self.sliding_window):
            raise ValueError(
                f"sliding_window must be None or a positive int, got {self.sliding_window!r}"
            )
        _check_layer_windows(self.layer_windows, self.num_layers, self.sliding_window)
        if all(window is None for window in self.layer_windows):
            object.__setattr__(self, "layer_windows", ())  # frozen: the one canonical form

    def window_of(self, layer: int) -> int | None:
        """Layer ``layer``'s attention window in tokens, None for full attention."""
        return self.layer_windows[layer] if self.layer_windows else None

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> ModelSpec:
        """Read a spec from a parsed config.json (the old ``rope_theta`` form or v5's
        ``rope_parameters``)."""
        architecture = _architecture(config)

        def need(key: str) -> Any:
            if config.get(key) is None:
                raise ValueError(f"config.json lacks {key!r}, which a {architecture} needs")
            return config[key]

        if config.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {config['hidden_act']!r} is not supported; use silu")
        if config.get("mlp_bias"):
            raise ValueError("mlp_bias=true is not supported: the engine's MLP has no bias")
        num_heads = need("num_attention_heads")
        rope_theta, rope_scaling = rope_settings(config)
        eos = config.get("eos_token_id")
        eos_token_ids = () if eos is None else tuple(eos) if isinstance(eos, list) else (eos,)
        window = _sliding_window(architecture, config)
        return cls(
            architecture=architecture,
            num_layers=need("num_hidden_layers"),
            hidden_size=need("hidden_size"),
            intermediate_size=need("intermediate_size"),
            num_heads=num_heads,
            num_kv_heads=config.get("num_key_value_heads") or num_heads,
            head_dim=config.get("head_dim") or need("hidden_size") // num_heads,
            vocab_size=need("vocab_size"),
            rms_norm_eps=need("rms_norm_eps"),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=need("max_position_embeddings"),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            bos_token_id=config.get("bos_token_id"),
            eos_token_ids=eos_token_ids,
            attention_bias=architecture == "Qwen2ForCausalLM" or bool(config.get("attention_bias")),
            sliding_window=window,
            layer_windows=_layer_windows(architecture, config, window, need("num_hidden_layers")),
        )

    @classmethod
    def from_folder(cls, path: str | Path) -> ModelSpec:
        """Read the spec of a Hugging Face model folder (its config.json)."""
        config_path = Path(path) / "config.json"
        if not config_path.is_file():
            raise ValueError(f"{path} has no config.json: pass a Hugging Face model folder")
        return cls.from_config(json.loads(config_path.read_text(encoding="utf-8")))


def _architecture(config: Mapping[str, Any]) -> str:
    architectures = config.get("architectures") or []
    if architectures:
        architecture = architectures[0]
    else:
        model_type = config.get("model_type")
        architecture = _ARCHITECTURE_OF_MODEL_TYPE.get(model_type, f"model_type={model_type!r}")
    _check_architecture(architecture)
    return architecture


def _check_architecture(architecture: object) -> None:
    if architecture not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"architecture {architecture!r} is not Llama-family; the engine runs "
            f"{', '.join(SUPPORTED_ARCHITECTURES)} (pass a folder of one of those)"
        )


def _check_layer_windows(windows: object, num_layers: int, sliding_window: int | None) -> None:
    if not isinstance(windows, tuple):
        raise TypeError(f"layer_windows must be a tuple, got {windows!r}")
    if windows and len(windows) != num_layers:
        raise ValueError(
            f"layer_windows has {len(windows)} entries; give one per layer ({num_layers}) or none"
        )
    for window in windows:
        if window is not None and window != sliding_window:
            raise ValueError(
                f"a layer window must be None or sliding_window ({sliding_window}), got {window!r}"
            )


# Window semantics, the same in the three places that compute it:
# - transformers 5.19 masking_utils.py:93-101 (sliding_window_overlay): key kv_idx is seen by
#   query q_idx iff kv_idx > q_idx - sliding_window, on top of the causal kv_idx <= q_idx
#   (masking_utils.py:77-82): a query sees `window` keys, itself included.
# - vLLM flash_attn.py:1082 (and triton_attn.py:484) pass window_size (sliding_window - 1, 0):
#   sliding_window - 1 keys to the left plus the query's own, the same `window` keys;
#   flex_attention.py:746 starts at q_idx - (sliding_window - 1).
# - ours: cachetier.kernels.torch_paged_attention.window_start.


def _sliding_window(architecture: str, config: Mapping[str, Any]) -> int | None:
    if architecture == "LlamaForCausalLM":
        return None
    if architecture == "Qwen2ForCausalLM" and not config.get("use_sliding_window"):
        # transformers configuration_qwen2.py:84 drops the window unless use_sliding_window.
        return None
    # A config without the key gets the class default, 4096 in MistralConfig and Qwen2Config
    # (configuration_mistral.py:80, configuration_qwen2.py:75); an explicit null means none.
    window = config.get("sliding_window", 4096)
    if window is not None and not _is_count(window):
        raise ValueError(f"sliding_window must be null or a positive int, got {window!r}")
    return window


def _layer_windows(
    architecture: str, config: Mapping[str, Any], window: int | None, num_layers: int
) -> tuple[int | None, ...]:
    if not _is_count(num_layers):
        raise ValueError(f"num_hidden_layers must be a positive int, got {num_layers!r}")
    if architecture != "Qwen2ForCausalLM":
        # MistralModel windows every layer with config.sliding_window and ignores layer_types
        # (transformers modeling_mistral.py:353, configuration_mistral.py:88 only warns).
        return (window,) * num_layers
    layer_types = config.get("layer_types")
    if layer_types is None:
        # Derived as transformers configuration_qwen2.py:88-94 does: the layers from
        # max_window_layers (default 28) on slide, the ones before attend fully.
        first = config.get("max_window_layers", 28)
        layer_types = [
            "sliding_attention" if window is not None and i >= first else "full_attention"
            for i in range(num_layers)
        ]
    if not isinstance(layer_types, list) or len(layer_types) != num_layers:
        raise ValueError(f"layer_types must list one type per layer ({num_layers})")
    kinds = {"full_attention": None, "sliding_attention": window}
    if not set(layer_types) <= kinds.keys():
        raise ValueError(f"layer_types may hold only {sorted(kinds)}, got {layer_types!r}")
    if window is None and "sliding_attention" in layer_types:
        # transformers raises here too (masking_utils.create_sliding_window_causal_mask).
        raise ValueError("layer_types has sliding_attention layers but the config no window")
    return tuple(kinds[t] for t in layer_types)
