"""Tiny random-weight models for tests: real Hugging Face folders, small enough to make often.

A support module (not a test module): conftest.py and test modules import it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from cachetier.engine.model_spec import ModelSpec


def make_tiny_llama(
    path: str | Path,
    *,
    seed: int = 0,
    num_layers: int = 2,
    hidden_size: int = 64,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    vocab_size: int = 256,
    max_position_embeddings: int = 2048,
    intermediate_size: int | None = None,
    rope_theta: float = 10000.0,
    rms_norm_eps: float = 1e-6,
    tie_word_embeddings: bool = False,
    bos_token_id: int = 1,
    eos_token_id: int = 2,
) -> Path:
    """Write a random-weight Llama folder (config.json, model.safetensors) and return its path.

    The same arguments give the same bytes. Weights are drawn from their own generator, scaled
    so activations stay near unit size and greedy decoding gives varied tokens; the caller's
    global RNG is left untouched. No tokenizer: tests feed token ids.
    """
    if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
        raise ValueError(f"seed must be a non-negative int, got {seed!r}")
    if num_heads <= 0 or hidden_size <= 0 or hidden_size % num_heads:
        raise ValueError(
            f"hidden_size ({hidden_size}) must be a multiple of num_heads ({num_heads})"
        )
    spec = ModelSpec(  # validates the rest
        architecture="LlamaForCausalLM",
        num_layers=num_layers,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size or 2 * hidden_size,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=hidden_size // num_heads,
        vocab_size=vocab_size,
        rms_norm_eps=rms_norm_eps,
        rope_theta=rope_theta,
        rope_scaling=None,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings,
        bos_token_id=bos_token_id,
        eos_token_ids=(eos_token_id,),
    )
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        num_hidden_layers=spec.num_layers,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        head_dim=spec.head_dim,
        vocab_size=spec.vocab_size,
        max_position_embeddings=spec.max_position_embeddings,
        rms_norm_eps=spec.rms_norm_eps,
        rope_parameters={"rope_type": "default", "rope_theta": float(spec.rope_theta)},
        tie_word_embeddings=spec.tie_word_embeddings,
        bos_token_id=bos_token_id,
        eos_token_id=eos_token_id,
    )
    return _save_random(LlamaForCausalLM, config, path, seed)


def make_tiny_sliding(
    path: str | Path,
    architecture: str,
    *,
    sliding_window: int,
    layer_types: list[str] | None = None,
    max_window_layers: int | None = None,
    seed: int = 0,
    num_layers: int = 4,
    hidden_size: int = 64,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    vocab_size: int = 256,
) -> Path:
    """Write a random-weight sliding-window folder and return its path, as ``make_tiny_llama``.

    Args:
        architecture: ``"mistral"`` (every layer slides) or ``"qwen2"`` (``use_sliding_window``
            on; the layers ``layer_types`` names, else those from ``max_window_layers`` on).
        sliding_window: the window in tokens.
        layer_types: Qwen2 only: ``"sliding_attention"`` / ``"full_attention"`` per layer.
        max_window_layers: Qwen2 only: the first sliding layer where ``layer_types`` is None.
    """
    from transformers import MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM

    sizes = dict(
        num_hidden_layers=num_layers,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        vocab_size=vocab_size,
        max_position_embeddings=2048,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        sliding_window=sliding_window,
    )
    if architecture == "mistral":
        if layer_types is not None or max_window_layers is not None:
            raise ValueError("Mistral windows every layer: pass no layer_types/max_window_layers")
        return _save_random(MistralForCausalLM, MistralConfig(**sizes), path, seed)
    if architecture != "qwen2":
        raise ValueError(f"architecture must be 'mistral' or 'qwen2', got {architecture!r}")
    config = Qwen2Config(
        **sizes,
        use_sliding_window=True,
        layer_types=layer_types,
        max_window_layers=num_layers if max_window_layers is None else max_window_layers,
    )
    return _save_random(Qwen2ForCausalLM, config, path, seed)


def _save_random(model_class: type, config: Any, path: str | Path, seed: int) -> Path:
    """Build ``model_class(config)`` with seeded random weights and save it under ``path``."""
    # transformers initialises from the global RNG; fork it so the caller's stream is unchanged.
    with torch.random.fork_rng(devices=[]):
        model = model_class(config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator, dtype=torch.float32)
            if param.ndim == 1 and name.endswith("norm.weight"):  # RMSNorm gains: near one
                param.copy_(1.0 + 0.1 * noise)
            elif param.ndim == 1:  # projection biases (Qwen2's q/k/v): small
                param.copy_(0.1 * noise)
            elif name == "model.embed_tokens.weight" and not config.tie_word_embeddings:
                param.copy_(noise)
            else:  # [out_features, in_features]: 1/sqrt(fan_in) keeps outputs near unit size
                param.copy_(noise / param.shape[1] ** 0.5)
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    return path


class ForwardTokens:
    """Counts the tokens each forward of the decoder stack is given (a forward pre-hook)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.lengths: list[int] = []
        self._handle = model.model.register_forward_pre_hook(self._hook, with_kwargs=True)

    def _hook(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        input_ids = kwargs.get("input_ids", args[0] if args else None)
        self.lengths.append(int(input_ids.shape[-1]))

    def __enter__(self) -> ForwardTokens:
        return self

    def __exit__(self, *exc: object) -> None:
        self._handle.remove()
