"""``load_weights``, and the tiny random Llama (``tests.models``) the engine tests run on."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from cachetier.engine.model_spec import ModelSpec
from cachetier.engine.weights import load_weights
from tests.models import make_tiny_llama


def test_tiny_llama_is_deterministic_per_seed(tmp_path: Path) -> None:
    a = make_tiny_llama(tmp_path / "a", seed=3)
    b = make_tiny_llama(tmp_path / "b", seed=3)
    c = make_tiny_llama(tmp_path / "c", seed=4)
    for name in ("config.json", "model.safetensors"):
        assert (a / name).read_bytes() == (b / name).read_bytes()
    weights_a, weights_c = load_file(a / "model.safetensors"), load_file(c / "model.safetensors")
    assert weights_a.keys() == weights_c.keys()
    for name in weights_a:
        assert not torch.equal(weights_a[name], weights_c[name]), name


def test_tiny_llama_leaves_the_global_rng_alone(tmp_path: Path) -> None:
    torch.manual_seed(1234)
    expected = torch.rand(4)
    torch.manual_seed(1234)
    make_tiny_llama(tmp_path / "m", seed=0)
    torch.testing.assert_close(torch.rand(4), expected, rtol=0, atol=0)


def test_tiny_llama_loads_in_transformers(tiny_model_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    assert model.dtype == torch.float32
    weights = load_weights(tiny_model_dir)
    state = model.state_dict()
    assert weights.keys() == state.keys()
    for name, tensor in weights.items():
        torch.testing.assert_close(state[name], tensor, rtol=0, atol=0)

    token_ids = torch.tensor([[1, 5, 17, 42, 99, 200, 7]])
    with torch.no_grad():
        logits = model(token_ids).logits  # [batch, tokens, vocab]
        greedy = token_ids
        for _ in range(12):
            next_id = model(greedy).logits[:, -1].argmax(dim=-1, keepdim=True)
            greedy = torch.cat([greedy, next_id], dim=1)
    assert logits.shape == (1, 7, 256)
    assert torch.isfinite(logits).all()
    # Weights scaled to unit activations: greedy decoding does not collapse to one token.
    assert len(set(greedy[0, 7:].tolist())) > 2


def test_tiny_llama_spec_matches_its_arguments(tmp_path: Path) -> None:
    folder = make_tiny_llama(
        tmp_path / "m",
        num_layers=3,
        hidden_size=96,
        num_heads=6,
        num_kv_heads=3,
        vocab_size=300,
        max_position_embeddings=512,
        rope_theta=50000.0,
    )
    assert ModelSpec.from_folder(folder) == ModelSpec(
        architecture="LlamaForCausalLM",
        num_layers=3,
        hidden_size=96,
        intermediate_size=192,
        num_heads=6,
        num_kv_heads=3,
        head_dim=16,
        vocab_size=300,
        rms_norm_eps=1e-6,
        rope_theta=50000.0,
        rope_scaling=None,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_ids=(2,),
    )


def test_tiny_llama_with_tied_embeddings(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    folder = make_tiny_llama(tmp_path / "tied", tie_word_embeddings=True)
    with safe_open(folder / "model.safetensors", framework="pt") as f:
        assert "lm_head.weight" not in f.keys()
    weights = load_weights(folder)
    assert weights["lm_head.weight"] is weights["model.embed_tokens.weight"]
    model = AutoModelForCausalLM.from_pretrained(folder)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"num_heads": 3}, "multiple of num_heads"),
        ({"num_kv_heads": 3}, "multiple of num_kv_heads"),
        ({"num_layers": 0}, "num_layers must be a positive int"),
        ({"seed": -1}, "seed must be a non-negative int"),
        ({"eos_token_id": 256}, "below vocab_size"),
    ],
)
def test_make_tiny_llama_rejects_bad_shapes(
    tmp_path: Path, kwargs: dict[str, int], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        make_tiny_llama(tmp_path / "bad", **kwargs)
    assert not (tmp_path / "bad").exists()
