"""``ModelSpec``: what a config.json says about a Llama-family model, and what it refuses."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from cachetier.engine.model_spec import ModelSpec


def llama_config(**overrides: object) -> dict[str, object]:
    config: dict[str, object] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "num_hidden_layers": 4,
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "vocab_size": 1000,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "max_position_embeddings": 4096,
        "bos_token_id": 1,
        "eos_token_id": 2,
    }
    config.update(overrides)
    return config


@pytest.mark.parametrize(
    "config",
    [
        {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "n_layer": 12},
        {"model_type": "bert", "num_hidden_layers": 12},
        llama_config(architectures=["Gemma2ForCausalLM"]),
    ],
)
def test_model_spec_rejects_unknown_architecture(tmp_path: Path, config: dict) -> None:
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="is not Llama-family"):
        ModelSpec.from_folder(tmp_path)


def test_model_spec_reads_legacy_llama_config() -> None:
    spec = ModelSpec.from_config(
        llama_config(
            rope_scaling={"type": "linear", "factor": 2.0},
            eos_token_id=[2, 7],
            head_dim=None,
        )
    )
    assert spec.architecture == "LlamaForCausalLM"
    assert (spec.num_heads, spec.num_kv_heads, spec.head_dim) == (8, 2, 16)
    assert spec.rope_theta == 500000.0
    assert spec.rope_scaling == {"rope_type": "linear", "factor": 2.0}
    assert spec.eos_token_ids == (2, 7)
    assert not spec.attention_bias and spec.sliding_window is None


def test_model_spec_reads_v5_rope_parameters() -> None:
    llama3 = {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    spec = ModelSpec.from_config(llama_config(rope_theta=None, rope_parameters=llama3))
    assert spec.rope_theta == 500000.0
    assert spec.rope_scaling == {k: v for k, v in llama3.items() if k != "rope_theta"}
    plain = {"rope_type": "default", "rope_theta": 10000.0}
    assert ModelSpec.from_config(llama_config(rope_parameters=plain)).rope_scaling is None


def test_model_spec_reads_qwen2_and_mistral() -> None:
    qwen2 = ModelSpec.from_config(
        llama_config(
            architectures=["Qwen2ForCausalLM"],
            model_type="qwen2",
            bos_token_id=None,
            use_sliding_window=False,
            sliding_window=4096,
            tie_word_embeddings=True,
        )
    )
    assert qwen2.attention_bias and qwen2.sliding_window is None and qwen2.bos_token_id is None
    assert qwen2.tie_word_embeddings
    mistral = ModelSpec.from_config(
        llama_config(architectures=None, model_type="mistral", sliding_window=4096)
    )
    assert mistral.architecture == "MistralForCausalLM" and mistral.sliding_window == 4096
    # Qwen2 windows the layers from max_window_layers on (transformers' layer_types).
    windowed = ModelSpec.from_config(
        llama_config(
            architectures=["Qwen2ForCausalLM"],
            use_sliding_window=True,
            sliding_window=64,
            max_window_layers=2,
        )
    )
    assert windowed.layer_windows == (None, None, 64, 64)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"num_kv_heads": 3}, "multiple of num_kv_heads"),
        ({"head_dim": 0}, "head_dim must be a positive int"),
        ({"vocab_size": 2.5}, "vocab_size must be a positive int"),
        ({"rope_theta": -1.0}, "rope_theta must be a positive number"),
        ({"eos_token_ids": (1000,)}, "below vocab_size"),
        ({"sliding_window": 0}, "sliding_window"),
        ({"architecture": "GPT2LMHeadModel"}, "is not Llama-family"),
    ],
)
def test_model_spec_validates_its_fields(change: dict[str, object], message: str) -> None:
    spec = ModelSpec.from_config(llama_config())
    with pytest.raises(ValueError, match=message):
        dataclasses.replace(spec, **change)


def test_model_spec_names_what_is_missing(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no config.json"):
        ModelSpec.from_folder(tmp_path)
    config = llama_config()
    del config["intermediate_size"]
    with pytest.raises(ValueError, match="lacks 'intermediate_size'"):
        ModelSpec.from_config(config)
    with pytest.raises(ValueError, match="hidden_act"):
        ModelSpec.from_config(llama_config(hidden_act="gelu"))
