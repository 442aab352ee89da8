"""Sliding-window models in the engine: the per-layer windows of their configs, logits equal to
transformers' past the window (prefill in chunks, then greedy decode), and a prefix from the
pool or from the disk after a restart giving the tokens of a cold run."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from cachetier.engine.llm import LLM
from cachetier.engine.model import LlamaModel
from cachetier.engine.model_spec import ModelSpec
from cachetier.engine.sampling import SamplingParams
from cachetier.engine.weights import load_weights
from cachetier.store.config import StoreConfig
from tests.engine.pool_forward import pool_logits
from tests.models import make_tiny_sliding

BLOCK = 16
WINDOW = 24
INTERLEAVED = ["full_attention", "sliding_attention", "full_attention", "sliding_attention"]
GREEDY = SamplingParams(temperature=0, max_tokens=10)
PROMPT = [(i * 7 + 3) % 250 for i in range(150)]  # 9 full blocks of 16 and a partial one


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """An all-sliding Mistral (head_dim 16: the torch paths throughout) and an interleaved Qwen2
    whose head_dim of 64 takes the native CPU kernels: its full layers for prefill and decode,
    its sliding ones for decode (the torch path prefills them)."""
    root = tmp_path_factory.mktemp("sliding")
    return {
        "mistral": make_tiny_sliding(root / "mistral", "mistral", sliding_window=WINDOW),
        "qwen2": make_tiny_sliding(
            root / "qwen2",
            "qwen2",
            sliding_window=WINDOW,
            layer_types=INTERLEAVED,
            hidden_size=128,
            num_heads=2,
            num_kv_heads=1,
        ),
    }


def _qwen2(**overrides: object) -> dict[str, object]:
    config: dict[str, object] = {
        "architectures": ["Qwen2ForCausalLM"],
        "num_hidden_layers": 4,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "vocab_size": 256,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 2048,
        "use_sliding_window": True,
        "sliding_window": 24,
    }
    config.update(overrides)
    return config


@pytest.mark.parametrize(
    "overrides",
    [
        {"max_window_layers": 2},
        {"max_window_layers": 0},
        {"max_window_layers": 4},
        {"max_window_layers": 1, "use_sliding_window": False},
        {"layer_types": INTERLEAVED},
        {},  # max_window_layers absent: transformers' default of 28 leaves every layer full
    ],
)
def test_qwen2_layer_windows_are_transformers_layer_types(overrides: dict[str, object]) -> None:
    from transformers import Qwen2Config

    config = _qwen2(**overrides)
    hf = Qwen2Config(**{k: v for k, v in config.items() if k != "architectures"})
    spec = ModelSpec.from_config(config)
    expected = [hf.sliding_window if t == "sliding_attention" else None for t in hf.layer_types]
    assert [spec.window_of(i) for i in range(4)] == expected
    assert spec.sliding_window == hf.sliding_window
    assert spec.layer_windows == (tuple(expected) if any(expected) else ())


def test_mistral_windows_every_layer_and_a_bad_layer_type_is_refused() -> None:
    mistral = dict(_qwen2(), architectures=["MistralForCausalLM"])
    del mistral["sliding_window"]  # MistralConfig's default window then: 4096
    assert ModelSpec.from_config(mistral).layer_windows == (4096,) * 4
    mistral["sliding_window"] = None
    assert ModelSpec.from_config(mistral).layer_windows == ()  # every layer full
    with pytest.raises(ValueError, match="no window"):
        ModelSpec.from_config(_qwen2(use_sliding_window=False, layer_types=INTERLEAVED))
    with pytest.raises(ValueError, match="layer_types"):
        ModelSpec.from_config(_qwen2(layer_types=["full_attention"] * 3))
    spec = ModelSpec.from_config(_qwen2())
    with pytest.raises(ValueError, match="one per layer"):
        dataclasses.replace(spec, layer_windows=(None, 24))
    with pytest.raises(ValueError, match="None or sliding_window"):
        dataclasses.replace(spec, layer_windows=(None, 0, None, None))
    assert dataclasses.replace(spec, layer_windows=(None,) * 4) == spec  # stored as ()


def _hf_logits(folder: Path, tokens: list[int]) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    with torch.inference_mode():
        return hf(torch.tensor([tokens])).logits[0].float()


@pytest.mark.parametrize("name", ["mistral", "qwen2"])
@pytest.mark.parametrize("chunks", [[100], [37, 1, 62], [20, 16, 64]])
def test_logits_match_transformers_past_the_window(
    folders: dict[str, Path], name: str, chunks: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    import cachetier.kernels.paged_attention as decode_module

    folder = folders[name]
    spec = ModelSpec.from_folder(folder)
    assert spec.layer_windows == ((WINDOW,) * 4 if name == "mistral" else (None, 24, None, 24))
    native_windows = []
    real = decode_module.paged_attention_decode_native

    def recording(inputs: object, num_shared_blocks: int = 0, window: int | None = None):
        out = real(inputs, num_shared_blocks, window)
        native_windows.append(window if out is not None else "torch")
        return out

    monkeypatch.setattr(decode_module, "paged_attention_decode_native", recording)
    prompt = torch.randint(0, 256, (100,), generator=torch.Generator().manual_seed(1)).tolist()
    weights = load_weights(folder)
    ours, tokens = pool_logits(
        LlamaModel(spec, weights, torch.float32), prompt, chunks, num_decode=6
    )
    expected = _hf_logits(folder, tokens)
    assert len(tokens) == 106
    torch.testing.assert_close(ours, expected, atol=1e-4, rtol=1e-4)
    # Qwen2's head_dim of 64 decodes natively, its sliding layers with the window; Mistral's
    # head_dim of 16 is a shape the extension does not take.
    runs = {"qwen2": {None, WINDOW}, "mistral": {"torch"}}[name]
    assert set(native_windows) == runs and len(native_windows) == 6 * 4 + chunks.count(1) * 4
    # The same engine with the windows dropped, on the same tokens: within the window nothing
    # changes; every row past it moves by far more than the tolerance above, so the match is
    # the window's and cannot hold by accident.
    unwindowed = LlamaModel(dataclasses.replace(spec, layer_windows=()), weights, torch.float32)
    full, _ = pool_logits(unwindowed, tokens, [len(tokens)])
    torch.testing.assert_close(full[:WINDOW], expected[:WINDOW], atol=1e-4, rtol=1e-4)
    assert (full[WINDOW:] - expected[WINDOW:]).abs().amax(dim=-1).min() > 1e-3


def _hf_greedy(folder: Path, prompt: list[int], num_tokens: int) -> list[int]:
    # transformers' greedy tokens, each from a forward over the whole sequence (no HF cache).
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    tokens = list(prompt)
    with torch.inference_mode():
        for _ in range(num_tokens):
            tokens.append(int(hf(torch.tensor([tokens])).logits[0, -1].argmax()))
    return tokens[len(prompt) :]


@pytest.mark.parametrize("name", ["mistral", "qwen2"])
def test_pool_hit_and_disk_restart_give_the_cold_tokens(
    folders: dict[str, Path], name: str, tmp_path: Path
) -> None:
    folder = folders[name]
    behind = [PROMPT[:128] + [9] * n for n in (1, 20, 37)]  # decode together behind 8 blocks
    prompts = [PROMPT, PROMPT[:100] + [5, 6, 7] * 20, PROMPT + [1, 2, 3], *behind]
    cold_llm = LLM(folder, enable_prefix_caching=False, kv_cache_bytes=4 << 20)
    cold = [o.token_ids for o in cold_llm.generate(prompts, GREEDY)]
    assert cold[0] == _hf_greedy(folder, PROMPT, GREEDY.max_tokens)

    config = StoreConfig(cpu_bytes=64 << 20, disk_path=str(tmp_path / "disk"), fsync=False)
    with LLM(folder, store=config, kv_cache_bytes=4 << 20, guard=False) as llm:
        first = llm.generate([prompts[0]], GREEDY)[0]
        hit = llm.generate([prompts[1]], GREEDY)[0]
        together = llm.generate(behind, GREEDY)
    assert first.num_cached_tokens == 0 and first.token_ids == cold[0]
    assert hit.cached_tokens_by_source == {"pool": 96} and hit.token_ids == cold[1]
    assert [o.num_cached_tokens for o in together] == [128] * 3
    assert [o.token_ids for o in together] == cold[3:]

    with LLM(folder, store=config, kv_cache_bytes=4 << 20, guard=False) as llm:
        restored = llm.generate([prompts[2]], GREEDY)[0]
    assert restored.cached_tokens_by_source == {"disk": 144}
    assert restored.token_ids == cold[2]


@pytest.mark.parametrize("name", ["mistral", "qwen2"])
def test_windowed_prefill_with_kv_repeated_per_query_head_matches_transformers(
    folders: dict[str, Path], name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The SDPA form CUDA takes (K/V repeated per query head, cachetier.engine.model
    # _EXPAND_GQA_DEVICES), run here on the CPU, with the window as an explicit mask.
    import cachetier.engine.model

    monkeypatch.setattr(cachetier.engine.model, "_EXPAND_GQA_DEVICES", ("cpu",))
    folder = folders[name]
    prompt = torch.randint(0, 256, (150,), generator=torch.Generator().manual_seed(3)).tolist()
    model = LlamaModel(ModelSpec.from_folder(folder), load_weights(folder), torch.float32)
    ours, tokens = pool_logits(model, prompt, [80, 70], num_decode=2)
    torch.testing.assert_close(ours, _hf_logits(folder, tokens), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("name", ["mistral", "qwen2"])
def test_fp8_pool_windows_like_full_precision(folders: dict[str, Path], name: str) -> None:
    # An fp8 pool reads dequantised K/V through the same windowed paths.
    folder = folders[name]
    spec, weights = ModelSpec.from_folder(folder), load_weights(folder)
    model = LlamaModel(spec, weights, torch.float32)
    unwindowed = LlamaModel(dataclasses.replace(spec, layer_windows=()), weights, torch.float32)
    prompt = torch.randint(0, 256, (100,), generator=torch.Generator().manual_seed(1)).tolist()
    for chunks in ([100], [37, 1, 62], [60] + [1] * 16):
        ref = pool_logits(model, prompt, chunks)[0]
        full = pool_logits(unwindowed, prompt, chunks)[0]
        got = pool_logits(model, prompt, chunks, "float8_e4m3fn")[0]
        diff = (got - ref).abs()
        # Measured (|logit| up to ~4): max 0.15, mean 0.022, top-1 0.95 or more; against the
        # same model without windows the mean past the window is 0.23 or more.
        assert 0 < diff.max().item() < 0.25 and diff.mean().item() < 0.03, chunks
        assert (got.argmax(-1) == ref.argmax(-1)).float().mean().item() >= 0.9, chunks
        assert (got - full)[WINDOW:].abs().mean().item() > 4 * diff.mean().item(), chunks
