"""``HFCacheConnector`` with sliding-window models (all-sliding Mistral, interleaved Qwen2): a
restored prefix longer than the window leaves each layer as a cold prefill does and gives the
same tokens and logits; hybrid models with recurrent layers are refused before anything is
stored."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers

from cachetier.connectors.hf import HFCacheConnector
from cachetier.connectors.hf_layers import check_layer_types
from cachetier.store.tiered import TieredStore
from cachetier.tiers.cpu import CPUTier, CPUTierConfig
from tests.models import ForwardTokens

MiB = 1 << 20
BLOCK_SIZE = 16
WINDOW = 24  # shorter than every restored prefix below but the forked one's
NEW_TOKENS = 10
PROMPT_TOKENS = 100  # restores (100 - 1) // 16 = 6 blocks: 96 tokens, four times the window

_COMMON = dict(
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    vocab_size=256,
    max_position_embeddings=512,
    bos_token_id=1,
    eos_token_id=2,
    tie_word_embeddings=False,
)
_SLIDING_MODELS = {
    # Every layer slides (MistralConfig.sliding_window; no layer_types).
    "mistral": dict(num_hidden_layers=3, sliding_window=WINDOW),
    # Sliding and full layers interleaved through layer_types.
    "qwen2": dict(
        num_hidden_layers=4,
        use_sliding_window=True,
        sliding_window=WINDOW,
        layer_types=["sliding_attention", "full_attention"] * 2,
    ),
}
_RECURRENT_MODELS = {
    # Gated delta net layers beside full attention (torch fallbacks run on CPU).
    "qwen3_next": dict(
        num_hidden_layers=2,
        layer_types=["linear_attention", "full_attention"],
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=32,
        linear_num_key_heads=2,
        linear_num_value_heads=2,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
    ),
    # Mamba2 layers beside one attention layer.
    "bamba": dict(
        num_hidden_layers=2,
        attn_layer_indices=[1],
        mamba_n_heads=4,
        mamba_d_head=16,
        mamba_d_state=16,
        mamba_n_groups=1,
        mamba_expand=1,
    ),
}


def _build(model_type: str, settings: dict[str, Any], *, seed: int = 0) -> torch.nn.Module:
    """A random-weight causal LM, weights scaled as ``tests.models.make_tiny_llama`` scales
    them so greedy decoding gives varied tokens."""
    config = transformers.AutoConfig.for_model(model_type, **_COMMON, **settings)
    with torch.random.fork_rng(devices=[]):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            if param.ndim == 1 and "norm" in name:
                param.copy_(1.0 + 0.1 * noise)
            elif param.ndim == 1:
                param.copy_(0.1 * noise)
            elif name == "model.embed_tokens.weight":
                param.copy_(noise)
            else:
                param.copy_(noise / param.shape[-1] ** 0.5)
    return model.eval()


@pytest.fixture(scope="module", params=sorted(_SLIDING_MODELS))
def sliding(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[torch.nn.Module, Path]:
    """``(model, folder)`` of one sliding-window model, written to and loaded from its folder."""
    folder = tmp_path_factory.mktemp(f"tiny-{request.param}")
    _build(request.param, _SLIDING_MODELS[request.param]).save_pretrained(folder)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, local_files_only=True
    )
    return model.eval(), folder


@pytest.fixture
def store() -> Iterator[TieredStore]:
    with TieredStore([CPUTier(CPUTierConfig(32 * MiB))]) as s:
        yield s


def _prompt(num_tokens: int, *, seed: int = 1) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, 256, (1, num_tokens), generator=generator)


def _generate(run: Any, prompt: torch.Tensor, **kwargs: Any) -> Any:
    return run(
        prompt,
        max_new_tokens=NEW_TOKENS,
        do_sample=False,
        return_dict_in_generate=True,
        output_logits=True,
        **kwargs,
    )


def _plain(model: torch.nn.Module, prompt: torch.Tensor) -> Any:
    return _generate(model.generate, prompt, attention_mask=torch.ones_like(prompt))


def _held(cache: Any) -> list[tuple[int, int]]:
    """Per layer: (tokens it counts, tokens whose K it holds)."""
    return [(layer.get_seq_length(), layer.keys.shape[-2]) for layer in cache.layers]


def _expected_held(model: torch.nn.Module, num_tokens: int) -> list[tuple[int, int]]:
    """What a prefill of ``num_tokens`` leaves: a sliding layer keeps its last window - 1."""
    num_layers = model.config.num_hidden_layers
    types = getattr(model.config, "layer_types", None) or ["sliding_attention"] * num_layers
    return [
        (num_tokens, min(num_tokens, WINDOW - 1) if t == "sliding_attention" else num_tokens)
        for t in types
    ]


def _assert_same_output(out: Any, expected: Any) -> None:
    assert torch.equal(out.sequences, expected.sequences)
    for ours, theirs in zip(out.logits, expected.logits, strict=True):
        torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)


def _has_full_layers(model: torch.nn.Module) -> bool:
    return "full_attention" in (getattr(model.config, "layer_types", None) or ())


def test_a_prefix_longer_than_the_window_restores_to_the_same_tokens_and_logits(
    sliding: tuple[torch.nn.Module, Path], store: TieredStore
) -> None:
    model, folder = sliding
    prompt = _prompt(PROMPT_TOKENS)
    with ForwardTokens(model) as plain_forward:
        plain = _plain(model, prompt)
    conn = HFCacheConnector(model, store, model_folder=folder, record_tokens=BLOCK_SIZE)

    cold, cold_info = _generate(conn.generate, prompt)
    with ForwardTokens(model) as warm_forward:
        warm, warm_info = _generate(conn.generate, prompt)

    # Every prompt block of the full layers, and the window a hit of it needs (blocks 4 and 5:
    # tokens 73..96) of the sliding ones.
    assert cold_info.num_saved_blocks == (6 if _has_full_layers(model) else 2)
    assert cold_info.num_cached_tokens == 0
    assert warm_info.num_cached_tokens == 96 and warm_info.num_computed_prompt_tokens == 4
    assert plain_forward.lengths[0] == PROMPT_TOKENS and warm_forward.lengths[0] == 4
    _assert_same_output(cold, plain)
    _assert_same_output(warm, plain)
    # The caches given back hold what plain generate's holds: sliding layers only their window.
    num_cached = PROMPT_TOKENS + NEW_TOKENS - 1
    assert _held(plain.past_key_values) == _expected_held(model, num_cached)
    assert (
        _held(cold.past_key_values)
        == _held(warm.past_key_values)
        == _expected_held(model, num_cached)
    )

    # A prompt that leaves this one after 40 tokens: a hit of its first 32 tokens would need
    # the sliding layers' blocks 0 and 1, which were outside the window stored: no hit.
    forked = torch.cat([prompt[:, :40], _prompt(30, seed=2)], dim=1)
    expected = _plain(model, forked)
    out, info = _generate(conn.generate, forked)
    assert info.num_cached_tokens == 0
    # Its blocks 2 and 3, of every layer set: the window its own hit (64 tokens) needs.
    assert info.num_saved_blocks == 2
    _assert_same_output(out, expected)
    out, info = _generate(conn.generate, forked)
    assert info.num_cached_tokens == 64
    _assert_same_output(out, expected)


def test_a_restored_cache_holds_what_a_cold_prefill_leaves(
    sliding: tuple[torch.nn.Module, Path], store: TieredStore
) -> None:
    model, folder = sliding
    prompt = _prompt(PROMPT_TOKENS, seed=3)
    conn = HFCacheConnector(model, store, model_folder=folder, record_tokens=BLOCK_SIZE)
    conn.generate(prompt, max_new_tokens=1, do_sample=False)

    restored, num_cached = conn.restore(prompt)
    assert num_cached == 96 and restored is not None
    cold = transformers.DynamicCache(config=model.config)
    with torch.no_grad():
        model(prompt[:, :96], past_key_values=cold, use_cache=True)
    # Restored as full layers, sliding layers would hold all 96 tokens, not their last 23.
    assert _held(restored) == _held(cold) == _expected_held(model, 96)
    for ours, theirs in zip(restored.layers, cold.layers, strict=True):
        assert type(ours) is type(theirs)
        torch.testing.assert_close(ours.keys, theirs.keys, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(ours.values, theirs.values, rtol=1e-5, atol=1e-5)

    # The next forward, over the prompt's last 4 tokens, sees the same thing from both.
    with torch.no_grad():
        warm_logits = model(prompt[:, 96:], past_key_values=restored, use_cache=True).logits
        cold_logits = model(prompt[:, 96:], past_key_values=cold, use_cache=True).logits
    torch.testing.assert_close(warm_logits, cold_logits, rtol=1e-4, atol=1e-4)


def test_a_cache_whose_window_dropped_the_missing_blocks_saves_no_window(
    sliding: tuple[torch.nn.Module, Path], store: TieredStore
) -> None:
    model, folder = sliding
    prompt = _prompt(PROMPT_TOKENS, seed=4)
    conn = HFCacheConnector(model, store, model_folder=folder, record_tokens=BLOCK_SIZE)
    cache = transformers.DynamicCache(config=model.config)
    with torch.no_grad():
        model(prompt, past_key_values=cache, use_cache=True)

    # The sliding layers kept tokens 77..99 only: the window a hit needs (from token 64) is
    # gone from them. The full layers' blocks are whole and saved; no hit comes of them alone.
    saved = conn.save(prompt, cache)
    assert saved == (6 if _has_full_layers(model) else 0)
    assert (store.used_bytes > 0) == bool(saved) and conn.restore(prompt) == (None, 0)


def test_our_engine_and_the_hf_connector_share_sliding_window_blocks(
    sliding: tuple[torch.nn.Module, Path], store: TieredStore
) -> None:
    from cachetier.engine.llm import LLM
    from cachetier.engine.sampling import SamplingParams

    model, folder = sliding
    conn = HFCacheConnector(model, store, model_folder=folder, record_tokens=BLOCK_SIZE)
    greedy = SamplingParams(temperature=0, max_tokens=NEW_TOKENS)

    # Engine first: its records, which keep every token of every layer, serve the HF model.
    prompt = _prompt(PROMPT_TOKENS, seed=6)
    engine = LLM(folder, store=store, kv_cache_bytes=4 * MiB, record_tokens=BLOCK_SIZE, guard=False)
    engine_out = engine.generate([prompt[0].tolist()], greedy)[0]
    engine.flush()
    expected = _plain(model, prompt)
    out, info = _generate(conn.generate, prompt)
    assert info.num_cached_tokens == 96
    _assert_same_output(out, expected)
    assert engine_out.token_ids == expected.sequences[0, PROMPT_TOKENS:].tolist()

    # HF first: a fresh engine (empty pool) restores the connector's records.
    prompt = _prompt(PROMPT_TOKENS, seed=7)
    _, info = _generate(conn.generate, prompt)
    assert info.num_saved_blocks == (6 if _has_full_layers(model) else 2)
    fresh = LLM(folder, store=store, kv_cache_bytes=4 * MiB, record_tokens=BLOCK_SIZE, guard=False)
    restored = fresh.generate([prompt[0].tolist()], greedy)[0]
    assert restored.cached_tokens_by_source == {"cpu": 96}
    assert restored.token_ids == _plain(model, prompt).sequences[0, PROMPT_TOKENS:].tolist()


@pytest.mark.parametrize("model_type", sorted(_RECURRENT_MODELS))
def test_a_model_with_recurrent_layers_is_refused_and_nothing_is_stored(
    model_type: str, store: TieredStore
) -> None:
    model = _build(model_type, _RECURRENT_MODELS[model_type])
    with pytest.raises(ValueError) as refused:
        HFCacheConnector(model, store, fingerprint="f" * 64, record_tokens=BLOCK_SIZE)
    assert str(refused.value) == (
        f"{model_type}: layer types ['full_attention', 'linear_attention']: cachetier's HF "
        "connector restores attention KV only; a recurrent layer's state is not stored. "
        "Run this model without the connector."
    )
    # Without the connector the model runs; the store saw nothing of it.
    prompt = _prompt(40, seed=5)
    out = model.generate(
        prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=2, do_sample=False
    )
    assert out.shape == (1, 42)
    assert store.used_bytes == 0


def test_a_layer_kind_not_checked_here_is_refused_by_name() -> None:
    # Chunked attention has the sliding layer's cache but another mask: not claimed here.
    config = transformers.AutoConfig.for_model(
        "qwen2",
        **_COMMON,
        num_hidden_layers=2,
        layer_types=["chunked_attention", "full_attention"],
        attention_chunk_size=16,
    )
    with pytest.raises(ValueError, match=r"^qwen2: layer types .*only, not chunked_attention\."):
        check_layer_types(config, 2)
    config = transformers.AutoConfig.for_model("qwen2", **_COMMON, num_hidden_layers=2)
    check_layer_types(config, 2)
    with pytest.raises(ValueError, match="cache has 2 layers, its config says 3"):
        check_layer_types(config, 3)


def test_gemma3_is_refused_by_the_record_check_and_restores_right_without_it(
    tmp_path: Path, store: TieredStore
) -> None:
    # Gemma's first layer is not Llama's (scaled embeddings, 1 + weight norms): the per-record
    # check cannot follow it and says so at start; without it, sliding and full layers mixed
    # restore as Qwen2's do.
    settings = dict(
        num_hidden_layers=4,
        sliding_window=WINDOW,
        layer_types=["sliding_attention", "full_attention"] * 2,
        query_pre_attn_scalar=16,
    )
    _build("gemma3_text", settings).save_pretrained(tmp_path)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, dtype=torch.float32, local_files_only=True
    ).eval()
    with pytest.raises(ValueError, match="not 'gemma3_text'.*record_check off"):
        HFCacheConnector(model, store, model_folder=tmp_path, record_tokens=BLOCK_SIZE)
    conn = HFCacheConnector(
        model, store, model_folder=tmp_path, record_tokens=BLOCK_SIZE, record_check=False
    )
    prompt = _prompt(PROMPT_TOKENS)
    plain = _plain(model, prompt)
    cold, cold_info = _generate(conn.generate, prompt)
    warm, warm_info = _generate(conn.generate, prompt)
    assert cold_info.num_saved_blocks == 6 and warm_info.num_cached_tokens == 96
    _assert_same_output(cold, plain)
    _assert_same_output(warm, plain)
    num_cached = PROMPT_TOKENS + NEW_TOKENS - 1
    assert _held(warm.past_key_values) == _expected_held(model, num_cached)
