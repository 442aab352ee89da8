"""benchmarks.support.arch_models: small random-weight folders of each attention arrangement."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from benchmarks.support.arch_models import KINDS, WINDOW, layer_windows, make_arch_model

# What each kind's layers are, as transformers reads the folder's config.
LAYER_TYPES = {
    "llama": None,  # no per-layer types: full attention everywhere
    "mistral_sliding": None,  # one window for every layer, in ``sliding_window``
    "qwen2_interleaved": ["full_attention"] * 2 + ["sliding_attention"] * 2,
    "gemma3": ["sliding_attention", "full_attention"] * 2,
    "granitemoehybrid": ["linear_attention", "full_attention"] * 2,
}
WINDOWS = {
    "llama": None,
    "mistral_sliding": WINDOW,
    "qwen2_interleaved": WINDOW,
    "gemma3": WINDOW,
    "granitemoehybrid": None,
}


def test_every_kind_is_checked() -> None:
    assert set(LAYER_TYPES) == set(KINDS) == set(WINDOWS)


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_folder_loads_with_the_intended_layers(tmp_path: Path, kind: str) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from cachetier.engine.smollm2 import smollm2_path

    folder = make_arch_model(kind, tmp_path / kind)
    config = AutoConfig.from_pretrained(folder)
    assert getattr(config, "layer_types", None) == LAYER_TYPES[kind]
    assert getattr(config, "sliding_window", None) == WINDOWS[kind]
    types = LAYER_TYPES[kind] or ["sliding_attention" if WINDOWS[kind] else "full_attention"] * 2
    want = [WINDOW if t == "sliding_attention" else None for t in types]
    assert layer_windows(folder) == want
    tokenizer = AutoTokenizer.from_pretrained(folder)
    assert config.vocab_size == len(AutoTokenizer.from_pretrained(smollm2_path())) == 49152
    model, info = AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, output_loading_info=True
    )
    # Every weight came from the folder (a missing one would be freshly drawn at load).
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    ids = tokenizer("a prompt", return_tensors="pt").input_ids
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == (1, ids.shape[1], config.vocab_size)


def test_same_seed_same_weights_and_a_full_folder_is_refused(tmp_path: Path) -> None:
    one = make_arch_model("llama", tmp_path / "one", seed=5)
    two = make_arch_model("llama", tmp_path / "two", seed=5)
    other = make_arch_model("llama", tmp_path / "other", seed=6)
    weights = [(f / "model.safetensors").read_bytes() for f in (one, two, other)]
    assert weights[0] == weights[1] != weights[2]
    with pytest.raises(ValueError, match="already holds"):
        make_arch_model("llama", one)
    with pytest.raises(ValueError, match="unknown kind"):
        make_arch_model("rwkv", tmp_path / "rwkv")
